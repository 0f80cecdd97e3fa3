"""The decode side of `pdserve-bench engine`: batches put straight into decode, their step
times, the memory roofline beside them, and the chunked-prefill scenario.

    fill_random(pool)                       random K/V over the whole pool, once per engine (a decode
                                            step's time does not depend on the values it reads)
    adopt_batch(engine, contexts, ...)      reserve(id, n) + adopt(req, first_token) per request: each
                                            joins the running batch at once, no prefill, so a batch of
                                            64 x 16k contexts is built in milliseconds
    BatchDecode(engine, reqs, device)       .step(): host wall time of engine.step() (CUDA-synchronised
                                            around it), each step one token for every request of the batch
                                            (returned one step late when steps overlap); .flush()
    decode_point(engine, contexts, ...)     the intervals between successive engine.step() returns
    weight_bytes(model)                     bytes a decode step reads of the weights: all parameters but
                                            the input embedding table (a step gathers only B rows of it;
                                            a tied table counts once, as the output layer reads all of it)
    copy_roofline(sizes, device, ...)       for N bytes: one copy_ of N/2 bytes into another N/2 bytes,
                                            i.e. N bytes of HBM traffic, the time to read N bytes once if
                                            reads and writes stream at one rate; in chunks when the two
                                            buffers do not fit (then `chunks` > 1)
    chunked_scenario(engine, ...)           decodes running, a long prompt arrives via add_request: every
                                            step's wall time while it prefills and the decodes' token gaps
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from pdserve.bench import ab
from pdserve.workers.engine.overlap import PENDING
from pdserve.workers.engine.request import Request, SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fill_random(pool: torch.Tensor) -> None:
    if pool.dtype.is_floating_point:
        pool.uniform_(-1.0, 1.0)
    else:
        pool.view(torch.uint8).random_(0, 64)
    sync(pool.device)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def adopt_batch(engine, contexts: list[int], tag: str, max_tokens: int, seed: int) -> list[Request]:
    """Requests of the given context lengths, each in decode with random prompt ids and first token."""
    gen = torch.Generator().manual_seed(seed)
    reqs: list[Request] = []
    try:
        for i, n in enumerate(contexts):
            rid = f"{tag}-{i}"
            if engine.reserve(rid, n) is None:
                raise RuntimeError(f"{tag}: no room in the KV pool for request {i} of {len(contexts)} ({n} tokens); "
                                   "the pool is sized from the points asked: pass fewer or a larger --kv-memory-gb")
            ids = torch.randint(0, engine.vocab_size, (n + 1,), generator=gen).tolist()
            req = Request(rid, ids[:n], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            engine.adopt(req, ids[n])
            reqs.append(req)
    except BaseException:
        for r in reqs:
            engine.abort(r.request_id)
        raise
    return reqs


class BatchDecode:
    """Steps of one adopted batch, each timed with the device synchronised around it and checked to
    decode every request of the batch once. With overlapped steps (workers/engine/overlap.py) a step
    returns the tokens of the step before it (none the first time), so outputs are counted as they
    come and `flush` reads the last step's tokens back; the time of a call is one step's either way
    (its launch, its device time to the synchronise, and the previous step's read-back)."""

    def __init__(self, engine, reqs: list[Request], device: torch.device):
        self.engine, self.reqs, self.device = engine, reqs, device
        self.tokens = {r.request_id: 0 for r in reqs}  # tokens returned so far, per request

    def in_flight(self) -> set[str]:
        return {r.request_id for r in self.reqs if r.output_ids and r.output_ids[-1] == PENDING}

    def step(self) -> float:
        """One step; its ms."""
        late, before = self.in_flight(), [len(r.output_ids) for r in self.reqs]
        sync(self.device)
        start = time.perf_counter()
        outs = self.engine.step()
        sync(self.device)
        ms = (time.perf_counter() - start) * 1e3
        # overlapped: the tokens that were in flight come back, this step's stay on the device;
        # synchronous: every request's token (those in flight read back first)
        want = late if self.in_flight() else set(self.tokens)
        got = [o.request_id for o in outs]
        grew = {r.request_id for r, n in zip(self.reqs, before) if len(r.output_ids) == n + 1}
        if set(got) != want or len(got) != len(want) or grew != set(self.tokens):
            raise RuntimeError(f"a decode step of a batch of {len(self.reqs)} returned outputs for {len(set(got))} "
                               f"requests ({len(want)} expected) and advanced {len(grew)}")
        for rid in got:
            self.tokens[rid] += 1
        return ms

    def flush(self) -> dict[str, int]:
        """Read the tokens still in flight back (one more step, untimed, whose own tokens are left in
        flight); the tokens returned per request."""
        late = self.in_flight()
        if late:
            for o in self.engine.step():
                if o.request_id in late:
                    self.tokens[o.request_id] += 1
        return self.tokens


def decode_point(engine, contexts: list[int], device: torch.device, warmup: int, repeats: int, seed: int,
                 tag: str) -> dict:
    """Decode steps of one batch, each timed as the interval between successive Engine.step() returns on
    the host clock (a step returns once its tokens are on the host: the pace a client sees; with
    overlapped steps a call launches the next step before it reads the last one's tokens back, so the
    first call returns nothing and is not timed)."""
    reqs = adopt_batch(engine, contexts, tag, max_tokens=warmup + repeats + 4, seed=seed)
    want = {r.request_id for r in reqs}
    times: list[float] = []
    try:
        sync(device)
        prev = time.perf_counter()
        while len(times) < warmup + repeats:
            outs = engine.step()
            now = time.perf_counter()
            got = {o.request_id for o in outs}
            if got != want and (got or times):
                raise RuntimeError(f"a decode step of a batch of {len(reqs)} returned outputs for {len(got)} requests")
            if got:
                times.append((now - prev) * 1e3)
            prev = now
    finally:
        for r in reqs:
            engine.abort(r.request_id)
        settle(engine)
    return ab.summary(times[warmup:])


def settle(engine) -> None:
    """Step until nothing is left, a step in flight included (its aborted requests' blocks come back
    when it is read back)."""
    while engine.has_work():
        engine.step()


def timed_runs(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """ms of each of `repeats` calls of fn after `warmup` untimed ones, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        runs.append((time.perf_counter() - start) * 1e3)
    return runs


def weight_bytes(model) -> dict:
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors listed once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    return {"total": total, "read_per_step": total if tied else total - emb.numel() * emb.element_size(),
            "input_embedding_excluded": not tied}


def copy_roofline(sizes: list[int], device: torch.device, warmup: int, repeats: int,
                  memory_cap: int | None = None) -> dict[int, dict]:
    """{N: summary of ms for N bytes of traffic, + gbps (N / median) and chunks}."""
    half = max(sizes) // 2
    if memory_cap is None and device.type == "cuda":
        memory_cap = int(torch.cuda.mem_get_info(device)[0] * 0.9)
    cap = max(1, min(half, (memory_cap or 2 * half) // 2))
    src = torch.zeros(cap, dtype=torch.uint8, device=device)
    dst = torch.zeros(cap, dtype=torch.uint8, device=device)
    out = {}
    try:
        for n in sorted(set(sizes)):
            h = n // 2
            chunks = [min(cap, h - i) for i in range(0, h, cap)]

            def copy():
                for c in chunks:
                    dst[:c].copy_(src[:c])

            s = ab.summary(timed_runs(copy, device, warmup, repeats))
            out[n] = {**s, "gbps": n / (s["median"] / 1e3) / 1e9, "chunks": len(chunks)}
    finally:
        del src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def mixed_contexts(batch: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(batch)]


def percentile(values: list[float], q: int) -> float:
    """q in 1..99; linear between the nearest values."""
    s = sorted(values)
    return s[0] if len(s) == 1 else statistics.quantiles(s, n=100, method="inclusive")[q - 1]


def chunked_steps_bound(prompt: int, chunk_tokens: int) -> int:
    """Steps the long prompt may take to prefill: its chunks, each possibly followed by a decode-only step."""
    return 2 * blocks_for(prompt, chunk_tokens) + 4


def chunked_scenario(engine, device: torch.device, decodes: int, context: int, prompt: int, steady_steps: int,
                     after_steps: int, seed: int, max_prefill_steps: int, tag: str, profile: str | None = None,
                     profile_from: int = 1) -> dict:
    """`decodes` requests decoding at `context`, then a `prompt`-token request arrives. Token times are
    the host clock at each step's return (tokens are on the host then). `profile`: a folder where
    torch.profiler's tables and trace of the prompt's steps go, from its prefill step `profile_from` on
    (0: its first; 1: the first chunk with a prefix when chunked) until its first token, six at most
    (those steps' times are then the profiler's, not the figures to quote)."""
    bound = max_prefill_steps
    reqs = adopt_batch(engine, [context] * decodes, f"{tag}-bg", steady_steps + bound + after_steps + 4, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    long = Request(f"{tag}-long", torch.randint(0, engine.vocab_size, (prompt,), generator=gen).tolist(),
                   SamplingParams(max_tokens=after_steps + 2, ignore_eos=True))
    token_times: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    steps: list[dict] = []

    last = [time.perf_counter()]

    def step(phase: str) -> None:  # timed from the previous step's return: the pace the host sees
        outs = engine.step()
        now = time.perf_counter()
        ms, last[0] = (now - last[0]) * 1e3, now
        for o in outs:
            if o.request_id in token_times:
                token_times[o.request_id].append(now)
        steps.append({"phase": phase, "ms": ms, "decodes": sum(o.request_id in token_times for o in outs)})

    def prompt_steps(most: int) -> None:  # the prompt's steps until its first token is on the host, `most` at most
        for _ in range(most):
            if long.output_ids and long.output_ids[0] >= 0:
                return
            step("prefill")

    try:
        last[0] = time.perf_counter()
        for _ in range(steady_steps):
            step("steady")
        arrival = time.perf_counter()
        engine.add_request(long)
        while not (long.output_ids and long.output_ids[0] >= 0):  # its first token on the host (not one in flight)
            if len(steps) >= steady_steps + bound:
                raise RuntimeError(f"{tag}: the {prompt}-token prompt took more than {bound} steps to prefill")
            if profile and sum(x["phase"] == "prefill" for x in steps) == profile_from:
                start = len(steps)
                profiled(engine, device, lambda: prompt_steps(6), profile, steps=lambda: len(steps) - start)
                profile = None
            else:
                step("prefill")
        first_token = time.perf_counter()
        for _ in range(after_steps):
            step("after")
    finally:
        for r in reqs:
            engine.abort(r.request_id)
        engine.abort(long.request_id)
        settle(engine)
    steady, during = [], []
    for times in token_times.values():
        for a, b in zip(times, times[1:]):
            gap = (b - a) * 1e3
            if b <= arrival:
                steady.append(gap)
            elif a < first_token:  # the gap overlaps the prefill
                during.append(gap)
    if not steady or not during:
        raise RuntimeError(f"{tag}: no token gaps measured (steady {len(steady)}, during prefill {len(during)})")
    steady_gap = statistics.median(steady)
    return {
        "steady_gap_ms": ab.spread(steady),
        "gap_during_prefill_ms": {"p50": percentile(during, 50), "p99": percentile(during, 99), "max": max(during),
                                  "n": len(during)},
        "max_gap_over_steady": max(during) / steady_gap,
        "prefill_steps": sum(s["phase"] == "prefill" for s in steps),
        "prefill_step_ms": [s["ms"] for s in steps if s["phase"] == "prefill"],
        "decodes_per_prefill_step": [s["decodes"] for s in steps if s["phase"] == "prefill"],
        "ttft_ms": (first_token - arrival) * 1e3,
        "steps": steps,
    }


def profiled(engine, device: torch.device, fn, folder: str, steps=None) -> None:
    """Run fn under torch.profiler (CPU and CUDA); write tables by self host time and by device time,
    a chrome trace, and on CUDA the device's kernels summed up (kernel_timeline.py: busy time, the gaps
    between kernels, kinds; per step where `steps`, the engine steps fn makes, is given: a number, or a
    function that says it once fn has run) into folder."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    table = prof.key_averages()
    (out / "by-self-cpu.txt").write_text(table.table(sort_by="self_cpu_time_total", row_limit=50))
    if device.type == "cuda":
        (out / "by-device.txt").write_text(table.table(sort_by="self_cuda_time_total", row_limit=50))
    prof.export_chrome_trace(str(out / "trace.json"))
    if device.type == "cuda":
        import json

        from pdserve.bench.engine.kernel_timeline import render, summarize

        summary = summarize(json.loads((out / "trace.json").read_text()), steps() if callable(steps) else steps)
        (out / "kernels.json").write_text(json.dumps(summary, indent=1))
        (out / "kernels.txt").write_text(render(summary) + "\n")
