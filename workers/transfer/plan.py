"""What one request's move consists of: paired runs of blocks, the views and descriptors that cover them.

Every transport moves a request as (src_start, dst_start, length) runs where both sides are
consecutive (`block_pool.paired_runs`), never block by block:

    bulk   after prefill, one strided copy per run for all layers: dst[:, d:d+n] <- src[:, s:s+n]
           (ipc on GPU switches to per-layer copies for large requests; see ipc.py)
    layer  one copy per run per layer, each layer's as soon as its K/V exist:
           dst[l, d:d+n] <- src[l, s:s+n]  (contiguous bytes)

NIXL gets one descriptor per (layer, run): `descriptors()` builds the (addr, len, dev) rows
with numpy, so a request costs layers x runs rows whatever the pool size; a request of many short
runs goes through staging instead (staging.py: one descriptor per span of layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.workers.engine.block_pool import blocks_for, paired_runs
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.transfer.errors import TransferError


@dataclass(frozen=True)
class Plan:
    request_id: str
    runs: tuple[tuple[int, int, int], ...]  # (src_start, dst_start, length)
    num_layers: int
    block_bytes: int  # one block of one layer, K and V

    @property
    def num_blocks(self) -> int:
        return sum(n for _, _, n in self.runs)

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


def make_plan(request_id: str, src_blocks: list[int], dst_blocks: list[int], num_tokens: int,
              src: KVLayout, dst: KVLayout) -> Plan:
    """Check the block lists against both pools and pair them into runs."""
    need = blocks_for(num_tokens, src.block_size)
    if len(src_blocks) != need or len(dst_blocks) != need:
        raise TransferError(
            f"request {request_id}: {num_tokens} tokens need {need} blocks of {src.block_size}, got "
            f"{len(src_blocks)} source and {len(dst_blocks)} destination blocks; pass the prefill's "
            f"block ids and the decode worker's reservation for the same prompt"
        )
    for name, blocks, layout in (("source", src_blocks, src), ("destination", dst_blocks, dst)):
        bad = [b for b in blocks if not 0 <= b < layout.num_blocks]
        if bad:
            raise TransferError(f"request {request_id}: {name} blocks {bad[:5]} outside a pool of "
                                f"{layout.num_blocks} blocks")
    return Plan(request_id, tuple(paired_runs(src_blocks, dst_blocks)), src.num_layers, src.block_bytes)


def descriptors(base_addr: int, layout: KVLayout, starts: np.ndarray, lengths: np.ndarray,
                layers: np.ndarray, device_id: int) -> np.ndarray:
    """[len(layers) * len(starts), 3] uint64 rows (addr, bytes, device) for blocks
    starts[i]..starts[i]+lengths[i]-1 of each layer, layer-major."""
    layer_off = layers.astype(np.uint64)[:, None] * np.uint64(layout.layer_bytes)
    run_off = starts.astype(np.uint64)[None, :] * np.uint64(layout.block_bytes)
    rows = np.empty((len(layers) * len(starts), 3), dtype=np.uint64)
    rows[:, 0] = (np.uint64(base_addr) + layer_off + run_off).ravel()
    rows[:, 1] = np.tile(lengths.astype(np.uint64) * np.uint64(layout.block_bytes), len(layers))
    rows[:, 2] = device_id
    return rows
