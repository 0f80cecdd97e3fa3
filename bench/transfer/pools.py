"""What `pdserve-bench transfer` varies besides the transport: methods, pool states, copy ceilings.

    methods      a transport name, optionally with a variant (`--transports ipc,zmq,zmq-curve,nixl-fragmented`):
                 <t>             the transport on plain sockets, pools as the run left them (contiguous runs)
                 zmq-curve       zmq with a deployment's keys: every KV byte through CURVE (worker_keys())
                 <t>-fragmented  both pools scattered first, as a prior mixed workload leaves them (scatter())
    scatter(engine, need, seed)  take every free block as fillers of 1-4 blocks, then give back fillers in a
                 seeded order until `need` blocks are free: what a request gets then is many short runs,
                 paired across two independently scattered pools into shorter ones still
    paged_copy(pool, blocks, device)   the longest request's blocks copied inside one pool, all layers: one
                 strided copy_ of the pool's dtype and of 8-byte words (ipc's small bulk pattern), one copy_
                 per layer (its large bulk pattern), one 2D memcpy (its large bulk pattern at c3da930, GPU),
                 and the same blocks scattered (every other block) moved by index: a gather and a scatter
                 (ipc's fragmented path on the CPU, and on the GPU before block_copy.py; in words and in the
                 pool's dtype) and, on a GPU with Triton, block_copy.py's kernel (ipc's fragmented path there)
"""

from __future__ import annotations

import ctypes
import random
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine.decode import sync
from pdserve.settings.keys import new_deployment, write_worker_keys
from pdserve.protocol.enums import TRANSPORTS
from pdserve.workers.transfer import block_copy
from pdserve.workers.transfer.ipc import words

VARIANTS = ("", "curve", "fragmented")


def parse_method(method: str) -> tuple[str, str]:
    """'zmq-curve' -> ('zmq', 'curve'); raises ValueError for an unknown transport or variant."""
    transport, _, variant = method.partition("-")
    if transport not in TRANSPORTS or variant not in VARIANTS or (variant == "curve" and transport != "zmq"):
        raise ValueError(f"unknown method {method!r}: a transport ({', '.join(TRANSPORTS)}), zmq-curve, or "
                         "<transport>-fragmented")
    return transport, variant


def worker_keys() -> str:
    """A fresh deployment's worker key folder, for both processes of the bench (zmq-curve)."""
    _, keys = new_deployment()
    return str(write_worker_keys(Path(tempfile.mkdtemp(prefix="pdserve-bench-keys-")) / "worker", keys))


def scatter(engine, need: int, seed: int) -> list[str]:
    """Fragment the engine's free blocks (see the module docstring); returns the fillers' request ids."""
    rng = random.Random(seed)
    fillers, block = [], engine.layout.block_size
    while engine.blocks.num_free > 0:
        n = min(rng.randint(1, 4), engine.blocks.num_free)
        rid = f"filler-{seed}-{len(fillers)}"
        if engine.reserve(rid, n * block) is None:
            break
        fillers.append(rid)
    rng.shuffle(fillers)
    while fillers and engine.blocks.num_free < need:
        engine.release(fillers.pop())
    return fillers


def release(engine, fillers: list[str]) -> None:
    for rid in fillers:
        engine.release(rid)


def _timed(fn, device: torch.device) -> float:
    """Median of 5 runs after one warm-up, s."""
    runs = []
    for i in range(6):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            runs.append(time.perf_counter() - start)
    runs.sort()
    return runs[len(runs) // 2]


def paged_copy(pool: torch.Tensor, nb: int, device: torch.device) -> dict:
    """Copy patterns inside one pool, GB/s (module docstring)."""
    src, dst = pool[:, :nb], pool[:, nb:2 * nb]
    pool_words = words(pool)
    wsrc, wdst = pool_words[:, :nb], pool_words[:, nb:2 * nb]
    nbytes = src.numel() * src.element_size()

    def per_layer():
        for layer in range(pool.shape[0]):
            wdst[layer].copy_(wsrc[layer])

    out = {"blocks": nb, "bytes": nbytes}
    for name, fn in (("strided", lambda: dst.copy_(src)), ("strided_words", lambda: wdst.copy_(wsrc)),
                     ("per_layer", per_layer)):
        out[f"{name}_gbps"] = nbytes / _timed(fn, device) / 1e9
    memcpy2d = cuda_memcpy2d() if pool.is_cuda else None
    out["memcpy2d_gbps"] = None  # one 2D memcpy for all layers (ipc's large bulk copy at c3da930; GPU only)
    if memcpy2d is not None:
        pitch, width = pool.stride(0) * pool.element_size(), nbytes // pool.shape[0]
        stream = torch.cuda.current_stream(pool.device).cuda_stream

        def copy_2d():
            if memcpy2d(dst.data_ptr(), pitch, src.data_ptr(), pitch, width, pool.shape[0],
                        CUDA_MEMCPY_DEVICE_TO_DEVICE, stream) != 0:
                raise RuntimeError("cudaMemcpy2DAsync failed")

        try:
            out["memcpy2d_gbps"] = nbytes / _timed(copy_2d, device) / 1e9
        except RuntimeError:
            pass
    half = nb // 2  # every other block of the first nb, into every other block of the next nb
    src_idx = torch.arange(0, 2 * half, 2, device=pool.device)
    dst_idx = src_idx + nb
    out["scattered_blocks"] = half
    elements = pool.view(*pool.shape[:2], -1)
    for name, flat in (("scattered_gather", pool_words), ("scattered_gather_elements", elements)):
        scattered = pool.shape[0] * half * flat.shape[-1] * flat.element_size()

        def gather_scatter(flat=flat):  # ipc's index ops (workers/transfer/ipc.py, IpcTransfer._copies)
            flat.index_copy_(1, dst_idx, flat.index_select(1, src_idx))

        out[f"{name}_gbps"] = scattered / _timed(gather_scatter, device) / 1e9
    out["scattered_kernel_gbps"] = None  # each block read and written once, one launch (GPU with Triton)
    if block_copy.kernel_ready(pool_words, pool_words):
        scattered = pool.shape[0] * half * pool_words.shape[-1] * pool_words.element_size()
        out["scattered_kernel_gbps"] = scattered / _timed(
            lambda: block_copy.launch(pool_words, pool_words, src_idx, dst_idx), device) / 1e9
    return out


CUDA_MEMCPY_DEVICE_TO_DEVICE = 3
_CUDART: list = []  # [cudaMemcpy2DAsync or None], looked up once


def cuda_memcpy2d():
    """The CUDA runtime's cudaMemcpy2DAsync (the libcudart torch loaded), or None where it cannot be found."""
    if not _CUDART:
        fn = None
        for name in (f"libcudart.so.{(torch.version.cuda or '0').split('.')[0]}", "libcudart.so"):
            try:
                fn = ctypes.CDLL(name).cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            break
        _CUDART.append(fn)
    return _CUDART[0]
