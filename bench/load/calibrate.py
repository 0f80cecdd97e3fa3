"""The atlas's rates where nobody knows what the machine can reach (a CPU, or `--rates auto`): before a grid of
minute-long runs, one short run per profile measures every arm, and the grid is set from it, or the cells it
cannot fill are refused with the reason.

    calibration_argv(flags, arms, out, common)   the load bench's flags for that short run: every arm's own
                                     server, a warm-up, then PROMPTS requests closed-loop at each of CONCURRENCY
                                     (the most in flight first)
    reach(run)                       per arm: a request alone (concurrency 1: its share within any SLOs, its
                                     latencies) and the throughput with CONCURRENCY[-1] in flight
    refusals(reach, slos, target)    the SLO pairs no arm can meet at any rate: most of its requests, sent alone,
                                     already miss one (the cell is refused, the SLO and the value named)
    grid(reach, points)              rates from well below the slowest arm's throughput to past the fastest's,
                                     evenly spaced on a log scale
    minutes(rates, reach, ...)       how long the grid will take, at least (each run >= its arrivals, and a run
                                     past an arm's throughput drains its queue at that throughput)
"""

from __future__ import annotations

import math

from pdserve.bench.load.metrics import request_within

CONCURRENCY = (1, 4)
PROMPTS = 8
LOW, HIGH = 0.25, 1.5  # the grid from LOW x the slowest arm's throughput to HIGH x the fastest's
ALONE_MIN = 0.5  # an SLO pair most requests miss when sent alone cannot reach the goodput target at any rate
SERVER_START_S = 15.0  # a CPU server's start and warm-up, per arm and profile (measured: 5-10 s for tiny)


class Unreachable(ValueError):
    """No cell of the atlas can be filled on this machine: every SLO pair is missed by requests sent alone."""


def calibration_argv(flags: list[str], arms: list[str], out, common: list[str]) -> list[str]:
    return [*(x for arm in arms for x in ("--arm", arm)), *flags, *common,
            # the throughput run first: an arm's first run after its warm-up can still be cold, and a request
            # alone measured cold would refuse SLOs the warm server meets
            "--concurrency", ",".join(str(c) for c in CONCURRENCY[::-1]), "--num-prompts", str(PROMPTS),
            "--warmup-batch", "2", "--warmup-max-batches", "3", "--out", str(out), "--no-progress", "--no-plots"]


def reach(run: dict) -> dict[str, dict]:
    """arm -> {"alone": the concurrency-1 block's requests and p50s, "throughput": req/s at the top concurrency}."""
    out: dict[str, dict] = {}
    for b in run["results"]:
        arm = out.setdefault(b["arm"], {"alone": None, "throughput": None})
        if b.get("max_concurrency") == CONCURRENCY[0]:
            arm["alone"] = {"requests": b.get("requests") or [],
                            **{f"p50_{m}_ms": b.get(f"median_{m}_ms") for m in ("ttft", "tpot", "itl", "e2el")}}
        elif b.get("max_concurrency") == CONCURRENCY[-1] and b.get("completed"):
            arm["throughput"] = b["request_throughput"]
    return out


def _alone_share(alone: dict, slos: dict[str, float]) -> tuple[float, dict[str, float]]:
    within = [request_within(r, slos) for r in alone["requests"]]
    if not within:
        return 0.0, dict.fromkeys(slos, 0.0)
    return sum(all(w.values()) for w in within) / len(within), \
        {m: sum(w[m] for w in within) / len(within) for m in slos}


def refusals(arms: dict[str, dict], slos: dict[str, dict[str, float]]) -> dict[str, str]:
    """SLO pair name -> why no arm can meet it (absent: some arm can)."""
    out = {}
    for name, pair in slos.items():
        why = []
        for arm, r in arms.items():
            if r["alone"] is None:
                why.append(f"{arm} answered no request alone")
                continue
            share, each = _alone_share(r["alone"], pair)
            if share >= ALONE_MIN:
                break
            worst = min(each, key=each.get)
            value = r["alone"].get(f"p50_{worst}_ms")
            why.append(f"{arm}: {share:.0%} of requests sent alone met them ({worst} <= {pair[worst]:g} ms: "
                       f"{each[worst]:.0%}" + (f", p50 {value:.0f} ms" if value is not None else "") + ")")
        else:
            out[name] = "no rate can meet these SLOs here: " + "; ".join(why)
    return out


