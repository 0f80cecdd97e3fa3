"""A policy's capacity under its SLOs, the sweep around it, and whether a run kept up.

    meets_target(fraction, target)         DistServe's goodput test: >= target (0.9) of the requests met every SLO
    search_capacity(probe, start, ...)     double the rate until a probe fails, then bisect between the best
                                           pass and the first fail; a bounded number of probes
    probe_requests(rate, seconds, minimum) how many requests a probe sends: >= `seconds` of arrivals, >= minimum
    probe_passes(block, target, queue)     a probe's verdict: the SLO target met and (queue) its queue not growing
    capacity_and_sweep(measure, ...)       the search, then the sweep at capacity x each factor, through one
                                           measure(rate, phase, factor) callable
    saturation(records, duration, rate)    did the server keep up: achieved vs offered rate, lateness growth
    is_steady(medians, tolerance)          warm-up: the last two batches' median TTFT agree within tolerance
    early_slowdown(records)                a cold run: its first quarter's median TTFT or TPOT > 2x the rest's

Torch-free and server-free: `probe` is any async callable rate -> passed, so the search is tested alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

import numpy as np

from pdserve.bench.load.metrics import RequestRecord

# A run is past saturation when either holds (both are reported, with these limits, in every block):
THROUGHPUT_RATIO_MIN = 0.8  # achieved / offered rate (slopes of answer and send times)
LATENESS_GROWTH_MAX = 1.5  # median lateness of the last third of the sends / that of the first third
# A queue is growing when lateness (answer time - scheduled send) rises against the send time faster than this
# many seconds per second (least-squares slope over the run): a server that serves mu < rate gives rate / mu - 1.
LATENESS_SLOPE_MAX = 0.05
PROBE_JUDGES = ("goodput+queue", "goodput")  # a probe passes on its SLO target and a steady queue, or the target alone


def probe_requests(rate: float, seconds: float, minimum: int) -> int:
    """Requests a probe at `rate` sends: enough for `seconds` of arrivals, and at least `minimum`."""
    return max(int(minimum), math.ceil(rate * seconds) if math.isfinite(rate) else 0)


def probe_passes(block: dict, target: float, queue: bool = True) -> bool:
    """The goodput target met, and (queue) no growing queue by bench/capacity.saturation's queue signals."""
    return meets_target(block["goodput_fraction"], target) and \
        not (queue and (block.get("saturation") or {}).get("queue_growing"))


def meets_target(goodput_fraction: float | None, target: float) -> bool:
    return goodput_fraction is not None and goodput_fraction >= target


@dataclass
class Probe:
    rate: float  # offered requests/s
    passed: bool
    requests: int | None = None  # sent by the probe
    arrivals_s: float | None = None  # first to last scheduled send
    duration_s: float | None = None  # the run, first send to last answer
    stopped_early_s: float | None = None  # when it stopped, certain to fail (bench/load/early_stop.py)


@dataclass
class Capacity:
    """`rate`: the highest passing rate probed (None: even the lowest probe failed); `first_fail`: the
    lowest failing one (None: none failed within the probes). Converged when first_fail / rate - 1 <= precision."""

    rate: float | None
    first_fail: float | None
    precision: float
    target: float
    probes: list[Probe] = field(default_factory=list)
    out_of_time: bool = False  # the time budget ran out before the search (or its sweep) finished

    @property
    def converged(self) -> bool:
        return self.rate is not None and self.first_fail is not None and \
            self.first_fail / self.rate - 1 <= self.precision + 1e-9

    def to_dict(self) -> dict:
        return {"capacity_rate": self.rate, "first_failing_rate": self.first_fail, "converged": self.converged,
                "bracket": [self.rate, self.first_fail],
                "precision": self.precision, "goodput_target": self.target, "out_of_time": self.out_of_time,
                "probes": [asdict(p) for p in self.probes]}


