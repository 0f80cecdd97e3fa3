"""One config object for an engine (the worker CLI fills it from its flags)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.kv_cache import DTYPES


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # a name in models.MODEL_NAMES or a local checkpoint directory
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks for requests (the pool holds one more, for padding); or kv_memory_gb
    kv_memory_gb: float | None = None  # KV pool size in GiB; default 1 GiB on CPU, 30% of free memory on CUDA
    max_num_seqs: int = 64  # running requests at once
    max_batched_tokens: int = 8192  # unchunked: prompt tokens per prefill step (a longer prompt runs alone)
    chunked_prefill: bool = True  # a step carries every running decode plus up to chunk_tokens prompt tokens
    chunk_tokens: int = 512  # prompt tokens per step with chunked_prefill
    prefix_cache: bool = True  # reuse the KV of full blocks a previous prompt began with (prefix_cache.py)
    host_cache_gb: float = 0.0  # host memory for blocks evicted from the GPU (kv_tiers.py; pinned on CUDA); 0: none
    disk_cache_dir: str | None = None  # with host_cache_gb: a directory for blocks evicted from host memory
    disk_cache_gb: float = 16.0
    kv_shared: bool = False  # CPU: put the pool in /dev/shm so another process can map it (ipc transport)
    max_model_len: int | None = None  # default: the model's own limit
    # "auto": CUDA decodes through the Triton kernel, prefix chunks gathered + flash SDPA; "triton":
    # prefix chunks through the Triton kernel too; "reference": gather + SDPA for everything (CPU always)
    attention: str = "auto"
    compile: bool = True  # CUDA: torch.compile each decoder layer around attention (fused norms, rotary, MLP)
    fuse_qkv: bool = True  # CUDA: one Q/K/V projection instead of three (fusion.py)
    cuda_graphs: bool = True  # CUDA: replay decode steps as CUDA graphs (False: eager, for debugging)

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_memory_gb is not None and self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb}")
        if self.max_num_seqs <= 0 or self.max_batched_tokens <= 0 or self.chunk_tokens <= 0:
            raise ValueError("max_num_seqs, max_batched_tokens and chunk_tokens must be positive")
        if self.host_cache_gb < 0 or self.disk_cache_gb <= 0:
            raise ValueError("host_cache_gb must be >= 0 and disk_cache_gb positive")
        if self.disk_cache_dir and not self.host_cache_gb:
            raise ValueError("a disk cache needs a host cache above it: give host_cache_gb too")
        if self.attention not in ("auto", "triton", "reference"):
            raise ValueError(f"attention must be auto, triton or reference, got {self.attention!r}")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} asked for, but this machine has no CUDA GPU; use --device cpu")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32

    def kv_budget_bytes(self) -> int:
        if self.kv_memory_gb is not None:
            return int(self.kv_memory_gb * 2**30)
        dev = torch.device(self.device)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return int(0.3 * free)
        return 2**30
