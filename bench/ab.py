"""Paired, interleaved A/B measurement: the only way a bench here claims "X costs d more than Y".

    interleave(arms, rounds, seed, warmup) -> Interleaved   run every arm once per round, the order
                                            shuffled per round by a seeded RNG; arm(i) gets the round
                                            index i (warm-up rounds get -1, -2, ...: not recorded)
    paired(a, b)                        -> dict  B against A round by round: the median of the paired
                                            differences (b - a) and of the ratios (b / a), with their spread
    compare(a, b, rounds, seed, warmup) -> dict  both at once for two timed callables
    spread(values) / summary(values)            median, min, max (+ p10, p90 from 10 values up)

Why: a GPU at its power limit drifts by several percent over minutes, so two medians taken
minutes apart measure the drift. Adjacent runs see the same clock, and shuffling the order
within each round keeps a steady trend from always favouring the arm that runs second. The
result is never a difference of medians.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def spread(values: list[float]) -> dict:
    """median, min, max and n; p10 and p90 when there are at least 10 values."""
    if not values:
        raise ValueError("no values to summarise")
    s = sorted(values)
    out = {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s)}
    if len(s) >= 10:
        deciles = statistics.quantiles(s, n=10, method="inclusive")
        out["p10"], out["p90"] = deciles[0], deciles[-1]
    return out


def summary(runs: list[float]) -> dict:
    """spread() plus the runs themselves, in the order they were measured."""
    return {**spread(runs), "runs": list(runs)}


@dataclass
class Interleaved(Generic[T]):
    results: dict[str, list[T]]  # arm -> its result in each round, round i at index i
    orders: list[list[str]] = field(default_factory=list)  # the order the arms ran in, per round


def interleave(arms: dict[str, Callable[[int], T]], rounds: int, seed: int, warmup: int = 0) -> Interleaved[T]:
    if rounds < 1 or warmup < 0 or len(arms) < 2:
        raise ValueError("need at least two arms, rounds >= 1 and warmup >= 0")
    rng = random.Random(seed)
    names = list(arms)
    for w in range(warmup):
        for name in names:
            arms[name](-1 - w)
    out: Interleaved[T] = Interleaved({name: [] for name in names})
    for i in range(rounds):
        order = names[:]
        rng.shuffle(order)
        out.orders.append(order)
        for name in order:
            out.results[name].append(arms[name](i))
    return out


def paired(a: list[float], b: list[float]) -> dict:
    """B against A, pair by pair (a[i] and b[i] measured in the same round)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs two equally long, non-empty lists, got {len(a)} and {len(b)}")
    return {
        "pairs": len(a),
        "diff": spread([y - x for x, y in zip(a, b)]),
        "ratio": spread([y / x for x, y in zip(a, b)]) if all(x > 0 for x in a) else None,
    }


def compare(a: Callable[[int], float], b: Callable[[int], float], rounds: int, seed: int,
            warmup: int = 0) -> dict:
    """Time a and b alternately (order shuffled per round): their summaries and B against A."""
    got = interleave({"a": a, "b": b}, rounds, seed, warmup)
    return {"a": summary(got.results["a"]), "b": summary(got.results["b"]),
            **paired(got.results["a"], got.results["b"]), "orders": got.orders}
