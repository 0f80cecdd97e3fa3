"""bench/ab.py with fake timed functions: pairing, shuffling, reporting, and drift cancelled by pairing."""

from __future__ import annotations

import statistics

import pytest

from pdserve.bench import ab


class Clock:
    """A fake GPU: every call takes `base` ms times a factor that drifts up 1% per call (a GPU
    slowing down at its power limit)."""

    def __init__(self):
        self.calls = 0
        self.log: list[tuple[str, int]] = []

    def arm(self, name: str, base: float):
        def run(i: int) -> float:
            self.calls += 1
            self.log.append((name, i))
            return base * (1.01 ** self.calls)
        return run


def test_every_round_runs_each_arm_once_in_a_seeded_shuffled_order():
    clock = Clock()
    got = ab.interleave({"a": clock.arm("a", 1.0), "b": clock.arm("b", 1.0), "c": clock.arm("c", 1.0)},
                        rounds=12, seed=7, warmup=2)
    # warm-up rounds come first, in arm order, with negative indices, and are not recorded
    assert clock.log[:6] == [("a", -1), ("b", -1), ("c", -1), ("a", -2), ("b", -2), ("c", -2)]
    assert all(len(v) == 12 for v in got.results.values())
    for i, order in enumerate(got.orders):
        assert sorted(order) == ["a", "b", "c"]
        # round i's calls are adjacent and carry index i, in the recorded order
        assert clock.log[6 + 3 * i: 9 + 3 * i] == [(name, i) for name in order]
    assert len({tuple(o) for o in got.orders}) > 1, "the order never changed"
    again = ab.interleave({"a": Clock().arm("a", 1), "b": Clock().arm("b", 1), "c": Clock().arm("c", 1)},
                          rounds=12, seed=7, warmup=2)
    assert again.orders == got.orders
    other = ab.interleave({"a": Clock().arm("a", 1), "b": Clock().arm("b", 1), "c": Clock().arm("c", 1)},
                          rounds=12, seed=8)
    assert other.orders != got.orders


def test_paired_reports_differences_and_ratios_pair_by_pair():
    a = [10.0, 20.0, 30.0, 40.0, 50.0]
    b = [11.0, 22.0, 33.0, 44.0, 55.0]
    p = ab.paired(a, b)
    assert p["pairs"] == 5
    assert p["diff"] == {"median": 3.0, "min": 1.0, "max": 5.0, "n": 5}
    assert p["ratio"]["median"] == pytest.approx(1.1) and p["ratio"]["min"] == pytest.approx(1.1)
    # pairs go by index: the same values paired in another order spread differently
    assert ab.paired(a, b[::-1])["diff"] == {"median": 3.0, "min": -39.0, "max": 45.0, "n": 5}
    with pytest.raises(ValueError):
        ab.paired(a, b[:3])


def test_spread_has_deciles_from_ten_values():
    assert "p10" not in ab.spread([1.0] * 9)
    s = ab.spread([float(x) for x in range(1, 12)])  # 1..11
    assert s["median"] == 6.0 and s["min"] == 1.0 and s["max"] == 11.0 and s["n"] == 11
    assert s["p10"] == pytest.approx(2.0) and s["p90"] == pytest.approx(10.0)
    assert ab.summary([3.0, 1.0, 2.0])["runs"] == [3.0, 1.0, 2.0]


def test_pairing_cancels_drift_that_a_difference_of_medians_reports():
    """B is 5% slower than A. Measured all-A-then-all-B (the old way) the drift adds ~20%;
    interleaved and paired, the ratio comes out at 1.05 within the drift of one call."""
    rounds = 20
    sequential = Clock()
    run_a, run_b = sequential.arm("a", 100.0), sequential.arm("b", 105.0)
    a_runs = [run_a(i) for i in range(rounds)]
    b_runs = [run_b(i) for i in range(rounds)]
    seq_ratio = statistics.median(b_runs) / statistics.median(a_runs)
    assert seq_ratio > 1.2  # drift, not B

    clock = Clock()
    got = ab.compare(clock.arm("a", 100.0), clock.arm("b", 105.0), rounds=rounds, seed=0)
    assert abs(got["ratio"]["median"] - 1.05) < 0.011  # one call's drift is 1%
    assert got["ratio"]["min"] >= 1.05 / 1.011 and got["ratio"]["max"] <= 1.05 * 1.011
    assert got["pairs"] == rounds and len(got["a"]["runs"]) == rounds and "p10" in got["diff"]
    # the medians of each arm still drift: only the paired figure is the answer
    assert got["b"]["max"] / got["b"]["min"] > 1.3


def test_interleave_refuses_nonsense():
    with pytest.raises(ValueError):
        ab.interleave({"a": lambda i: 1.0}, rounds=3, seed=0)
    with pytest.raises(ValueError):
        ab.interleave({"a": lambda i: 1.0, "b": lambda i: 1.0}, rounds=0, seed=0)
