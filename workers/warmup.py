"""A worker's start: its engine built, its graphs captured, one real request through it before it
registers with the router; `start_engine` does all three and records where the time went.

    start_engine(engine_config, role, warmup, disk_key) -> Engine   engine.start: the parts (start_times.py)
    warm_up(engine) -> seconds                                       the warm-up request alone

Why: the first forward of a fresh process pays for what torch and the tokenizer do lazily (the CPU
thread pool, first touch of the activation and KV memory, kernel and allocator set-up per shape,
the detokenizer's first decode). Measured on the CPU with smollm2-135m: the first request's
prefill took several times a later one's. Paid here, before "ready", no user request waits for it.

Prompt and tokens together stay inside one KV block: no full block is named, so the prefix cache
holds nothing of it afterwards; its block goes back to the pool when it finishes.

Where the piecewise graphs stop short of the longest step (CUDA: past mixed_graph_tokens, 1024, a step runs
the compiled segments directly over its own rows), a second warm-up request of one prompt just past that
limit runs such a step (long_warmup_tokens): whatever that path does the first time (a shape the compiled
code has not seen, an allocation of its size) is done here, not in a served step. Its blocks are not named
(the prefix cache is off for it), so it too leaves nothing.
"""

from __future__ import annotations

import gc
import time

WARMUP_TOKENS = 4  # decode steps after the prefill


def start_engine(config, role: str, warmup: bool = True, disk_key: bytes | None = None):
    """The engine of a worker of this role, ready for traffic: built (model loaded, KV pool allocated),
    graphs captured (CUDA: the piecewise graphs of steps with prompt tokens on every role, which a
    prefill worker's forwards replay too; the decode graphs not on a prefill worker, which never
    decodes), the warm-up request run (unless `warmup` is off); `engine.start` holds each part's
    seconds and the total. A prefill worker used to take its piecewise graphs lazily, each bucket at
    the first prompt of its size: those prompts' TTFT paid the capture under traffic."""
    from pdserve.workers.engine.engine import Engine

    engine = Engine(config, disk_key=disk_key)
    engine.warmup(decode=role != "prefill")
    if warmup:
        engine.start.warmup_s = warm_up(engine)
    engine.start.finish()
    return engine


def warm_up(engine) -> float:
    """Prefill a short prompt and decode a few tokens on `engine`; returns the seconds spent."""
    from pdserve.workers.engine.request import SamplingParams

    block = engine.layout.block_size
    steps = max(1, min(WARMUP_TOKENS, block - 2))
    n = max(1, min(block - steps - 1, engine.max_model_len - steps - 1))  # prompt + tokens fill no block
    start = time.monotonic()
    [req] = engine.generate([prompt_of(n, engine.vocab_size)], SamplingParams(max_tokens=steps, ignore_eos=True))
    if req.error is not None:
        raise RuntimeError(f"the warm-up request failed on this worker: {req.error}")
    n = long_warmup_tokens(engine)
    if n:
        named, engine.blocks.enabled = engine.blocks.enabled, False  # nothing of it stays in the prefix cache
        try:
            [req] = engine.generate([prompt_of(n, engine.vocab_size)], SamplingParams(max_tokens=1, ignore_eos=True))
        finally:
            engine.blocks.enabled = named
        if req.error is not None:
            raise RuntimeError(f"the warm-up request of {n} tokens failed on this worker: {req.error}")
    return time.monotonic() - start


def prompt_of(n: int, vocab: int) -> list[int]:
    """A warm-up prompt of n tokens: any in-vocabulary ids."""
    return [(17 + 31 * i) % vocab for i in range(n)]


def long_warmup_tokens(engine) -> int:
    """The prompt of the second warm-up request: just past the piecewise graphs' limit (odd, and a block more),
    where steps longer than the graphs run their segments directly; 0 where there is no such step (no graphs:
    the CPU, where every step runs them directly, as the first warm-up request did) or no room for it."""
    mixed = engine.runner.mixed
    if mixed is None or not mixed.graph_buckets or mixed.max_tokens <= mixed.graph_limit:
        return 0
    n = min(mixed.graph_limit + engine.layout.block_size + 1, mixed.max_tokens)
    fits = n < engine.max_model_len and -(-(n + 1) // engine.layout.block_size) <= engine.blocks.num_free
    return n if fits else 0


def freeze_start() -> tuple[int, float]:
    """Collect the start's garbage, then move every object alive (the model's modules, compiled code, graphs,
    the tokenizer: hundreds of thousands of them) into the collector's permanent generation, where no later
    collection walks them -> (objects frozen, ms the full collection took). Why: a full collection walks every
    tracked object; over SmolLM2's worker on this project's 2-core CPU (382,086 objects) it took 171 ms, a
    pause of the worker's loop each time one ran while serving; after the freeze, 0.0 ms. Later objects (the
    requests) are collected as before. `unfreeze_start` undoes it (a worker run inside another process)."""
    began = time.perf_counter()
    gc.collect()
    took_ms = (time.perf_counter() - began) * 1e3
    gc.freeze()
    return gc.get_freeze_count(), took_ms


def unfreeze_start() -> None:
    """The frozen objects back under the collector (a worker that stops inside a process that goes on)."""
    gc.unfreeze()
