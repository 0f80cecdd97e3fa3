"""How far a capacity probe's verdict lies from its goodput line, and which verdicts of `pdserve-bench defaults`
rest on a probe within that noise.

    counts(block)                     {"requests": n, "within": k} of a load run's probe block
    near_line(probe)                  the probe, if its count lies within one binomial sd of target x n
    rests_on_noise(a, b, result)      the near-the-line probes a decided at_least(a, b, ...) rests on

A probe (bench/load/capacity.py) passes with >= target (0.9) of its requests within every SLO. Were each
request to meet them by chance with probability target, the count within would spread by
sqrt(n x target x (1 - target)): 2.3 requests of 57, 9.5 of 1000. A verdict by less than that says little about
which side of the line the configuration lies, and requests that queue behind one another miss together, so
the true spread is wider still. bench/load/defaults.py marks such probes and the verdicts resting on them.
"""

from __future__ import annotations

import math


def counts(block: dict) -> dict:
    """{"requests": n, "within": k}: of the n requests a probe sent, k met every SLO. A probe stopped early
    (bench/load/early_stop.py) counts those it had sent and every one not yet seen to miss as within (the
    reading most favourable to it: its share of "at most" is over the requests it planned and never sent).
    Empty where the record lacks the counts."""
    stopped = block.get("stopped_early")
    if isinstance(stopped, dict):
        if stopped.get("sent") is None or stopped.get("missed") is None:
            return {}
        return {"requests": int(stopped["sent"]), "within": int(stopped["sent"]) - int(stopped["missed"])}
    n, frac = block.get("num_prompts"), block.get("goodput_fraction")
    return {"requests": int(n), "within": round(frac * n)} if n and frac is not None else {}


def near_line(p: dict) -> dict | None:
    """A probe whose verdict lies within one binomial standard deviation of its goodput line, or None. Of n
    requests a probe needs target x n within every SLO; were each to meet them by chance with probability
    target, that count would spread by sqrt(n x target x (1 - target)) (2.3 requests of 57 at 90%), so a pass or
    a fail by less says little about which side of the line the configuration lies (and requests that queue
    behind one another miss together, so the true spread is wider). Judged only where the share decided the
    probe: a fail with a growing queue is the queue's verdict, not the share's; and where the record has the
    counts (counts)."""
    n, k, t = p.get("requests"), p.get("within"), p.get("target")
    passed = bool(p.get("passed"))
    if not n or k is None or not t or (not passed and p.get("queue_growing")) or passed != (k >= t * n):
        return None
    sd = math.sqrt(n * t * (1 - t))
    if abs(k - t * n) >= sd:
        return None
    return {"rate": p["rate"], "passed": passed, "within": k, "requests": n, "line": t * n, "sd": sd,
            "folder": p.get("folder")}


def deciding(a: dict, b: dict, result: bool | None) -> list[tuple[dict, str]]:
    """The probes at_least(a, b, ...) rests on, with their arm's label: a's pass at its low and b's fail at its
    high where it said True, a's fail at its high and b's pass at its low where False; none where undecided."""
    if result is None:
        return []
    edges = [(a, True, a["low"]), (b, False, b["high"])] if result else [(a, False, a["high"]), (b, True, b["low"])]
    return [(p, arm["label"]) for arm, passed, rate in edges if rate is not None
            for p in arm["probes"] if bool(p.get("passed")) == passed and p["rate"] == rate]


def rests_on_noise(a: dict, b: dict, result: bool | None) -> list[dict]:
    """The probes a decided comparison rests on that lie within one binomial sd of their line (near_line)."""
    out: list[dict] = []
    for p, label in deciding(a, b, result):
        near = near_line(p)
        if near is not None and not any(q["arm"] == label and q["rate"] == near["rate"] for q in out):
            out.append({"arm": label, **near})
    return out
