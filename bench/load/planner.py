"""`pdserve-bench plan`: how to split N GPUs (colocated, or xP:yD) for a workload and its SLOs, predicted
from a worker's measured profile.

    pdserve-bench plan --profile bench/results/engine-nvidia-h200-2026-12-01-4acfb30.json --gpus 2 \\
        --input-len uniform:1024:8192 --output-len 64 --goodput ttft:2000 tpot:25
    pdserve-bench plan --measure tiny --device cpu --gpus 2 ...   # runs `pdserve-bench engine` first (plan_measure.py)
    pdserve-bench plan --profile engine.json --trace mooncake.jsonl ...   # a trace's prompt and reply lengths

The profile: prefill time by prompt length (a forward's fixed cost, the decode fit's alpha, and the tokens'
cost beyond it), decode step time by batch x context and, where the JSON has the chunked scenario, what a
chunked step costs beyond its decodes and tokens, from `pdserve-bench engine`'s JSON (bench/load/plan_sim.py
fits it; a prefill worker batches waiting prompts within --max-batched-tokens, as the worker does). For
every split of --gpus workers (colocated chunked and unchunked, and each xP:yD with x + y = N; on one GPU,
1P:1D sharing it, each side slowed by its measured factor while the other runs: --shared-slowdowns), a
discrete-event simulation (bench/load/plan_sim.py) runs the workload at Poisson rates and the capacity
search of the load bench (bench/load/capacity.py) finds the highest rate at which >= --goodput-target of
the requests meet the SLOs and the queue does not grow: the split's predicted goodput (DistServe's, per GPU
too). The split with the highest wins; within the search's
precision of it, the colocated one (fewer moving parts). A prediction is a model: compare it with a
measured `pdserve-bench load --capacity-search` before trusting it (docs/benchmarks.md says how).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import numpy as np

from pdserve.settings.worker import EngineConfig
from pdserve.bench.load.atlas_cells import capacity_on_grid, judge_run
from pdserve.bench.load.capacity import Capacity, probe_passes, probe_requests, saturation, search_capacity
from pdserve.bench.load.metrics import RequestRecord, meets_slos, parse_slos
from pdserve.bench.load.plan_measure import measure_profile
from pdserve.bench.load.plan_sim import Profile, Req, Split, simulate
from pdserve.bench.load.report import read_results
from pdserve.bench.load.workload import LengthDist, long_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("profile (one of)")
    src.add_argument("--profile", default=None, help="a `pdserve-bench engine` JSON")
    src.add_argument("--measure", default=None, metavar="MODEL",
                     help="measure this model's profile first with `pdserve-bench engine` on a grid suited to "
                          "--device (bench/load/plan_measure.py: on a CPU 128-1k prompts, batches 1-16 at 256-1k "
                          "contexts)")
    src.add_argument("--device", default="cpu", help="--measure: the device")
    src.add_argument("--measure-args", default="", help="--measure: `pdserve-bench engine` flags over that grid, "
                                                        "e.g. '--lengths 256,1k --batches 1,8 --contexts 512,1k'")
    src.add_argument("--measure-memory-gb", type=float, default=8.0,
                     help="--measure on a CPU: refuse, before loading anything, a grid the model needs more host "
                          "memory for (estimated from its shapes)")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", default="1024", help="N, fixed:N, uniform:LO:HI or normal:MEAN:STD tokens")
    w.add_argument("--output-len", default="128")
    w.add_argument("--long-fraction", type=float, default=0.0, help="share of prompts from --long-input-len")
    w.add_argument("--long-input-len", default="uniform:8192:16384")
    w.add_argument("--trace", default=None, help="a Mooncake JSONL trace: its input/output lengths, cycled "
                                                 "(arrivals are Poisson at the searched rate)")
    w.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("deployment")
    d.add_argument("--gpus", type=int, default=2, help="workers to split (one GPU each)")
    d.add_argument("--chunk", type=int, default=None, help="colocated chunked prefill: prompt tokens per step "
                   "(default: the worker's own for the profile's device, 8192 on CUDA, 512 on the CPU)")
    d.add_argument("--max-batch", type=int, default=EngineConfig.max_num_seqs,
                   help="decoding rows a worker holds (the workers' --max-num-seqs; default theirs)")
    d.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_batched_tokens,
                   help="a forward of whole prompts (a prefill worker's batch, an unchunked colocated worker's "
                        "prefill step): prompt tokens at most, the first prompt whatever its length (default: the "
                        "worker's --max-batched-tokens; 1: one prompt a forward)")
    d.add_argument("--link-gbps", type=float, default=100.0, help="GB/s of the KV link between P and D")
    d.add_argument("--transfer-fixed-ms", type=float, default=0.5, help="fixed cost of one KV move")
    one = Split(1, 1, shared=True)
    d.add_argument("--shared-slowdowns", default=None, metavar="DECODE,PREFILL,EXTRA_MS",
                   help="--gpus 1, the prefill and decode workers sharing the GPU: while both run, a decode step's "
                        "time over its time alone, a prefill forward's, and the ms a forward pays once it overlaps "
                        f"decoding (default {one.shared_decode_slowdown:g},{one.shared_prefill_slowdown:g},"
                        f"{one.shared_prefill_extra_ms:g}: measured on the H200, bench/load/plan_sim.py says how; "
                        "python -m pdserve.bench.load.plan_shared reads them from a load run)")
    s = p.add_argument_group("search")
    s.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="the SLOs (required), e.g. ttft:2000 tpot:25; itl:MS judges a request by its longest gap "
                        "between two tokens, as the load bench does")
    s.add_argument("--goodput-target", type=float, default=0.9)
    s.add_argument("--probe-seconds", type=float, default=60.0, help="simulated seconds of arrivals per probe")
    s.add_argument("--probe-min-requests", type=int, default=200)
    s.add_argument("--search-precision", type=float, default=0.03)
    s.add_argument("--search-max-probes", type=int, default=16)
    s.add_argument("--seeds", type=int, default=5,
                   help="draws of the workload's lengths and arrivals (--seed, --seed + 1, ...): each split's "
                        "prediction is the median capacity over them, beside their range (a probe's verdict moves "
                        "with its arrivals' bursts; with an H100 profile ten draws spread a long-prompt workload's "
                        "capacity from 0.66 to 1.04 req/s around a median of 0.83; default 5)")
    s.add_argument("--measured", action="append", default=None, metavar="SPLIT=RESULTS.json:ARM",
                   help="a measured capacity to set beside a split's prediction: the capacity search of ARM in "
                        "a `pdserve-bench load --capacity-search` results.json, e.g. "
                        "'colocated x1 chunk 512=load/results.json:colocated', or, where ARM ran fixed rates (an "
                        "atlas piece), its capacity on that grid under this plan's SLOs (repeat)")
    s.add_argument("--out", default=None, help="write the plan as JSON here")


class Workload:
    """Prompt and reply lengths: seeded draws from the distributions, or a trace's, cycled."""

    def __init__(self, args):
        self.seed = args.seed
        self.trace = None
        if args.trace:
            rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
            if not rows:
                raise ValueError(f"{args.trace}: the trace has no requests")
            self.trace = [(int(r["input_length"]), max(1, int(r["output_length"]))) for r in rows]
            self.text = f"Mooncake trace {args.trace} ({len(rows)} requests' lengths, cycled)"
        else:
            self.dists = [LengthDist.parse(x) for x in (args.input_len, args.output_len, args.long_input_len)]
            self.long_fraction = args.long_fraction
            self.text = f"input {args.input_len}, output {args.output_len}" + \
                (f", {args.long_fraction:.0%} long with input {args.long_input_len}" if args.long_fraction else "")

    def lengths(self, n: int) -> list[tuple[int, int]]:
        if self.trace is not None:
            return [self.trace[i % len(self.trace)] for i in range(n)]
        inp, out, long_inp = self.dists
        rng = random.Random(self.seed)
        long_at = set(rng.sample(range(n), long_count(n, self.long_fraction)))
        return [((long_inp if i in long_at else inp).sample(rng), out.sample(rng)) for i in range(n)]


