"""What the engine's config (settings/worker.py, EngineConfig: torch-free) means in torch terms."""

from __future__ import annotations

import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.kv_cache import DTYPES


def check_device(config: EngineConfig) -> None:
    """The one check the config cannot make without torch: is the CUDA device it names there?"""
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device} asked for, but this machine has no CUDA GPU; use --device cpu")


def torch_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype is not None:
        return DTYPES[config.dtype]
    return torch.bfloat16 if torch.device(config.device).type == "cuda" else torch.float32


def kv_budget_bytes(config: EngineConfig) -> int:
    """The KV pool's size: kv_memory_gb, else 30% of the GPU's free memory, else 1 GiB on CPU."""
    if config.kv_memory_gb is not None:
        return int(config.kv_memory_gb * 2**30)
    dev = torch.device(config.device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(0.3 * free)
    return 2**30
