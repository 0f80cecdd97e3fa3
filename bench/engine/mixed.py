"""Two engine measurements beside their floors (`pdserve-bench engine` and `pdserve-bench offline`):

mixed step   `decodes` requests decoding at `context` plus `chunk` prompt tokens of a request whose
             first `prefix` tokens are already in the cache: the step's wall time (host clock,
             synchronised: Engine.step's forward and sampling) against its GPU-busy time (the union
             of the step's kernel intervals, torch.profiler), over `repeats` steps at the same
             positions. wall / busy is the host's share: 1.0 means the GPU never waited.
offline      `n` prompts of `lengths` tokens (seeded), `out` tokens each, greedy, EOS ignored, all
             added at once and run to the end (Engine.generate): wall time beside its floor,
             measured in the same run: the prompt tokens at the unchunked prefill speed (whole
             prompts of the workload's mean length, `prefill_speed`) plus every decode step an ideal
             schedule runs (batches of max_num_seqs) at its roofline (weights + the batch's KV bytes
             at the measured copy speed).
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.bench import ab
from pdserve.bench.engine.decode import adopt_batch, sync, timed_runs
from pdserve.workers.engine.prompt_blocks import Claim
from pdserve.workers.engine.request import Request, SamplingParams


def gpu_busy_ms(prof) -> float | None:
    """The union of the device intervals of a profile's kernels and copies, in ms (None: no device events)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    return (busy + hi - lo) / 1e3


def mixed_step_point(engine, device: torch.device, decodes: int, context: int, prefix: int, chunk: int,
                     repeats: int, seed: int) -> dict:
    reqs = adopt_batch(engine, [context] * decodes, "mixed-bg", repeats + 8, seed)
    engine.scheduler.grow_running()  # a block for each decode's next position
    gen = torch.Generator().manual_seed(seed + 7)
    long = Request("mixed-long", torch.randint(0, engine.vocab_size, (prefix + chunk + 1,), generator=gen).tolist(),
                   SamplingParams(max_tokens=2, ignore_eos=True))
    engine.admit(long)
    long.start_prefill()
    engine.prompts.take(long, Claim(need=-(-(prefix + chunk + 1) // engine.layout.block_size)))
    work = [(r, 1) for r in reqs] + [(long, chunk)]

    def step() -> None:
        logits = engine.runner.run(work)
        engine.sampler.sample(logits, reqs)  # the decodes' tokens, read back on the host
        for r, n in work:  # the same positions again next time (their K/V are rewritten alike)
            r.num_computed -= n

    try:
        long.num_computed = prefix
        walls = timed_runs(step, device, 3, repeats)
        busy = None
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    step()
                sync(device)
            busy = gpu_busy_ms(prof)
            busy = busy / repeats if busy is not None else None
    finally:
        for r in reqs + [long]:
            engine.abort(r.request_id)
    wall = ab.spread(walls)
    return {"decodes": decodes, "context": context, "prefix": prefix, "chunk": chunk, "repeats": repeats,
            "wall_ms": wall, "gpu_busy_ms": busy,
            "wall_over_busy": wall["median"] / busy if busy else None,
            "path": "piecewise graphs" if engine.runner.mixed is not None and engine.runner.mixed.fits(
                decodes + chunk, decodes) else "eager"}


def offline_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def offline_params(n: int, out: int, temperature: float, seed: int) -> list[SamplingParams]:
    """Greedy (temperature 0) or sampled at `temperature`, each prompt with a seed of its own (seed + i)."""
    if not temperature:
        return [SamplingParams(max_tokens=out, ignore_eos=True)] * n
    return [SamplingParams(max_tokens=out, ignore_eos=True, temperature=temperature, seed=seed + i) for i in range(n)]


def offline_run(engine, prompts: list[list[int]], out: int, device: torch.device, temperature: float = 0.0,
                seed: int = 0) -> dict:
    params = offline_params(len(prompts), out, temperature, seed)
    sync(device)
    t = time.perf_counter()
    reqs = engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - t
    made = sum(len(r.output_ids) for r in reqs)
    if made != out * len(prompts):
        raise RuntimeError(f"offline: {made} tokens generated, {out * len(prompts)} expected")
    return {"wall_s": wall, "gen_tokens": made, "out_tok_s": made / wall}


def prefill_speed(engine, length: int, repeats: int, device: torch.device, seed: int) -> dict:
    """Seconds per token of whole unchunked prompts of `length` tokens (Engine.prefill_only)."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for i in range(repeats + 1):
        req = Request(f"speed-{i}", torch.randint(0, engine.vocab_size, (length,), generator=gen).tolist(),
                      SamplingParams(max_tokens=1, ignore_eos=True))
        sync(device)
        t = time.perf_counter()
        engine.prefill_only(req)
        sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t)
        engine.release(req.request_id)
    return {"length": length, "s": ab.spread(times), "s_per_token": statistics.median(times) / length}


def decode_floor_s(lengths: list[int], out: int, max_num_seqs: int, weight_bytes: int, kv_per_token: int,
                   copy_bytes_per_s: float) -> float:
    """The decode steps of an ideal schedule (requests in batches of max_num_seqs, each batch decoding
    together to the end) at their roofline: per step the weights plus the batch's KV, at the copy speed."""
    total = 0.0
    for i in range(0, len(lengths), max_num_seqs):
        batch = lengths[i:i + max_num_seqs]
        for s in range(1, out):  # token 1 comes with the prefill
            total += (weight_bytes + kv_per_token * sum(n + s for n in batch)) / copy_bytes_per_s
    return total
