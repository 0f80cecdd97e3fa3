"""The paged KV cache: its layout, the pool tensor, and the block bookkeeping.

Layout (one tensor per worker, allocated once at start):

    pool: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
                                   ^ 0 = K, 1 = V

Why this order: one block of one layer holds its K and V side by side, so a run of
consecutive blocks in one layer is one contiguous byte range (one copy, one NIXL
descriptor), and the same run across all layers is one strided view
(`pool[:, a:b]`), which a single `copy_` moves. Transports register and map this
tensor once; they address blocks by (layer, block) through `KVLayout`.

Block bookkeeping lives in `block_pool.py` (no torch).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from pdserve.protocol.shm import create_pool, remove_pools

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; use one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Everything two workers must agree on before KV bytes can move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    block_size: int
    num_blocks: int

    @classmethod
    def from_wire(cls, layout) -> "KVLayout":
        """A handshake's layout (protocol/kv.py Layout, the same fields in the same order)."""
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_size,
                   layout.num_blocks)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of the whole pool (the stride between layers)."""
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.block_bytes // self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) from the start of the pool."""
        return layer * self.layer_bytes + block * self.block_bytes

    def compatible_with(self, other: "KVLayout") -> bool:
        """Block counts may differ between workers; everything else must match."""
        mine, theirs = asdict(self), asdict(other)
        mine.pop("num_blocks"), theirs.pop("num_blocks")
        return mine == theirs

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head dim {self.head_dim}, "
            f"{self.dtype}, block size {self.block_size}"
        )


def blocks_for_budget(bytes_budget: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, block_size: int) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize
    return max(1, bytes_budget // per_block)


def remove_orphaned_pools() -> None:
    """Unlink shared pools whose creating process is gone (killed before it could clean up): this
    user's regular files only, whatever else /dev/shm holds (protocol/shm.py)."""
    remove_pools()


class KVCache:
    """The pool tensor. `shared=True` on CPU puts it in a named /dev/shm file so another
    process can map the same memory (the `ipc` transport); on GPU the allocation is
    exported with CUDA IPC by the transport itself."""

    def __init__(self, layout: KVLayout, device: torch.device | str, shared: bool = False):
        self.layout = layout
        self.device = torch.device(device)
        self.shm_path: str | None = None
        numel = math.prod(layout.shape)
        if shared and self.device.type == "cpu":
            remove_orphaned_pools()
            self.shm_path = create_pool(numel * torch.empty((), dtype=layout.torch_dtype).element_size())
            flat = torch.from_file(self.shm_path, shared=True, size=numel, dtype=layout.torch_dtype)
            flat.zero_()
            self.pool = flat.view(layout.shape)
        else:
            self.pool = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=self.device)

    def layer(self, layer: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, num_kv_heads, head_dim] view of one layer."""
        return self.pool[layer]

    def close(self) -> None:
        if self.shm_path is not None:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
            self.shm_path = None

    def __del__(self):
        self.close()
