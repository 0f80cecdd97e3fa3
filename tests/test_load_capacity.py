"""Capacity search, saturation marks and warm-up steadiness: alone, then against a fake server whose
one "GPU" prefills 40 requests a second, so its queue (and TTFT) grows without bound past 40 req/s."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.capacity import capacity_and_sweep, is_steady, saturation, search_capacity
from pdserve.bench.load.metrics import RequestRecord
from pdserve.client import Client, ClientError

pytestmark = pytest.mark.alone  # a fake server's latencies against SLOs: a neighbour's CPU burst reads as load


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
    # out of time: no probe starts once the clock says so (the first always runs)
    seen = []

    async def probe(rate: float) -> bool:
        seen.append(rate)
        return rate <= 13.7

    cap = asyncio.run(search_capacity(probe, 1.0, max_probes=12, out_of_time=lambda: len(seen) >= 3))
    assert seen == [1.0, 2.0, 4.0] and cap.out_of_time and cap.rate == 4.0 and not cap.converged
    cap = asyncio.run(search_capacity(probe, 1.0, max_probes=12, out_of_time=lambda: True))
    assert len(cap.probes) == 1 and cap.out_of_time
    cap, _ = _search(0.01, 1.0, max_probes=3)
    assert cap.rate is None and cap.first_fail == 0.25 and not cap.converged
    cap, _ = _search(1e9, 1.0, max_probes=3)
    assert cap.rate == 4.0 and cap.first_fail is None and not cap.converged
    with pytest.raises(ValueError):
        _search(1.0, 0.0)


def test_capacity_then_sweep_through_one_measure():
    calls = []

    async def measure(rate: float, phase: str, factor):
        calls.append((phase, rate, factor))
        return {"goodput_fraction": 1.0 if rate <= 13.7 else 0.5}

    cap, blocks = asyncio.run(capacity_and_sweep(measure, start_rate=1.0, max_probes=12, precision=0.05, target=0.9,
                                                 factors=[1.5, 0.5, 0.5]))
    assert len(blocks) == len(calls) and [c[0] for c in calls].count("probe") == len(cap.probes)
    assert calls[-2:] == [("sweep", cap.rate * 0.5, 0.5), ("sweep", cap.rate * 1.5, 1.5)]
    calls.clear()
    cap, _ = asyncio.run(capacity_and_sweep(measure, start_rate=1.0, max_probes=12, precision=0.05, target=0.9,
                                            factors=[0.5], out_of_time=lambda: len(calls) >= 4))
    assert [c[0] for c in calls] == ["probe"] * 4 and cap.out_of_time


def test_a_cold_failing_probe_is_run_again_and_the_warm_run_judges_it():
    calls = []

    async def measure(rate: float, phase: str, factor):
        calls.append((phase, rate))
        first = len(calls) == 1  # the arm's first run: cold, and failing on start-up alone
        return {"goodput_fraction": 0.5 if first or rate > 13.7 else 1.0, "cold": first or rate == 16.0}

    cap, blocks = asyncio.run(capacity_and_sweep(measure, start_rate=8.0, max_probes=6, precision=0.1, target=0.9,
                                                 factors=[]))
    # 8 failed cold and ran again warm (a pass); 16 fails cold twice and counts as a fail once
    assert calls[:5] == [("probe", 8.0), ("probe", 8.0), ("probe", 16.0), ("probe", 16.0), ("probe", 12.0)]
    assert [(p.rate, p.passed) for p in cap.probes][:3] == [(8.0, True), (16.0, False), (12.0, True)]
    assert cap.rate is not None and cap.rate <= 13.7 < cap.first_fail <= 16.0
    assert [b.get("repeated_warm", False) for b in blocks[:4]] == [True, False, True, False]
    # a warm fail is not repeated; nor a cold one that no longer fits the budget
    calls.clear()
    cap, blocks = asyncio.run(capacity_and_sweep(measure, start_rate=20.0, max_probes=1, precision=0.1, target=0.9,
                                                 factors=[], fits=lambda rate: False))
    assert calls == [("probe", 20.0)] and not cap.probes[0].passed and "repeated_warm" not in blocks[0]


def test_a_cold_fail_whose_queue_grew_is_not_run_again_unless_its_warm_up_was_unsteady():
    """A slow first quarter with lateness growing over the run is overload, not start-up: judged as it is.
    An unsteady warm-up may leave compiles for any point of the run: that cold fail is run again."""
    from pdserve.bench.load.capacity import start_up_may_explain

    grew, flat = {"lateness_growth": 4.8}, {"lateness_growth": 0.7}
    assert not start_up_may_explain({"cold": True, "saturation": grew})
    assert start_up_may_explain({"cold": True, "saturation": flat})
    assert start_up_may_explain({"cold": True, "saturation": None})  # no rate, no growth to read
    assert start_up_may_explain({"cold": True, "cold_warmup": True, "saturation": grew})
    assert not start_up_may_explain({"cold": False, "saturation": flat})
    for warmup, runs in ((False, 1), (True, 2)):
        calls = []

        async def measure(rate: float, phase: str, factor):
            calls.append(rate)
            return {"goodput_fraction": 0.3, "cold": len(calls) == 1, "cold_warmup": warmup and len(calls) == 1,
                    "saturation": grew}

        asyncio.run(capacity_and_sweep(measure, start_rate=20.0, max_probes=1, precision=0.1, target=0.9, factors=[]))
        assert calls == [20.0] * runs


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
    assert sat["lateness_slope"] == pytest.approx(0.0, abs=0.01) and sat["queue_growing"] is False
    # a server of 5 req/s: the i-th answer at 0.3 + i / 5
    queued = _records(sends, lambda i, s: 0.3 + i / 5.0)
    sat = saturation(queued, max(r.start_s + r.e2e_s for r in queued), 10.0)
    assert sat["saturated"] is True and len(sat["reasons"]) == 3
    assert sat["throughput_ratio"] == pytest.approx(0.5, abs=0.05)
    assert sat["lateness_slope"] == pytest.approx(10 / 5 - 1, abs=0.05) and sat["queue_growing"] is True
    assert sat["lateness_growth"] > 3
    # too few requests, or closed loop: not judged (None, with the reason)
    assert saturation(stable[:6], 1.0, 10.0)["saturated"] is None
    assert saturation(stable, 1.0, None)["saturated"] is None


def test_warmup_steadiness():
    assert not is_steady([100.0], 0.1)
    assert not is_steady([300.0, 100.0], 0.1)
    assert is_steady([300.0, 100.0, 105.0], 0.1)
    assert not is_steady([100.0, 111.0], 0.1)


def test_capacity_search_finds_the_fake_servers_limit(tmp_path):
    """One arm with its own server (the fake one, in its own process): 25 ms a prefill, one at a time,
    so 40 req/s at most. TTFT SLO 100 ms: a prefill plus three queued. Near-periodic arrivals
    (burstiness 50) keep the queue empty below the limit; above it each request waits 25 - 1000/rate
    ms more than the one before, so with 24 requests (3 may fail) the SLOs fail from ~46 req/s on; the
    queue grows, and fails a probe, from just past 40."""
    out = tmp_path / "cap"
    server = f"{sys.executable} -m pdserve.bench.load.fake_server --port 0 --itl-ms 1 --prefill-ms-per-token 0 " \
             "--prefill-ms-per-request 25"
    rc = generator.main(["--arm", "colo=colocated:", "--server-command", server, "--capacity-search",
                    "--search-start-rate", "16", "--search-precision", "0.15", "--search-max-probes", "7",
                    "--sweep-factors", "0.5,1.5", "--num-prompts", "24", "--probe-seconds", "0.5", "--input-len", "20",
                    "--output-len", "2",
                    "--burstiness", "50", "--goodput", "ttft:100", "--warmup-batch", "2",
                    "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    arm = run["arms"][0]
    assert arm["label"] == "colo" and arm["server"]["startup_s"] > 0 and (out / "server-colo.log").is_file()
    cap = arm["capacity"]
    assert cap["converged"] and 30.0 <= cap["capacity_rate"] <= 47.0 and cap["first_failing_rate"] <= 54.0
    probes = [b for b in run["results"] if b["phase"] == "probe"]
    assert [b["request_rate"] for b in probes] == [p["rate"] for p in cap["probes"]]
    assert [p["rate"] for p in cap["probes"]][:3] == [16.0, 32.0, 64.0]
    for b in probes:
        assert b["meets_goodput_target"] == (b["goodput_fraction"] >= 0.9)
        if b["request_rate"] >= 60:  # 1.5x the limit and more: marked (or stopped early, certain to fail), failing
            assert (b["saturation"]["saturated"] is True or b["stopped_early"]) and not b["meets_goodput_target"]
        if b["request_rate"] <= 32:  # 0.8x and less: kept up
            assert b["saturation"]["saturated"] is False
    sweep = {b["sweep_factor"]: b for b in run["results"] if b["phase"] == "sweep"}
    assert sorted(sweep) == [0.5, 1.5]
    assert sweep[0.5]["request_rate"] == pytest.approx(cap["capacity_rate"] * 0.5)
    assert sweep[0.5]["saturation"]["saturated"] is False
    assert sweep[1.5]["saturation"]["saturated"] is True
    assert arm["warmup"]["steady"] and arm["warmup"]["batches"] >= 2
    md = (out / "summary.md").read_text()
    assert f"| colo | {cap['capacity_rate']:.3f} |" in md and "**yes**" in md
    at_capacity = next(b for b in probes if b["request_rate"] == cap["capacity_rate"])
    assert ("upper bound" in md) == at_capacity["saturation"]["saturated"]
    assert (out / "goodput_vs_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the arm's server was stopped on the way out
    with pytest.raises(ClientError):
        Client(arm["base_url"], timeout_s=2).models()


def test_capacity_search_needs_slos_and_separate_runs(capsys):
    assert generator.main(["--capacity-search", "--out", "/tmp/unused"]) == 2
    assert "--goodput" in capsys.readouterr().err
    assert generator.main(["--capacity-search", "--goodput", "ttft:10", "--policy-runs", "interleaved"]) == 2
    assert generator.main(["--capacity-search", "--goodput", "ttft:10", "--request-rates", "1,2"]) == 2