async def search_capacity(probe: Callable[[float], Awaitable[bool]], start_rate: float, *, max_probes: int = 8,
                          precision: float = 0.1, target: float = 0.9,
                          out_of_time: Callable[[], bool] = lambda: False,
                          fits: Callable[[float], bool] = lambda rate: True) -> Capacity:
    """Doubling from start_rate while probes pass (halving while they fail), then bisection of
    [best pass, first fail] until it is within `precision` (relative), max_probes ran, or
    out_of_time() (or not fits(rate): the next probe would not end within the budget) says so before a
    probe (the first probe always runs)."""
    if start_rate <= 0 or not math.isfinite(start_rate):
        raise ValueError(f"the search starts at a finite rate > 0, got {start_rate}")
    if max_probes < 1 or precision <= 0:
        raise ValueError(f"need max_probes >= 1 and precision > 0, got {max_probes} and {precision}")
    cap = Capacity(None, None, precision, target)
    rate = start_rate
    while len(cap.probes) < max_probes:
        if cap.probes and (out_of_time() or not fits(rate)):
            cap.out_of_time = True
            break
        passed = await probe(rate)
        cap.probes.append(Probe(rate, passed))
        if passed:
            cap.rate = rate if cap.rate is None else max(cap.rate, rate)
        else:
            cap.first_fail = rate if cap.first_fail is None else min(cap.first_fail, rate)
        if cap.rate is not None and cap.first_fail is not None:
            if cap.converged:
                break
            rate = (cap.rate + cap.first_fail) / 2
        elif cap.rate is not None:
            rate = cap.rate * 2
        else:
            rate = cap.first_fail / 2
    return cap


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


MIN_JUDGED = 12  # answered requests a run needs before its saturation is judged (thirds of >= 4)


def _slope(y: list[float]) -> float:
    """Least-squares slope of y against 0, 1, 2, ...: seconds per request, for sorted times."""
    return float(np.polyfit(np.arange(len(y)), np.asarray(y, dtype=float), 1)[0])


def saturation(records: list[RequestRecord], duration_s: float, rate: float | None) -> dict:
    """Open-loop runs only (rate finite). Two signals, each in the result:

    throughput_ratio   answers per second over requests per second, both as least-squares slopes of
                       the sorted send times and the sorted answer times (seconds per request), times
                       the share answered. A server that keeps up answers at the rate it is sent to
                       (~1, whatever its latency); one that serves mu < rate scores ~ mu / rate.
                       A slope, not count / duration: a short run's last answer would weigh too much.
    lateness_growth    lateness = answer time - scheduled send. Median over the last third of the sends
                       / over the first third: ~1 while the queue is stable, growing with it.
    lateness_slope     least-squares slope of lateness against the scheduled send (s per s): ~0 while the
                       queue is stable, rate / mu - 1 when the server serves mu < rate. With throughput_ratio,
                       the `queue_growing` verdict a capacity probe fails on (lateness_growth, a ratio, is
                       large on a short run whose first requests met an empty server: reported, not judged).
    """
    out = {"throughput_ratio": None, "lateness_growth": None, "lateness_slope": None, "offered_rate_realized": None,
           "throughput_ratio_min": THROUGHPUT_RATIO_MIN, "lateness_growth_max": LATENESS_GROWTH_MAX,
           "lateness_slope_max": LATENESS_SLOPE_MAX, "saturated": None, "queue_growing": None, "reasons": []}
    sent = sorted(records, key=lambda r: r.scheduled_s)
    ok = [r for r in sent if r.success and r.e2e_s is not None]
    if rate is None or not math.isfinite(rate) or len(ok) < MIN_JUDGED:
        out["reasons"].append(f"not judged: needs an open-loop finite rate and >= {MIN_JUDGED} answered requests")
        return out
    send_slope = _slope([r.scheduled_s for r in sent])
    answer_slope = _slope(sorted(r.start_s + r.e2e_s for r in ok))
    if send_slope > 0 and answer_slope > 0:
        out["offered_rate_realized"] = 1.0 / send_slope
        out["throughput_ratio"] = min(1.0, send_slope / answer_slope) * len(ok) / len(sent)
    third = len(sent) // 3
    lateness = {r.index: r.start_s - r.scheduled_s + r.e2e_s for r in ok}
    first = [lateness[r.index] for r in sent[:third] if r.index in lateness]
    last = [lateness[r.index] for r in sent[-third:] if r.index in lateness]
    if first and last and _median(first) > 0:
        out["lateness_growth"] = _median(last) / _median(first)
    late = [r for r in sent if r.index in lateness]
    if len({r.scheduled_s for r in late}) > 1:
        out["lateness_slope"] = float(np.polyfit([r.scheduled_s for r in late], [lateness[r.index] for r in late],
                                                 1)[0])
    growing = []
    if out["throughput_ratio"] is not None and out["throughput_ratio"] < THROUGHPUT_RATIO_MIN:
        growing.append(f"achieved {out['throughput_ratio']:.2f} of the offered rate (< {THROUGHPUT_RATIO_MIN})")
    if out["lateness_slope"] is not None and out["lateness_slope"] > LATENESS_SLOPE_MAX:
        growing.append(f"lateness rose {out['lateness_slope']:.3f} s per s of arrivals (> {LATENESS_SLOPE_MAX})")
    out["queue_growing"] = bool(growing)
    out["reasons"] += growing
    if out["lateness_growth"] is not None and out["lateness_growth"] > LATENESS_GROWTH_MAX:
        out["reasons"].append(f"lateness grew {out['lateness_growth']:.2f}x over the run (> {LATENESS_GROWTH_MAX})")
    out["saturated"] = bool(out["reasons"])
    return out


