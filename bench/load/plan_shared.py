"""A recorded `pdserve-bench load` run read against the planner: its requests replayed through the simulation,
and, for a prefill and a decode worker sharing one GPU, the pace each side kept while the other ran.

    replay(block)                        the run's requests (send time, prompt and reply lengths) as the planner's
    outcome(ttft_ms, tpot_ms, slos)      p50/p99 TTFT and TPOT, mean TTFT and the share within the SLOs
    compare(block, split, profile, slos) measured beside simulated: that outcome for one run
    sharing(blocks, profile)             the shared GPU's slowdowns, decode side and prefill side (Split's shared_*
                                         fields), read from the runs' per-request records
    python -m pdserve.bench.load.plan_shared RESULTS.json --profile ENGINE.json [--arm A] [--out sharing.json]
                                         both, for a 1P:1D arm on one GPU: the slowdowns it measured and its runs
                                         replayed under an even half, the planner's defaults and those slowdowns
    ... --arm A --colocated CHUNK        a colocated arm's runs replayed (chunk budget CHUNK, 0: unchunked)
Runs that did not answer every request (a probe stopped early) are left out of both, and named.

A block is one entry of results.json's "results" with its per-request records ("requests": scheduled_s,
prompt_len, output_len, ttft_s, itls_s, e2e_s and the server's timings). Everything is read on the client's
clock: a prefill forward is its request's send time plus the server's phases before it (parse, route, inbox,
prefill queue), for the server's prefill_ms, the requests whose forwards end together one forward; a decode
step is the gap between two tokens of a request. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pdserve.bench.load.plan_sim import Profile, Req, Split, simulate
from pdserve.bench.load.report import read_results

_BEFORE_PREFILL = ("parse", "route", "inbox", "prefill_queue")  # the server's phases ahead of the forward
# the router's phases and the messages' flights (protocol/phases.py): what the simulation, a model of the workers,
# leaves out; a request's TTFT less these (and less the HTTP round trip) is its workers' part
_ROUTER = ("parse", "route", "hops", "first_token_send")
COLD_PACE = 1.5  # a run whose forwards alone took this many times the profile's did not run at its pace
# requests of one prefill worker whose forwards took the same time to this precision and ended this close on the
# client's clock are one batched forward: at b051920 the reconstructed ends of one batch's requests spread up to
# 21 ms (p90 7.6 ms), and a 2-ms window split batches into pieces, each priced as a forward of its own
SAME_FORWARD_S = 0.05
SAME_PREFILL_MS = 0.001


def replay(block: dict) -> list[Req]:
    return [Req(r["index"], float(r["scheduled_s"]), int(r["prompt_len"]), int(r["output_len"]))
            for r in block["requests"]]


def outcome(ttft_ms: list[float], tpot_ms: list[float], slos: dict[str, float]) -> dict:
    ok = [t <= slos.get("ttft", np.inf) and p <= slos.get("tpot", np.inf) for t, p in zip(ttft_ms, tpot_ms)]
    return {"ttft_mean": float(np.mean(ttft_ms)), "ttft_p50": float(np.percentile(ttft_ms, 50)),
            "ttft_p99": float(np.percentile(ttft_ms, 99)), "tpot_p50": float(np.percentile(tpot_ms, 50)),
            "tpot_p99": float(np.percentile(tpot_ms, 99)), "within_slos": float(np.mean(ok))}


def compare(block: dict, split: Split, profile: Profile, slos: dict[str, float]) -> dict:
    """The run's measured outcome and the simulation's of the same requests sent at the same times."""
    rows = block["requests"]
    if not all(r["success"] for r in rows):
        raise ValueError(f"the run at {block['request_rate']} req/s has failed or stopped requests: no outcome to "
                         "set beside a simulation that runs every request to its end")
    done = simulate(split, profile, replay(block))
    measured = outcome([r["ttft_s"] * 1e3 for r in rows], [r["tpot_s"] * 1e3 for r in rows], slos)
    simulated = outcome([(r.first_token - r.arrival) * 1e3 for r in done],
                        [(r.finish - r.first_token) * 1e3 / max(1, r.output - 1) for r in done], slos)
    out = {"rate": block["request_rate"], "measured": measured, "simulated": simulated}
    workers = [worker_ttft_ms(r) for r in rows]
    if all(w is not None for w in workers):  # the workers' part of TTFT beside the simulated TTFT
        measured["worker_ttft_p50"] = float(np.percentile(workers, 50))
        simulated["worker_ttft_p50"] = simulated["ttft_p50"]
        out["workers"] = workers_ttft(rows, workers, [(r.first_token - r.arrival) * 1e3 for r in done])
    out["error"] = {k: simulated[k] / measured[k] - 1 if measured[k] else None for k in measured}
    return out


QUANTILES = (25, 50, 75, 90, 99)


def workers_ttft(rows: list[dict], measured: list[float], simulated: list[float]) -> dict:
    """The workers' TTFT measured beside the simulated one, the same requests: quantiles over all, and by kind of
    request (the workload's short and long prompts) the median of each with the median `prefill` phase measured."""
    out = {"quantiles": {q: [float(np.percentile(measured, q)), float(np.percentile(simulated, q))]
                         for q in QUANTILES}, "by_kind": {}}
    for kind in sorted({r.get("kind") or "all" for r in rows}):
        idx = [i for i, r in enumerate(rows) if (r.get("kind") or "all") == kind]
        p50 = [float(np.median([measured[i] for i in idx])), float(np.median([simulated[i] for i in idx]))]
        out["by_kind"][kind] = {"requests": len(idx), "worker_ttft_p50": p50,
                                "prefill_phase_p50": float(np.median([rows[i]["timings"]["prefill_ms"] for i in idx]))}
    return out


def worker_ttft_ms(row: dict) -> float | None:
    """A request's TTFT on the workers: the server's ttft_ms less the router's phases and the messages' flights
    (_ROUTER); None without the server's timings."""
    t = row.get("timings") or {}
    phases = t.get("ttft_phases_ms")
    if t.get("ttft_ms") is None or not phases:
        return None
    return t["ttft_ms"] - sum(phases.get(k) or 0.0 for k in _ROUTER)


def _forwards(rows: list[dict]) -> list[tuple[float, float, list[dict]]]:
    """The prefill forwards as (start, end, their requests), one prompt or a batch."""
    out: list = []
    for r in sorted(rows, key=lambda r: r["start_s"]):
        t = r["timings"]
        end = _forward_end(r)
        # one forward: the same worker, the same prefill_ms (every request of a batch is stamped with the batch's
        # start and end) and an end close by on the client's clock (each request's own HTTP latency offsets it)
        same = next((f for f in out if abs(f[1] - end) < SAME_FORWARD_S and f[2][0]["timings"].get(
            "prefill_worker") == t.get("prefill_worker") and abs(
            f[2][0]["timings"]["prefill_ms"] - t["prefill_ms"]) < SAME_PREFILL_MS), None)
        if same is None:
            out.append((end - t["prefill_ms"] / 1e3, end, [r]))
        else:
            same[2].append(r)
    return out


def _tokens(r: dict) -> np.ndarray:
    """The request's token times: its first token, then one per gap."""
    return r["start_s"] + r["ttft_s"] + np.concatenate([[0.0], np.cumsum(r["itls_s"])])


def _forward_end(r: dict) -> float:
    """The end of the request's prefill forward on the client's clock (its send time, the server's phases ahead of
    the forward, the forward)."""
    t = r["timings"]
    return r["start_s"] + (sum(t["ttft_phases_ms"][k] for k in _BEFORE_PREFILL) + t["prefill_ms"]) / 1e3


def _block_sharing(block: dict, profile: Profile) -> dict:
    rows = block["requests"]
    forwards = _forwards(rows)
    spans = [(r["start_s"] + r["ttft_s"], r["start_s"] + r["e2e_s"], r, _tokens(r)) for r in rows]
    # a request keeps the GPU busy from its forward's end: its KV moves, the decode worker adopts it and steps,
    # all before its first token reaches the client
    busy = [(_forward_end(r), r["start_s"] + r["e2e_s"], r) for r in rows]
    covered, alone, inside, outside = [], [], [], []
    for a, b, batch in forwards:
        others = [(s, e) for s, e, o in busy if all(o is not r for r in batch)]
        tokens = sum(profile.tokens(0, int(r["prompt_len"])) for r in batch)
        wall = float(batch[0]["timings"]["prefill_ms"])
        if any(s <= a and e >= b for s, e in others):
            covered.append((tokens, wall))
        elif not any(s < b and e > a for s, e in others):
            alone.append(wall / (profile.fixed_ms + tokens))
    for s, e, r, times in spans:
        for lo, hi in zip(times[:-1], times[1:]):
            mid = (lo + hi) / 2
            running = [(o, t) for s2, e2, o, t in spans if s2 < mid < e2]
            context = sum(int(o["prompt_len"]) + int(np.searchsorted(t, mid)) for o, t in running)
            pair = (hi - lo, profile.decode(len(running), context) / 1e3)
            if any(a <= lo and hi <= b for a, b, batch in forwards if all(o is not r for o in batch)):
                inside.append(pair)
            elif not any(a < hi and lo < b for a, b, _ in forwards):
                outside.append(pair)
    return {"covered": covered, "alone": alone, "inside": inside, "outside": outside}


def sharing(blocks: list[dict], profile: Profile) -> dict:
    """The pace each side of a shared GPU kept while the other ran, against the profile's times alone.

    decode_slowdown: the gaps between a request's tokens that lie inside another request's prefill forward,
    summed, over the profile's decode steps at the rows and contexts decoding then (decode_alone: the same for
    the gaps outside every forward, ~1 where the profile holds). prefill: the forwards that ran with a request
    decoding throughout, fitted as wall = c + prefill_slowdown x their tokens' cost alone (profile.tokens), and
    prefill_extra_ms = c - prefill_slowdown x the profile's fixed cost: what such a forward pays beyond slowing
    down (prefill_alone: the forwards with nothing decoding, over the profile's). A run whose forwards alone
    took COLD_PACE x the profile's or more (a cold or host-bound worker), or with failed or stopped requests,
    is left out and named."""
    parts, left_out = [], []
    for block in blocks:
        if not all(r["success"] for r in block["requests"]):
            left_out.append({"rate": block["request_rate"], "why": "failed or stopped requests"})
            continue
        part = _block_sharing(block, profile)
        if part["alone"] and float(np.median(part["alone"])) >= COLD_PACE:
            left_out.append({"rate": block["request_rate"], "why": f"its forwards alone took "
                             f"{float(np.median(part['alone'])):.2f}x the profile's (cold or host-bound)"})
            continue
        parts.append(part)
    inside, outside, covered, alone = ([x for p in parts for x in p[k]] for k in ("inside", "outside", "covered",
                                                                                 "alone"))
    if not inside or len(covered) < 2:
        raise ValueError("too few decode steps inside prefill forwards, or forwards covered by decoding, to read "
                         "the shared GPU's paces: give a run of a prefill and a decode worker on one GPU at rates "
                         f"that keep both busy (left out: {left_out})")
    tokens, wall = (np.array(v) for v in zip(*covered))
    (c, slowdown), *_ = np.linalg.lstsq(np.c_[np.ones_like(tokens), tokens], wall, rcond=None)
    fit = c + slowdown * tokens
    return {"decode_slowdown": float(sum(g for g, _ in inside) / sum(p for _, p in inside)),
            "decode_steps": len(inside),
            "decode_alone": float(sum(g for g, _ in outside) / sum(p for _, p in outside)) if outside else None,
            "prefill_slowdown": float(slowdown), "prefill_extra_ms": float(c - slowdown * profile.fixed_ms),
            "prefill_forwards": len(covered), "prefill_fit_error": float(np.median(abs(fit - wall) / wall)),
            "prefill_alone": float(np.median(alone)) if alone else None, "left_out": left_out}


EVEN_HALF = {"shared_decode_slowdown": 2.0, "shared_prefill_slowdown": 2.0, "shared_prefill_extra_ms": 0.0}


def _runs(results: dict, arm: str) -> tuple[list[dict], list[float]]:
    """The arm's runs that answered every request (replayable), and the rates of those that did not (a probe
    stopped early, failed requests): a simulation runs every request to its end, so those are left out."""
    blocks = [b for b in results["results"] if b["arm"] == arm]
    if not blocks:
        raise ValueError(f"no runs of arm {arm!r} (arms: {sorted({b['arm'] for b in results['results']})})")
    whole = [b for b in blocks if all(r["success"] for r in b["requests"])]
    if not whole:
        raise ValueError(f"arm {arm!r}: every run has failed or stopped requests: nothing to replay")
    return whole, [b["request_rate"] for b in blocks if b not in whole]


def replay_report(results: dict, profile: Profile, arm: str, split: Split) -> dict:
    """A colocated arm's runs replayed through `split`: measured beside simulated, run by run."""
    blocks, skipped = _runs(results, arm)
    return {"results": arm, "profile": profile.source, "split": split.label,
            "runs": [compare(b, split, profile, results["slos_ms"]) for b in blocks],
            "left_out_rates": skipped}


def report(results: dict, profile: Profile, arm: str, max_batched_tokens: int) -> dict:
    """The arm's measured slowdowns, and its runs replayed under an even half, the defaults and those."""
    blocks, skipped = _runs(results, arm)
    fit = sharing(blocks, profile)
    measured = {"shared_decode_slowdown": max(1.0, fit["decode_slowdown"]),
                "shared_prefill_slowdown": max(1.0, fit["prefill_slowdown"]),
                "shared_prefill_extra_ms": max(0.0, fit["prefill_extra_ms"])}
    cold = {x["rate"] for x in fit["left_out"]}
    runs = []
    for block in blocks:
        if block["request_rate"] in cold:
            continue
        row = {"rate": block["request_rate"]}
        for name, kw in (("even_half", EVEN_HALF), ("defaults", {}), ("measured", measured)):
            split = Split(1, 1, shared=True, max_batched_tokens=max_batched_tokens, **kw)
            row[name] = compare(block, split, profile, results["slos_ms"])
        runs.append(row)
    return {"results": arm, "profile": profile.source, "sharing": fit, "measured_split_fields": measured,
            "runs": runs, "left_out_rates": skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.load.plan_shared", description=__doc__.splitlines()[0])
    p.add_argument("results", help="a `pdserve-bench load` results.json with a 1P:1D arm on one GPU")
    p.add_argument("--profile", required=True, help="the engine JSON of the code that ran it")
    p.add_argument("--arm", default="disaggregated")
    p.add_argument("--max-batched-tokens", type=int, default=Split(1, 1).max_batched_tokens,
                   help="the prefill worker's (1: one prompt a forward, as before it batched)")
    p.add_argument("--colocated", type=int, default=None, metavar="CHUNK",
                   help="the arm is one colocated worker with this chunk budget (0: unchunked): its runs replayed "
                        "through it, measured beside simulated (no sharing to read)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        profile = Profile.from_engine_json(json.loads(Path(args.profile).read_text()), source=args.profile)
        results = read_results(args.results)
        if args.colocated is not None:
            split = Split(0, 1, chunk=args.colocated, max_batched_tokens=args.max_batched_tokens)
            out = replay_report(results, profile, args.arm, split)
        else:
            out = report(results, profile, args.arm, args.max_batched_tokens)
    except (OSError, KeyError, ValueError) as e:
        print(f"plan_shared: {e}", file=sys.stderr)
        return 2
    if args.colocated is not None:
        for c in out["runs"]:
            print(f"{c['rate']:>6g} req/s {out['split']}: " + _cells(c))
            if c.get("workers"):
                w = c["workers"]
                kinds = "; ".join(f"{k} ({v['requests']}): p50 {v['worker_ttft_p50'][0]:.1f}/"
                                  f"{v['worker_ttft_p50'][1]:.1f}, prefill phase p50 {v['prefill_phase_p50']:.1f}"
                                  for k, v in w["by_kind"].items())
                quantiles = " ".join(f"p{q} {m:.0f}/{s:.0f}" for q, (m, s) in w["quantiles"].items())
                print(f"         workers' TTFT {quantiles}; {kinds}")
        print(f"(measured/simulated; left out, stopped or failed: {out['left_out_rates'] or 'none'})")
        return _write(args, out)
    s = out["sharing"]
    nan = float("nan")
    print(f"decode step beside a forward: {s['decode_slowdown']:.2f}x the profile ({s['decode_steps']} gaps; "
          f"alone {s['decode_alone'] or nan:.2f}x); forward beside decoding: {s['prefill_slowdown']:.2f}x its "
          f"tokens + {s['prefill_extra_ms']:.1f} ms ({s['prefill_forwards']} forwards, median error "
          f"{s['prefill_fit_error']:.0%}; alone {s['prefill_alone'] or nan:.2f}x); left out {s['left_out']}")
    for row in out["runs"]:
        for name in ("even_half", "defaults", "measured"):
            c = row[name]
            print(f"{row['rate']:>6g} req/s {name:<9} " + _cells(c))
    return _write(args, out)


def _cells(c: dict) -> str:
    """One compare(): each figure as measured/simulated."""
    return "  ".join(f"{k} {c['measured'][k]:.1f}/{c['simulated'][k]:.1f}" for k in c["measured"])


def _write(args, out: dict) -> int:
    if args.out:
        from pdserve.bench.provenance import collect
        out = {"provenance": collect([]), "results_file": args.results, "max_batched_tokens": args.max_batched_tokens,
               **out}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
