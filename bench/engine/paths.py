"""`pdserve-bench paths`: do the engine's fast paths give what its plain path gives, on this device?

The fast path (decode graphs, piecewise graphs, compiled layers, fused Q/K/V, overlapped steps, chunked
prefill with its prefix rows) and the plain one (eager, uncompiled, unfused, synchronous, one prefill per
prompt) run the same requests; every arm is compared with the plain one, request by request:

  greedy   tokens compared up to the first that differs; over the agreeing tokens the largest difference
           of any logit (the same positions, the same context); where the tokens differ, the plain path's
           margin between its top two logits there. A difference is a near tie (rounding may pick either
           token) when that margin is within 2 x --atol; anything else is a mismatch
  sampled  each request seeded (temperature 0.8, top-p 0.95): the share of requests whose tokens equal the
           plain path's (reported, not judged: a seeded draw lands on another token when rounding moves a
           logit across the draw's boundary)

Arms: fast (the worker's defaults on the device), chunked (the defaults with --chunk-tokens, small, so
prompts run as prefix chunks beside decodes) and, on CUDA, one prompt longer than the piecewise graphs'
limit in every arm (a step run directly over its own rows). Requests come in two waves, the second after a
few steps of the first, so chunks share steps with decodes. float32 by default: bf16 rounding makes near
ties common with random weights.

    pdserve-bench paths --model tiny --device cuda:0                 # about a minute on a GPU
    pdserve-bench paths --model qwen2.5-7b --device cuda:0 --dtype bfloat16 --atol 0.5

Verdict: exit 0 when no arm has a mismatch and every logit difference is within --atol; JSON with
provenance to --out (default bench/results/paths-<machine>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import time
from pathlib import Path

import torch

from pdserve.bench import provenance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="tiny", help="model name or checkpoint dir (default tiny)")
    a("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    a("--dtype", default="float32", choices=("float32", "float16", "bfloat16"), help="default float32")
    a("--requests", type=int, default=12, help="requests per wave, two waves (default 12)")
    a("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    a("--chunk-tokens", type=int, default=64, help="the chunked arm's chunk budget (default 64)")
    a("--atol", type=float, default=0.02, help="largest logit difference allowed (default 0.02, float32)")
    a("--seed", type=int, default=0)
    a("--out", default=None, help="JSON path (default bench/results/paths-<machine>-<date>.json)")


def _prompts(args, vocab: int, long_len: int | None) -> list[list[int]]:
    rng = random.Random(args.seed)
    lens = [rng.randint(3, 300) for _ in range(2 * args.requests)]
    if long_len:
        lens[args.requests] = long_len  # in the second wave: beside decodes
    return [[rng.randrange(5, vocab - 5) for _ in range(n)] for n in lens]


def _serve(engine, prompts: list[list[int]], params: list, first_wave: int) -> list[dict]:
    """Every prompt through `engine`, the second wave added after three steps of the first -> per request
    its tokens and each token's logits (float32, CPU)."""
    from pdserve.workers.engine.request import Request

    reqs = [Request(f"paths-{i}", list(p), params[i], return_logits=True) for i, p in enumerate(prompts)]
    got = {r.request_id: {"tokens": [], "logits": []} for r in reqs}

    def step():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            g = got[out.request_id]
            g["tokens"].append(out.token_id)
            g["logits"].append(out.logits.float().cpu())

    for r in reqs[:first_wave]:
        engine.add_request(r)
    for _ in range(3):
        if engine.has_work():
            step()
    for r in reqs[first_wave:]:
        engine.add_request(r)
    while not all(r.finished for r in reqs):
        if not engine.has_work():
            raise RuntimeError("requests unfinished but the scheduler is idle")
        step()
    return [got[r.request_id] for r in reqs]