def is_steady(medians_ms: list[float], tolerance: float) -> bool:
    """The last two warm-up batches' median TTFTs differ by at most `tolerance` of the earlier one."""
    if len(medians_ms) < 2:
        return False
    a, b = medians_ms[-2], medians_ms[-1]
    return abs(b - a) <= tolerance * a


# A run is cold (its numbers still carry start-up effects) when either holds; cold runs are reported as
# any other, with cold: true and the reason (bench/load/session.py applies the first rule):
#   - it is its arm's first run and the arm's warm-up ended at --warmup-max-batches without two batches agreeing;
#   - early_slowdown: over its completed requests of one kind, in send order, the median TTFT or TPOT of
#     the first quarter is more than COLD_RATIO x that of the other three quarters (COLD_MIN_COMPARED or more).
COLD_RATIO = 2.0
COLD_MIN_COMPARED = 32  # completed requests of the compared kind (a first quarter of >= 8)


def early_slowdown(records: list[RequestRecord]) -> dict:
    """Were this run's first requests much slower than its later ones (a lazy compile, a graph capture, caches
    filling, or the run's own ramp: a closed loop starts with every slot sent at once)? Compared within one
    kind of request (the most numerous; a tie goes to the kind sent first), so a mix of short and long
    prompts, or a conversation's first and later turns, is not read as a slowdown. `reasons` empty: not cold
    by this rule (or not judged, `judged` false, with fewer than COLD_MIN_COMPARED requests)."""
    ok = sorted((r for r in records if r.success and r.ttft_s is not None), key=lambda r: (r.start_s, r.index))
    out = {"kind": None, "compared": 0, "min_compared": COLD_MIN_COMPARED, "ratio_max": COLD_RATIO,
           "judged": False, "reasons": []}
    for m in ("ttft", "tpot"):
        out |= {f"first_quarter_median_{m}_ms": None, f"rest_median_{m}_ms": None, f"{m}_ratio": None}
    if not ok:
        return out
    counts: dict[str, int] = {}
    for r in ok:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    kind = max(counts, key=lambda k: counts[k])  # dicts keep insertion order: a tie goes to the first sent
    same = [r for r in ok if r.kind == kind]
    out.update(kind=kind, compared=len(same))
    if len(same) < COLD_MIN_COMPARED:
        return out
    out["judged"] = True
    q = len(same) // 4
    for m, value in (("ttft", lambda r: r.ttft_s), ("tpot", lambda r: r.tpot_s)):
        first = [value(r) * 1e3 for r in same[:q] if value(r) is not None]
        rest = [value(r) * 1e3 for r in same[q:] if value(r) is not None]
        if len(first) < q or not rest:  # TPOT: 1-token answers have none
            continue
        a, b = _median(first), _median(rest)
        out[f"first_quarter_median_{m}_ms"], out[f"rest_median_{m}_ms"] = a, b
        if b > 0:
            out[f"{m}_ratio"] = a / b
            if a / b > COLD_RATIO:
                out["reasons"].append(f"the first quarter's median {m.upper()} ({a:.1f} ms) is {a / b:.1f}x the "
                                      f"rest's ({b:.1f} ms; > {COLD_RATIO:g}x, {len(same)} {kind} requests)")
    return out


