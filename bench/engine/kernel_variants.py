"""Which Triton variants of the paged-attention kernels a CUDA worker compiles, derived on the CPU.

Triton compiles a kernel once per key: its constexpr values, each non-constexpr argument's type and
specialisation (an int equal to 1 becomes a constant, one divisible by 16 is marked so, a pointer
16-byte aligned is marked so; `do_not_specialize` turns that off for the arguments it names) and the
launch options (num_warps, num_stages). This module records the launches paged_kernel makes for a
model's shape, without a GPU, and keys them with the CUDA backend as `JITFunction.run` does:

    launch_keys(launch)                  {kernel: {key: [labels]}} of the launches `launch()` makes
    decode_graph_launches(shape, ...)    the decode graphs' launches, one per (batch, blocks) bucket
                                         (graphs.decode_buckets, the tensors as DecodeGraphs passes them)
    mixed_step_launches(shape, ...)      a mixed step's decodes (attention.py, runner._set_step's table)
                                         over a grid of decode counts, table widths and contexts
    compile_sm90(keys, workers)          compile each keyed variant for sm_90 (no GPU needed), serially
                                         or in a pool of `workers` threads; seconds

`pdserve-bench variants` prints the counts for qwen2.5-7b on an H100 (132 SMs, max_model_len 32768,
max_num_seqs 64) and, with --compile N, times their compiles for sm_90 in N threads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.workers.engine import paged_kernel as pk
from pdserve.workers.engine.graphs import decode_buckets

KERNELS = ("_paged_attention", "_combine")


@dataclass(frozen=True)
class Shape:
    heads: int = 28  # qwen2.5-7b
    kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    sms: int = 132  # H100 SXM


def jit_of(kernel):
    """The JITFunction behind `kernel`, built afresh (the test suite runs kernels through Triton's
    interpreter, whose wrapper keeps the function and the decorator's arguments)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        kw = {"do_not_specialize": kernel.do_not_specialize,
              "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment}
    else:
        kw = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **kw)


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` is kept, not run."""

    def __init__(self, name: str, into: list):
        self.name, self.into = name, into

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.into.append((self.name, args, kwargs))


@contextlib.contextmanager
def recording(sms: int):
    """paged_kernel's kernels replaced by recorders, its SM count set; yields the list of launches."""
    launches: list = []
    saved = {name: getattr(pk, name) for name in KERNELS}
    saved_sms = pk._sms
    try:
        for name in KERNELS:
            setattr(pk, name, _Recorder(name, launches))
        pk._sms = lambda device: sms
        yield launches
    finally:
        for name, k in saved.items():
            setattr(pk, name, k)
        pk._sms = saved_sms


def key_of(jit, args: tuple, kwargs: dict) -> str:
    """Triton's cache key of one launch on an NVIDIA GPU (JITFunction.run's compute_cache_key)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(jit.signature, jit.params, CUDABackend)
    _, specialization, options = binder(*args, **kwargs)
    return str(specialization) + str(options)


def launch_keys(launch) -> dict[str, dict[str, list]]:
    """{kernel: {key: [labels of the launches with that key]}}; launch(label_fn) makes launches, calling
    label_fn(label) before each group of them."""
    jits = {name: jit_of(getattr(pk, name)) for name in KERNELS}
    out: dict[str, dict[str, list]] = {name: {} for name in KERNELS}
    with recording(launch.sms) as launches:
        label = [None]
        seen = 0

        def mark(new_label) -> None:
            nonlocal seen
            for name, args, kwargs in launches[seen:]:
                out[name].setdefault(key_of(jits[name], args, kwargs), []).append(label[0])
            seen = len(launches)
            label[0] = new_label

        launch(mark)
        mark(None)
    return out


class decode_graph_launches:
    """The decode graphs' paged-attention launches: one per (batch, blocks) bucket, with the tensors
    DecodeGraphs passes (views of its packed buffer; q and out as a compiled layer hands them over)."""

    def __init__(self, shape: Shape = Shape(), max_model_len: int = 32768, max_num_seqs: int = 64,
                 pool_blocks: int = 1 << 20):
        self.shape, self.sms = shape, shape.sms
        self.batches, self.blocks = decode_buckets(max_num_seqs, -(-max_model_len // shape.block_size), pool_blocks)

    def __call__(self, mark) -> None:
        s = self.shape
        nb, nm = self.batches[-1], self.blocks[-1]
        packed = torch.zeros(5 * nb + nb * nm, dtype=torch.long)
        lens, table = packed[4 * nb:5 * nb], packed[5 * nb:].view(nb, nm)
        pool = torch.zeros(4, 2, s.block_size, s.kv_heads, s.head_dim, dtype=s.dtype)
        for blocks in self.blocks[::-1]:
            for batch in self.batches[::-1]:
                mark((batch, blocks))
                # [1, T, H, D] transposed to [1, H, T, D] (transformers' attention), then [T, H, D]
                q = torch.zeros(1, batch, s.heads, s.head_dim, dtype=s.dtype).transpose(1, 2)[0].transpose(0, 1)
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
                pk.paged_decode(q, pool, table[:batch, :blocks], lens[:batch], 1.0, blocks * s.block_size, out=out)


class mixed_step_launches:
    """A mixed step's decodes (MixedGraphs.run: q and out rows of the Cut's buffers; the table as
    wide as the step's longest block list) over decode counts x contexts; labels (decodes, context)."""

    def __init__(self, shape: Shape = Shape(), decodes=range(1, 65), contexts=(1, 17, 100, 1000, 2049, 8000, 32768)):
        self.shape, self.sms, self.decodes, self.contexts = shape, shape.sms, decodes, contexts

    def __call__(self, mark) -> None:
        s = self.shape
        pool = torch.zeros(4, 2, s.block_size, s.kv_heads, s.head_dim, dtype=s.dtype)
        q_all = torch.zeros(1024, s.heads, s.head_dim, dtype=s.dtype)
        for n in self.decodes:
            for ctx in self.contexts:
                mark((n, ctx))
                table = torch.zeros(n, -(-ctx // s.block_size), dtype=torch.long)
                lens = torch.full((n,), ctx, dtype=torch.long)
                out = torch.empty_like(q_all)
                pk.paged_decode(q_all[:n], pool, table, lens, 1.0, ctx, out=out[:n])


def _source(jit, args: tuple, kwargs: dict):
    """What JITFunction.run hands triton.compile for this launch, for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(jit, signature, constexprs, attrs), target, options.__dict__


def distinct_launches(launch) -> list[tuple[str, tuple, dict]]:
    """One launch per distinct key (the first made), over every kernel."""
    jits = {name: jit_of(getattr(pk, name)) for name in KERNELS}
    seen, out = set(), []
    with recording(launch.sms) as launches:
        launch(lambda label: None)
    for name, args, kwargs in launches:
        key = (name, key_of(jits[name], args, kwargs))
        if key not in seen:
            seen.add(key)
            out.append((name, args, kwargs))
    return out


def compile_sm90(launches: list[tuple[str, tuple, dict]], workers: int = 1) -> float:
    """Compile each launch's variant for sm_90 into an empty Triton cache (a cold start's compiles);
    seconds of wall time, `workers` compiles at once in threads (Triton's passes and ptxas run outside
    the GIL: 2 threads on 2 cores took half the time of one)."""
    import triton

    jits = {name: jit_of(getattr(pk, name)) for name in KERNELS}
    sources = [_source(jits[name], args, kwargs) for name, args, kwargs in launches]
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            t = time.monotonic()
            with ThreadPoolExecutor(max(1, workers)) as pool:
                list(pool.map(lambda s: triton.compile(s[0], target=s[1], options=s[2]), sources))
            return time.monotonic() - t
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


def summary() -> dict:
    decode = launch_keys(decode_graph_launches())
    mixed = launch_keys(mixed_step_launches())
    both = {name: set(decode[name]) | set(mixed[name]) for name in KERNELS}
    return {"decode_graphs": {name: len(keys) for name, keys in decode.items()},
            "mixed_steps": {name: len(keys) for name, keys in mixed.items()},
            "together": {name: len(keys) for name, keys in both.items()},
            "decode_detail": decode}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", type=int, default=0, metavar="N",
                        help="also compile the decode graphs' variants for sm_90, with N threads (0: do not)")
    parser.add_argument("--detail", action="store_true", help="print each variant's buckets")


def run(args: argparse.Namespace) -> int:
    s = summary()
    for part in ("decode_graphs", "mixed_steps", "together"):
        print(f"{part}: " + ", ".join(f"{k} {v}" for k, v in s[part].items()))
    if args.detail:
        for name, keys in s["decode_detail"].items():
            for key, labels in keys.items():
                print(f"  {name} {len(labels)} buckets: {labels[:6]}{' ...' if len(labels) > 6 else ''}")
    if args.compile:
        launches = distinct_launches(decode_graph_launches())
        print(f"sm_90 compile of {len(launches)} variants with {args.compile} thread(s): "
              f"{compile_sm90(launches, args.compile):.2f} s (an empty Triton cache)")
    return 0
