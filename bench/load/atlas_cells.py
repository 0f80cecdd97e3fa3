"""The atlas's cells judged from its load runs (bench/load/atlas.py runs them and draws the map):

    judge_run(block, slos, target)   one measured rate under one SLO pair: the share within them (and within
                                     each), its queue, passed or not (the capacity search's probe verdict)
    capacity_on_grid(judged)         an arm's capacity on the grid: the highest rate below which every rate
                                     passed, and its bracket
    winner(capacities)               the arm with the higher capacity, "tie", or "neither"
    why_no_winner(caps, slos, target)   why a cell has no winner, in words (None where one arm won)
    cells_of(runs, slos, target)     one cell per (profile, SLO pair)
"""

from __future__ import annotations

from pdserve.bench.load.capacity import probe_passes
from pdserve.bench.load.metrics import request_within


def judge_run(block: dict, slos: dict[str, float], target: float) -> dict:
    """One measured rate under one SLO pair: the share that met both, the queue, the verdict."""
    requests = block.get("requests") or []
    fraction = sum(all(request_within(r, slos).values()) for r in requests) / len(requests) if requests \
        else None
    verdict = probe_passes({"goodput_fraction": fraction, "saturation": block.get("saturation")}, target)
    within = [request_within(r, slos) for r in requests]
    return {"rate": block["request_rate"], "goodput_fraction": fraction, "passed": verdict,
            "within": {m: sum(w[m] for w in within) / len(within) for m in slos} if within else None,
            "queue_growing": (block.get("saturation") or {}).get("queue_growing"),
            "requests": len(requests), "arrival_window_s": block.get("arrival_window_s")}


def capacity_on_grid(judged: list[dict]) -> dict:
    """The highest rate below which every rate of the grid passed; its bracket; whether the grid ran out."""
    judged = sorted(judged, key=lambda j: j["rate"])
    rate, first_fail = None, None
    for j in judged:
        if not j["passed"]:
            first_fail = j["rate"]
            break
        rate = j["rate"]
    return {"capacity_rate": rate, "first_failing_rate": first_fail, "bracket": [rate, first_fail],
            "at_least": first_fail is None and rate is not None, "runs": judged}


def winner(capacities: dict[str, dict]) -> str:
    rated = {arm: c["capacity_rate"] or 0.0 for arm, c in capacities.items()}
    top = max(rated.values(), default=0.0)
    if top == 0.0:
        return "neither"
    best = [arm for arm, r in rated.items() if r == top]
    return best[0] if len(best) == 1 else "tie"


def why_no_winner(caps: dict[str, dict], slos: dict[str, float], target: float) -> str | None:
    """Why a cell has no winner: every arm failed (why_neither), or every arm passed every rate (a tie the grid
    ran out on); None where an arm won, or the tie is at a rate some arm failed above."""
    won = winner(caps)
    if won == "neither":
        return why_neither(caps, slos, target)
    if won == "tie" and all(c["at_least"] for c in caps.values()):
        return ("every arm met the SLOs at every grid rate: the grid ran out before any arm failed; give higher "
                "--rates to separate them")
    return None


def why_neither(caps: dict[str, dict], slos: dict[str, float], target: float) -> str:
    """Why no arm won a cell: each arm's best run (its share within the SLOs, the SLO most of its requests
    missed, or its growing queue), or that it has no runs."""
    parts = []
    for arm, cap in caps.items():
        runs = [r for r in cap["runs"] if r["goodput_fraction"] is not None]
        if not runs:
            parts.append(f"{arm} has no measured run")
            continue
        best = max(runs, key=lambda r: (r["goodput_fraction"], -r["rate"]))
        text = f"{arm} at best {best['goodput_fraction']:.0%} within them at {best['rate']:g}/s"
        if best["goodput_fraction"] >= target and best["queue_growing"]:
            text += " but its queue grew"
        elif best.get("within"):
            worst = min(best["within"], key=best["within"].get)
            text += f" ({worst} <= {slos[worst]:g} ms: {best['within'][worst]:.0%})"
        parts.append(text)
    return (f"every grid rate failed the SLOs (>= {target:.0%} of requests within them, queue steady): "
            + "; ".join(parts))


def cells_of(runs: dict[str, dict], slos: dict[str, dict], target: float,
             refused: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """runs: profile -> its load results.json; refused: profile -> SLO pair -> why it was not measured. One cell
    per (profile, SLO pair); a cell no arm won says why."""
    cells = []
    for profile in dict.fromkeys([*runs, *(refused or {})]):
        run = runs.get(profile)
        for name, pair in slos.items():
            why = ((refused or {}).get(profile) or {}).get(name)
            caps = {}
            for arm in [a["label"] for a in run["arms"]] if run else []:
                blocks = [b for b in run["results"] if b["arm"] == arm and b["phase"] == "point"]
                caps[arm] = capacity_on_grid([judge_run(b, pair, target) for b in blocks])
            cells.append({"profile": profile, "slo": name, "slos_ms": pair, "winner": winner(caps),
                          "capacities": caps, "why": why or why_no_winner(caps, pair, target)})
    return cells