def warmup_not_steady(warmup: dict | None) -> str | None:
    """The cold reason an arm's first run gets from its warm-up report (None: steady, or no warm-up ran)."""
    if not warmup or warmup.get("steady"):
        return None
    medians = ", ".join(f"{m:.0f}" for m in warmup["median_ttft_ms"])
    return (f"first run after a warm-up that ended at its limit ({warmup['batches']} of --warmup-max-batches "
            f"{warmup['max_batches']}) without two batches' median TTFT within {warmup['tolerance']:.0%} "
            f"({medians} ms)")


def start_up_may_explain(block: dict) -> bool:
    """Could start-up work explain this cold run's failure, so that a run on the warm server may judge
    otherwise? Yes when its arm's warm-up ended unsteady (compiles may still come, at any point of the run).
    When only its first quarter was slow, yes unless its lateness grew past LATENESS_GROWTH_MAX over the
    run: start-up work makes the first answers late, and a server that fell further behind as the run went
    on was over its capacity, which a warm run does not change."""
    if not block.get("cold"):
        return False
    if block.get("cold_warmup"):
        return True
    growth = (block.get("saturation") or {}).get("lateness_growth")
    return growth is None or growth <= LATENESS_GROWTH_MAX


async def capacity_and_sweep(measure: Callable[[float, str, float | None], Awaitable[dict]], *, start_rate: float,
                             max_probes: int, precision: float, target: float, factors: list[float],
                             out_of_time: Callable[[], bool] = lambda: False,
                             fits: Callable[[float], bool] = lambda rate: True,
                             queue: bool = False) -> tuple[Capacity, list[dict]]:
    """`measure(rate, phase, factor)` runs one open-loop point and returns its result block (with
    `goodput_fraction`, `saturation`, `duration`). A probe passes by probe_passes(block, target, queue).
    Probes first, then the sweep at capacity x each factor (none when every probe failed); no run starts
    once out_of_time() or when not fits(its rate). A probe that fails cold (its block's `cold`, set by
    measure) where start-up may explain it (start_up_may_explain) is run once more at its rate, and the second run judges it: the cold block is kept with
    `repeated_warm`. Each probe records its requests, arrival window and duration (the block's
    `arrival_window_s`, when measure sets it)."""
    blocks: list[dict] = []
    judged: list[dict] = []  # the block each probe was judged on, in the order of cap.probes

    async def probe(rate: float) -> bool:
        block = await measure(rate, "probe", None)
        blocks.append(block)
        passed = probe_passes(block, target, queue)
        if not passed and start_up_may_explain(block) and not out_of_time() and fits(rate):
            # a cold fail may be start-up alone (an unsteady warm-up, a slow first quarter): the rate is run
            # once more on the now warm server and that run judges it; the cold one stays in the results,
            # marked as repeated, and bounds nothing
            block["repeated_warm"] = True
            block = await measure(rate, "probe", None)
            blocks.append(block)
            passed = probe_passes(block, target, queue)
        judged.append(block)
        return passed

    cap = await search_capacity(probe, start_rate, max_probes=max_probes, precision=precision, target=target,
                                out_of_time=out_of_time, fits=fits)
    for p, b in zip(cap.probes, judged):
        stopped = b.get("stopped_early")  # a probe stopped early sent fewer than it planned: `requests` is the plan
        p.requests = stopped["planned"] if stopped else b.get("num_prompts")
        p.arrivals_s, p.duration_s = b.get("arrival_window_s"), b.get("duration")
        p.stopped_early_s = stopped["stopped_at_s"] if stopped else None
    if cap.rate is not None:
        for factor in sorted({f for f in factors if f > 0}):
            if out_of_time() or not fits(cap.rate * factor):
                cap.out_of_time = True
                break
            blocks.append(await measure(cap.rate * factor, "sweep", factor))
    return cap, blocks
