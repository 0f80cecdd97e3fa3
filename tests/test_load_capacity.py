"""Capacity search, saturation marks and warm-up steadiness."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.capacity import is_steady, saturation, search_capacity
from bench.metrics import RequestRecord


def _search(limit: float, start: float, **kw):
    seen = []

    async def probe(rate: float) -> bool:
        seen.append(rate)
        return rate <= limit

    return asyncio.run(search_capacity(probe, start, **kw)), seen


def test_search_doubles_then_bisects_to_the_limit():
    cap, seen = _search(13.7, 1.0, max_probes=12, precision=0.05)
    assert seen[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]  # doubling until the first fail
    assert seen[5] == 12.0  # then the midpoint of [8, 16]
    assert cap.converged and cap.rate <= 13.7 < cap.first_fail and cap.first_fail / cap.rate - 1 <= 0.05
    assert len(cap.probes) == len(seen) <= 12
    assert [p.passed for p in cap.probes] == [r <= 13.7 for r in seen]
    # from above: halving until a pass
    cap, seen = _search(3.0, 40.0, max_probes=12, precision=0.1)
    assert seen[:4] == [40.0, 20.0, 10.0, 5.0] and cap.converged and cap.rate <= 3.0 < cap.first_fail
    # bounded: a tight precision stops at max_probes, not converged, bracket still right
    cap, seen = _search(13.7, 1.0, max_probes=6, precision=0.001)
    assert len(seen) == 6 and not cap.converged and cap.rate <= 13.7 < cap.first_fail
    cap, _ = _search(0.01, 1.0, max_probes=3)
    assert cap.rate is None and cap.first_fail == 0.25 and not cap.converged
    cap, _ = _search(1e9, 1.0, max_probes=3)
    assert cap.rate == 4.0 and cap.first_fail is None and not cap.converged
    with pytest.raises(ValueError):
        _search(1.0, 0.0)


def _records(sends: list[float], finish_of) -> list[RequestRecord]:
    out = []
    for i, s in enumerate(sends):
        f = finish_of(i, s)
        out.append(RequestRecord(i, None, 10, 4, scheduled_s=s, start_s=s, ttft_s=0.01, e2e_s=f - s, success=True,
                                 output_len=4))
    return out


def test_saturation_marks_a_growing_queue_and_not_a_stable_one():
    sends = [i * 0.1 for i in range(30)]  # 10 req/s
    # keeping up: every answer 0.3 s after its send, whatever the latency
    stable = _records(sends, lambda i, s: s + 0.3 + 0.05 * (i % 3))
    sat = saturation(stable, max(r.start_s + r.e2e_s for r in stable), 10.0)
    assert sat["saturated"] is False and sat["reasons"] == []
    assert sat["throughput_ratio"] == pytest.approx(1.0, abs=0.05)
    assert sat["lateness_growth"] == pytest.approx(1.0, abs=0.15)
    assert sat["offered_rate_realized"] == pytest.approx(10.0)
    # a server of 5 req/s: the i-th answer at 0.3 + i / 5
    queued = _records(sends, lambda i, s: 0.3 + i / 5.0)
    sat = saturation(queued, max(r.start_s + r.e2e_s for r in queued), 10.0)
    assert sat["saturated"] is True and len(sat["reasons"]) == 2
    assert sat["throughput_ratio"] == pytest.approx(0.5, abs=0.05)
    assert sat["lateness_growth"] > 3
    # too few requests, or closed loop: not judged (None, with the reason)
    assert saturation(stable[:6], 1.0, 10.0)["saturated"] is None
    assert saturation(stable, 1.0, None)["saturated"] is None


def test_warmup_steadiness():
    assert not is_steady([100.0], 0.1)
    assert not is_steady([300.0, 100.0], 0.1)
    assert is_steady([300.0, 100.0, 105.0], 0.1)
    assert not is_steady([100.0, 111.0], 0.1)