def compare(plain: dict, fast: dict, atol: float) -> dict:
    """One greedy request, plain against fast: agreeing tokens, largest logit difference, the first
    difference classed as a near tie or a mismatch."""
    n = min(len(plain["tokens"]), len(fast["tokens"]))
    agree, diff = 0, 0.0
    for i in range(n):
        diff = max(diff, (plain["logits"][i] - fast["logits"][i]).abs().max().item())
        if plain["tokens"][i] != fast["tokens"][i]:
            break
        agree += 1
    row = {"tokens": len(plain["tokens"]), "agree": agree, "max_logit_diff": diff}
    if agree < max(len(plain["tokens"]), len(fast["tokens"])):
        if agree < n:
            top2 = plain["logits"][agree].topk(2).values
            margin = (top2[0] - top2[1]).item()
            row["margin_at_difference"] = margin
            row["near_tie"] = margin <= 2 * atol
        else:  # one stopped where the other did not: an EOS or length difference with equal tokens
            row["near_tie"] = False
    return row


def _engine(args, **fields):
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine

    return Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, prefix_cache=False,
                               **fields))


def run(args: argparse.Namespace) -> int:
    from pdserve.workers.engine.request import SamplingParams

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.device = str(device)
    prov = provenance.collect([str(device)])
    t0 = time.monotonic()
    plain = _engine(args, cuda_graphs=False, compile=False, fuse_qkv=False, overlap=False, chunked_prefill=False)
    long_len = None
    if device.type == "cuda":
        long_len = min(plain.runner.mixed.graph_limit + 300, plain.config.max_model_len - args.max_tokens - 1) \
            if plain.runner.mixed is not None else None
    prompts = _prompts(args, plain.vocab_size, long_len)
    n = len(prompts)
    greedy = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * n
    sampled = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95,
                              seed=1000 + i) for i in range(n)]
    ref = {"greedy": _serve(plain, prompts, greedy, args.requests),
           "sampled": _serve(plain, prompts, sampled, args.requests)}
    plain.close()
    del plain
    arms = {"fast": {}, "chunked": {"chunk_tokens": args.chunk_tokens}}
    report = {}
    for name, fields in arms.items():
        engine = _engine(args, **fields)
        engine.warmup()
        g = _serve(engine, prompts, greedy, args.requests)
        s = _serve(engine, prompts, sampled, args.requests)
        engine.close()
        rows = [compare(a, b, args.atol) for a, b in zip(ref["greedy"], g)]
        same_sampled = sum(a["tokens"] == b["tokens"] for a, b in zip(ref["sampled"], s))
        mismatches = [i for i, r in enumerate(rows) if "near_tie" in r and not r["near_tie"]]
        worst = max(r["max_logit_diff"] for r in rows)
        report[name] = {
            "config": fields, "requests": rows, "max_logit_diff": worst,
            "greedy_requests_equal": sum("near_tie" not in r for r in rows),
            "near_ties": sum(bool(r.get("near_tie")) for r in rows), "mismatches": mismatches,
            "sampled_requests_equal": same_sampled, "requests_total": n,
            "passed": not mismatches and worst <= args.atol,
        }
        print(f"{name:8s} greedy: {report[name]['greedy_requests_equal']}/{n} equal, "
              f"{report[name]['near_ties']} near ties, {len(mismatches)} mismatches; largest logit difference "
              f"{worst:.3g} (atol {args.atol}); sampled (seeded): {same_sampled}/{n} equal -> "
              f"{'pass' if report[name]['passed'] else 'FAIL'}", flush=True)
    record = {"bench": "paths", "model": args.model, "device": args.device, "dtype": args.dtype,
              "atol": args.atol, "requests": n, "long_prompt": long_len, "max_tokens": args.max_tokens,
              "arms": report, "passed": all(r["passed"] for r in report.values()),
              "seconds": round(time.monotonic() - t0, 1), "provenance": prov}
    provenance.finish(prov)
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / (
        f"paths-{provenance.machine_slug(device)}-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"{'every arm passed' if record['passed'] else 'FAILED'}; JSON: {out}")
    return 0 if record["passed"] else 1