def _round(x: float) -> float:
    digits = 1 - math.floor(math.log10(x))
    return round(x, digits)


def grid(arms: dict[str, dict], points: int = 4) -> list[float]:
    """`points` rates, log-spaced from LOW x the slowest arm's throughput to HIGH x the fastest's (2 significant
    digits); [] when no arm completed its throughput run."""
    rates = [r["throughput"] for r in arms.values() if r["throughput"]]
    if not rates:
        return []
    lo, hi = LOW * min(rates), HIGH * max(rates)
    step = (hi / lo) ** (1 / max(1, points - 1))
    return sorted({_round(lo * step ** i) for i in range(points)})


def minutes(rates: list[float], arms: dict[str, dict], run_seconds: float, min_requests: int) -> float:
    """The grid's least time: per arm and rate, the arrivals (>= run_seconds, >= min_requests) or, past the
    arm's throughput, the time to serve them at it; plus a server start per arm."""
    total = 0.0
    for r in arms.values():
        thr = r["throughput"] or min(rates)
        for rate in rates:
            n = max(min_requests, math.ceil(rate * run_seconds))
            total += max(n / rate, n / thr)
        total += SERVER_START_S
    return total / 60


def on_cpu(devices: str, gpus_seen: str | None) -> bool:
    """Whether the atlas's servers run on a CPU: --devices names only CPUs, or this host has no GPU."""
    return all(d.strip().startswith("cpu") for d in devices.split(",") if d.strip()) or not gpus_seen


def calibrate(profiles: dict[str, list[str]], arms: list[str], slos: dict[str, dict[str, float]], common: list[str],
              out, run_load, points: int = 4) -> dict:
    """One short load run per profile (run_load: the load bench's main) -> {"profiles": {profile: {"rates",
    "refused": {SLO pair: why}, "reach"}}, "note"}. Unreachable when no profile has a cell to measure."""
    import shlex
    import sys

    from pdserve.bench.load.report import read_results, results_file

    found = {}
    for profile, flags in profiles.items():
        argv = calibration_argv(flags, arms, out / profile, common)
        print(f"atlas: calibrating {profile}: pdserve-bench load {shlex.join(argv)}", file=sys.stderr)
        code = run_load(argv)
        path = results_file(out / profile)
        if path is None:
            raise Unreachable(f"the calibration run of profile {profile} measured nothing (exit {code}); its "
                              f"servers' logs are in {out / profile}")
        arms_reach = reach(read_results(path))
        refused = refusals(arms_reach, slos)
        rates = grid(arms_reach, points) if len(refused) < len(slos) else []
        found[profile] = {"rates": rates, "refused": refused, "reach": {
            a: {"throughput": r["throughput"],
                "alone": {k: v for k, v in (r["alone"] or {}).items() if k != "requests"}}
            for a, r in arms_reach.items()}}
        thr = ", ".join(f"{a} {r['throughput']:.3g}/s" for a, r in arms_reach.items() if r["throughput"])
        print(f"atlas: {profile}: throughput with {CONCURRENCY[-1]} in flight {thr or 'none'}; rates "
              f"{rates or 'none'}" + "".join(f"; {n} refused: {w}" for n, w in refused.items()), file=sys.stderr)
    if not any(p["rates"] for p in found.values()):
        raise Unreachable("no cell of the atlas can be measured on this machine: " + " | ".join(
            f"{profile}: " + ("; ".join(f"{n}: {w}" for n, w in p["refused"].items()) or "no arm's throughput run "
                              "completed") for profile, p in found.items())
            + ". Loosen the SLOs (--slo NAME=ttft:MS,tpot:MS), shorten the prompts (--profile), or use a GPU")
    note = (f"calibrated on this machine (bench/load/calibrate.py): per profile, {PROMPTS} requests at "
            f"{' and '.join(str(c) for c in CONCURRENCY)} in flight per arm, then {points} rates from {LOW:g}x the "
            f"slowest arm's throughput to {HIGH:g}x the fastest's; runs in {out.name}/")
    return {"profiles": found, "note": note}