def requests_at(workload: Workload, rate: float, n: int, seed: int) -> list[Req]:
    """n Poisson arrivals, scaled so that they come at `rate` on the whole (a seeded draw of a few hundred gaps
    is several percent off its mean, which would move every predicted capacity by as much)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    if n > 1:
        times *= (n - 1) / rate / times[-1]
    return [Req(i, float(t), p, o) for i, (t, (p, o)) in enumerate(zip(times, workload.lengths(n)))]


def judge(done: list[Req], rate: float, slos: dict[str, float], target: float) -> dict:
    """The simulated run as a load-bench block: goodput fraction and the saturation signals."""
    # itls_s holds each request's longest gap alone: an ITL SLO judges a request by its longest gap
    records = [RequestRecord(r.index, None, r.prompt, r.output, output_len=r.output, scheduled_s=r.arrival,
                             start_s=r.arrival, ttft_s=r.first_token - r.arrival, e2e_s=r.finish - r.arrival,
                             itls_s=[r.max_gap_s] if r.output > 1 else [], success=True) for r in done]
    met = sum(meets_slos(r, slos) for r in records)
    block = {"request_rate": rate, "num_prompts": len(records), "goodput_fraction": met / len(records),
             "saturation": saturation(records, max(r.finish for r in done), rate),
             "arrival_window_s": done[-1].arrival, "duration": max(r.finish for r in done)}
    for name, values in (("ttft", [r.ttft_s for r in records]), ("tpot", [r.tpot_s for r in records
                                                                          if r.tpot_s is not None])):
        if values:
            block[f"p50_{name}_ms"], block[f"p90_{name}_ms"] = (float(np.percentile(values, q)) * 1e3
                                                                for q in (50, 90))
    block["probe_passed"] = probe_passes(block, target)
    return block


MAX_PROBE_REQUESTS = 50_000  # the most requests one simulated probe sends (see predict)


def predict(split: Split, profile: Profile, workload: Workload, slos: dict[str, float], *, target: float = 0.9,
            probe_seconds: float = 60.0, min_requests: int = 200, precision: float = 0.03, max_probes: int = 16,
            seed: int = 0) -> tuple[Capacity, list[dict]]:
    """The split's capacity: the load bench's search over simulated probes."""
    probes: list[dict] = []
    mean_in = float(np.mean([p for p, _ in workload.lengths(64)]))
    start = max(0.01, split.gpus * 1e3 / max(profile.prefill(0, round(mean_in)), 1e-3) / 4)

    async def probe(rate: float) -> bool:
        n = probe_requests(rate, probe_seconds, min_requests)
        block = judge(simulate(split, profile, requests_at(workload, rate, n, seed)), rate, slos, target)
        probes.append(block)
        return block["probe_passed"]

    # A profile whose fit prices some steps at nothing (a noisy CPU measurement: prompt tokens free past the
    # fixed cost, decode cost falling with context) passes every rate, and the doubling search's probes grew to
    # millions of simulated requests (a CI run spent 600 s in one). Past MAX_PROBE_REQUESTS the search stops:
    # the capacity reads as at least the last passing rate (out_of_time, first_fail none).
    cap = asyncio.run(search_capacity(probe, start, max_probes=max_probes, precision=precision, target=target,
                                      fits=lambda rate: probe_requests(rate, probe_seconds, min_requests)
                                      <= MAX_PROBE_REQUESTS))
    for p, b in zip(cap.probes, probes):
        p.requests, p.arrivals_s, p.duration_s = b["num_prompts"], b["arrival_window_s"], b["duration"]
    return cap, probes


def splits_for(gpus: int, args) -> list[Split]:
    common = {"max_batch": args.max_batch, "link_gbps": args.link_gbps, "transfer_fixed_ms": args.transfer_fixed_ms,
              "max_batched_tokens": args.max_batched_tokens}
    out = [Split(0, gpus, chunk=args.chunk, **common), Split(0, gpus, chunk=0, **common)]
    if gpus == 1:  # the one-GPU disaggregated arm: a prefill and a decode worker time-slicing it
        return out + [Split(1, 1, shared=True, **common, **shared_slowdowns(args.shared_slowdowns))]
    return out + [Split(x, gpus - x, **common) for x in range(1, gpus)]


def shared_slowdowns(text: str | None) -> dict:
    """--shared-slowdowns DECODE,PREFILL,EXTRA_MS as Split's fields; None: Split's defaults."""
    if text is None:
        return {}
    try:
        decode, prefill, extra = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--shared-slowdowns is DECODE,PREFILL,EXTRA_MS (e.g. 2.0,1.65,9.1), got {text!r}") from None
    return {"shared_decode_slowdown": decode, "shared_prefill_slowdown": prefill, "shared_prefill_extra_ms": extra}


def plan(profile: Profile, workload: Workload, args) -> dict:
    slos = parse_slos(args.goodput)
    lone = alone(profile, workload, slos, args.goodput_target)
    seeds = [args.seed + i for i in range(max(1, getattr(args, "seeds", 1)))]
    workloads = [workload] + [Workload(argparse.Namespace(**{**vars(args), "seed": s})) for s in seeds[1:]]
    arms = []
    for split in splits_for(args.gpus, args):
        # a request alone already over an SLO: no rate passes, and a search would halve towards zero
        runs = [(Capacity(None, None, args.search_precision, args.goodput_target), [])] if lone["misses"] else [
            predict(split, profile, w, slos, target=args.goodput_target, probe_seconds=args.probe_seconds,
                    min_requests=args.probe_min_requests, precision=args.search_precision,
                    max_probes=args.search_max_probes, seed=s) for w, s in zip(workloads, seeds)]
        # the median draw's search is the prediction (the lower middle of an even count); no passing rate counts
        # as the lowest
        cap, probes = sorted(runs, key=lambda r: r[0].rate or 0.0)[(len(runs) - 1) // 2]
        rates = [c.rate for c, _ in runs]
        at = next((b for b in probes if b["request_rate"] == cap.rate), {})
        arms.append({"split": split.label, "prefill_workers": split.prefill, "decode_workers": split.decode,
                     "colocated": split.prefill == 0, "chunk": split.chunk if split.prefill == 0 else None,
                     "shared_slowdowns": [split.shared_decode_slowdown, split.shared_prefill_slowdown,
                                          split.shared_prefill_extra_ms] if split.shared else None,
                     "predicted_capacity_rate": cap.rate, "per_gpu": None if cap.rate is None else cap.rate / split.gpus,
                     "seeds": seeds[:len(runs)], "capacity_by_seed": rates,
                     "seed_range": [min((r or 0.0) for r in rates), max((r or 0.0) for r in rates)],
                     "at_capacity": {k: at.get(k) for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms")}, **cap.to_dict()})
    best = recommend(arms, args.search_precision)
    return {"benchmark": "plan", "gpus": args.gpus, "workload": workload.text, "slos_ms": slos,
            "goodput_target": args.goodput_target, "profile": profile.to_dict(),
            "model": "bench/load/plan_sim.py (a simulation from the profile, not a measurement)",
            "alone": lone, "arms": arms, "recommended": best}


def alone(profile: Profile, workload: Workload, slos: dict[str, float], target: float) -> dict:
    """A request with a worker to itself (no queue, no other row): its TTFT (its prefill), TPOT and longest gap
    (one-row decode steps at its mean context) and E2E, at the goodput target's quantile over the workload's lengths; `misses`:
    the SLOs those values are already over, which no split can meet at any rate."""
    lengths = workload.lengths(200)
    ttft = np.array([profile.prefill(0, p) for p, _ in lengths])
    tpot = np.array([profile.decode(1, p + o // 2) for p, o in lengths])
    e2e = ttft + tpot * np.array([max(0, o - 1) for _, o in lengths])
    q = 100 * target
    # alone, a request's longest gap between tokens is one of its decode steps (nothing else runs beside it)
    values = {m: float(np.percentile(v, q)) for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", e2e))}
    return {"quantile": q, "ms": values, "misses": {m: values[m] for m, limit in slos.items() if values[m] > limit}}


def recommend(arms: list[dict], precision: float) -> str | None:
    """The highest predicted capacity; a colocated split within `precision` of it wins (fewer moving parts)."""
    scored = [a for a in arms if a["predicted_capacity_rate"] is not None]
    if not scored:
        return None
    top = max(a["predicted_capacity_rate"] for a in scored)
    near = [a for a in scored if a["predicted_capacity_rate"] >= top / (1 + precision)]
    colocated = [a for a in near if a["colocated"]]
    pick = max(colocated or near, key=lambda a: a["predicted_capacity_rate"])
    return pick["split"]


def measured_capacity(run: dict, arm: str, slos: dict[str, float], target: float) -> dict | None:
    """ARM's measured capacity in a load results.json: its capacity search's, or else, where it ran fixed rates
    (an atlas piece), its capacity on that grid judged under `slos` (bench/load/atlas_cells.py). None: neither."""
    info = next((a for a in run.get("arms") or [] if a.get("label") == arm), None)
    if info is None:
        return None
    if info.get("capacity"):
        cap = info["capacity"]
        return {"capacity_rate": cap["capacity_rate"], "bracket": cap.get("bracket"),
                "probe_seconds": cap.get("probe_seconds"), "from": "capacity search"}
    points = [b for b in run.get("results") or [] if b.get("arm") == arm and b.get("phase") == "point"]
    if not points:
        return None
    grid = capacity_on_grid([judge_run(b, slos, target) for b in points])
    return {"capacity_rate": grid["capacity_rate"], "bracket": grid["bracket"],
            "probe_seconds": (run.get("args") or {}).get("run_seconds"),
            "from": f"fixed rates {sorted(b['request_rate'] for b in points)} judged under {slos}"}


def bracket_error(predicted: float | None, bracket: list | None) -> float | None:
    """0 where the prediction lies in the measured bracket [highest pass, lowest fail); else its error against
    the nearer end (below the pass: predicted / pass - 1; at or above the fail: predicted / fail - 1)."""
    if predicted is None or not bracket:
        return None
    low, high = bracket
    if low is not None and predicted < low:
        return predicted / low - 1
    if high is not None and predicted >= high:
        return predicted / high - 1
    return 0.0


def compare(arms: list[dict], specs: list[str], slos: dict[str, float], target: float) -> list[dict]:
    """Each --measured spec: the split's predicted capacity beside the arm's measured one, the error
    (predicted / measured - 1) and the error against the measured bracket (bracket_error). A split label not
    in the plan, or an arm without a capacity, is an error."""
    out = []
    for spec in specs:
        split, eq, rest = spec.partition("=")
        path, colon, arm = rest.rpartition(":")
        if not (eq and colon and split and path and arm):
            raise ValueError(f"--measured is SPLIT=RESULTS.json:ARM, got {spec!r}")
        planned = next((a for a in arms if a["split"] == split), None)
        if planned is None:
            raise ValueError(f"--measured: no split {split!r} in this plan (its splits: "
                             f"{', '.join(a['split'] for a in arms)})")
        run = read_results(path)
        cap = measured_capacity(run, arm, slos, target)
        if cap is None:
            raise ValueError(f"--measured: {path} has no capacity search or fixed-rate runs for arm {arm!r}")
        predicted, measured = planned["predicted_capacity_rate"], cap["capacity_rate"]
        out.append({"split": split, "results": path, "arm": arm, "predicted_capacity_rate": predicted,
                    "measured_capacity_rate": measured, "measured_bracket": cap["bracket"],
                    "measured_probe_seconds": cap["probe_seconds"], "measured_from": cap["from"],
                    "error": None if not predicted or not measured else predicted / measured - 1,
                    "bracket_error": bracket_error(predicted, cap["bracket"]),
                    "predicted_seed_range": planned.get("seed_range"),
                    "measured_within_seed_range": None if measured is None or not planned.get("seed_range") else
                    planned["seed_range"][0] <= measured <= planned["seed_range"][1],
                    "measured_command": run.get("command"), "measured_workload": run.get("workload")})
    return out


def run(args) -> int:
    try:
        if (args.profile is None) == (args.measure is None):
            raise ValueError("give the profile: --profile ENGINE.json or --measure MODEL")
        if args.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
        if not args.goodput:
            raise ValueError("give the SLOs the split must meet: --goodput ttft:MS tpot:MS")
        workload = Workload(args)
        Split(1, 1, shared=True, **shared_slowdowns(args.shared_slowdowns))  # refused here, not mid-plan
        engine_json = json.loads(Path(args.profile).read_text()) if args.profile else None
        profile = Profile.from_engine_json(engine_json, source=args.profile) if engine_json is not None \
            else measure_profile(args.measure, args.device, args.measure_args, args.measure_memory_gb)
        if args.chunk is None:  # the colocated worker's default for the device the profile was measured on
            devices = engine_json.get("provenance", {}).get("devices", []) if engine_json is not None \
                else [args.device]
            args.chunk = EngineConfig(device="cuda:0" if any(str(d).startswith("cuda") for d in devices)
                                      else "cpu").step_chunk_tokens
    except (ValueError, OSError, KeyError) as e:
        print(f"pdserve-bench plan: {e}", file=sys.stderr)
        return 2
    from pdserve.bench.provenance import collect
    result = {"provenance": collect([]), **plan(profile, workload, args)}
    try:
        result["validation"] = compare(result["arms"], args.measured or [], result["slos_ms"], args.goodput_target)
    except (ValueError, OSError) as e:
        print(f"pdserve-bench plan: {e}", file=sys.stderr)
        return 2
    print(f"{args.gpus} GPU(s), {workload.text}, SLOs {result['slos_ms']} (>= {args.goodput_target:.0%})")
    n = len(result["arms"][0]["seeds"]) if result["arms"] else 1
    print(f"{'split':<28} {'predicted req/s':>16} {'per GPU':>9}  {f'over {n} draws':>14}  bracket")
    for a in result["arms"]:
        rate = f"{a['capacity_rate']:.3g}" if a["capacity_rate"] is not None else \
            "none (alone)" if result["alone"]["misses"] else "< lowest probe"
        per = "-" if a["per_gpu"] is None else f"{a['per_gpu']:.3g}"
        spread = "{:.3g}-{:.3g}".format(*a["seed_range"])
        print(f"{a['split']:<28} {rate:>16} {per:>9}  {spread:>14}  {a['bracket']}")
    if n > 1:
        print(f"(the median of {n} draws of the workload's lengths and arrivals, seeds {args.seed}-{args.seed + n - 1}; "
              "a single probe's verdict moves within such a range)")
    for v in result["validation"]:
        err = "-" if v["error"] is None else f"{v['error']:+.0%}"
        inside = {True: "; within the draws' range", False: "; outside the draws' range", None: ""}[
            v["measured_within_seed_range"]]
        berr = "-" if v["bracket_error"] is None else f"{v['bracket_error']:+.0%}"
        print(f"validated: {v['split']}: predicted {v['predicted_capacity_rate'] or 0:.3g}, measured "
              f"{v['measured_capacity_rate']} req/s (bracket {v['measured_bracket']}, {v['measured_from']}), "
              f"error {err}, against the bracket {berr}{inside}")
    misses = result["alone"]["misses"]
    if misses:
        print(f"no split meets the SLOs at any rate: a request alone on one worker is already over them (p"
              f"{result['alone']['quantile']:g}: " + ", ".join(f"{m} {v:.0f} ms > {result['slos_ms'][m]:g}"
                                                             for m, v in misses.items())
              + f"; profile {profile.source}); loosen the SLOs or measure a faster device")
    print(f"recommended: {result['recommended']} (a prediction of bench/load/plan_sim.py: validate it with "
          "pdserve-bench load --capacity-search)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
