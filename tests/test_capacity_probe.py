"""Capacity probes that can fail: a probe lasts --probe-seconds of arrivals (or --probe-min-requests), and a
growing queue fails it. On a fake server of known capacity the search finds that capacity within its
precision; the old probe (24 prompts, judged on the SLO target alone) passes far past it."""

import json
import sys

from pdserve.bench.load import generator

# one prefill at a time, 25 ms each: at most 40 req/s (a little less: each sleep overshoots)
CAPACITY = 40.0
SERVER = f"{sys.executable} -m pdserve.bench.load.fake_server --port 0 --itl-ms 1 --prefill-ms-per-token 0 " \
         "--prefill-ms-per-request 25"
# near-periodic arrivals (burstiness 50) keep the queue empty below capacity; a loose TTFT SLO (500 ms) that
# a short burst past capacity still meets: only the window's length can expose the queue
COMMON = ["--arm", "colo=colocated:", "--server-command", SERVER, "--capacity-search", "--search-start-rate", "12",
          "--search-precision", "0.1", "--input-len", "8", "--output-len", "2", "--burstiness", "50",
          "--goodput", "ttft:500", "--warmup-batch", "2", "--sweep-factors", "", "--no-progress", "--no-plots"]


def _search(out, *flags) -> tuple[dict, list[dict]]:
    assert generator.main(COMMON + ["--out", str(out), *flags]) == 0
    run = json.loads((out / "results.json").read_text())
    return run["arms"][0]["capacity"], [b for b in run["results"] if b["phase"] == "probe"]


def test_long_probes_find_the_capacity_and_the_old_short_probe_does_not(tmp_path):
    cap, probes = _search(tmp_path / "long", "--probe-seconds", "2", "--probe-min-requests", "24",
                          "--search-max-probes", "7")
    assert cap["probe_judge"] == "goodput+queue" and cap["probe_seconds"] == 2.0
    assert cap["bracket"] == [cap["capacity_rate"], cap["first_failing_rate"]]
    assert cap["converged"], cap
    # the bracket holds the server's capacity, within the search's precision on either side
    assert CAPACITY / 1.25 <= cap["capacity_rate"] <= CAPACITY * 1.1
    assert cap["first_failing_rate"] <= CAPACITY * 1.25
    for p, b in zip(cap["probes"], probes):
        # every probe: >= 2 s of arrivals (rate x 2 requests) and >= 24 requests, its duration recorded
        stop = b["stopped_early"]
        assert p["requests"] == max(24, -(-p["rate"] * 2 // 1))
        assert b["num_prompts"] == (stop["sent"] if stop else p["requests"])
        assert p["arrivals_s"] == b["arrival_window_s"] and p["duration_s"] == b["duration"]
        # a probe stopped before its last arrival ends before its arrival window does; one that sent every
        # request first (the stop can come late on a loaded machine) ran the window out
        cut = stop and stop["sent"] < p["requests"]
        assert (p["duration_s"] < p["arrivals_s"]) if cut else (p["duration_s"] >= p["arrivals_s"]), (p, stop)
        if p["requests"] > 24:
            assert p["arrivals_s"] >= 1.8
        if p["rate"] >= CAPACITY * 1.2:  # past capacity the queue grows over the window: failed on it, or
            # stopped once so many requests had missed the TTFT SLO that the target could not be met
            assert not p["passed"] and (b["saturation"]["queue_growing"] or stop), b["saturation"]
        if p["rate"] <= CAPACITY * 0.7:
            assert p["passed"] and b["saturation"]["lateness_slope"] < 0.05

    # the old probe: 24 prompts whatever the rate, passed on the SLO target alone. At 96 req/s (2.4x the
    # capacity) its 24 requests arrive within 0.25 s and the last waits ~0.35 s: the 500 ms SLO still holds
    old, old_probes = _search(tmp_path / "short", "--probe-seconds", "0", "--probe-min-requests", "24",
                              "--probe-judge", "goodput", "--search-max-probes", "5", "--no-probe-early-stop")
    assert all(p["requests"] == 24 for p in old["probes"])
    assert old["capacity_rate"] >= 1.5 * CAPACITY, old
    assert all(b["arrival_window_s"] < 1.0 for b in old_probes if b["request_rate"] >= CAPACITY)


def test_probe_flags_are_checked(capsys):
    assert generator.main(["--capacity-search", "--goodput", "ttft:10", "--probe-seconds", "-1"]) == 2
    assert "--probe-seconds" in capsys.readouterr().err
    assert generator.main(["--capacity-search", "--goodput", "ttft:10", "--probe-min-requests", "0"]) == 2


def test_a_probe_that_would_not_end_within_the_budget_does_not_start():
    """probe_requests sizes each probe; fits(rate) (the arm's budget left against the probe's window) stops the
    search before a probe that would overrun it; the first probe always runs."""
    import asyncio

    from pdserve.bench.load.capacity import probe_passes, probe_requests, search_capacity

    assert probe_requests(0.5, 60, 24) == 30 and probe_requests(0.1, 60, 24) == 24 and probe_requests(8, 0, 24) == 24
    budget_s, seen = 200.0, []

    async def probe(rate: float) -> bool:
        seen.append(rate)
        return rate < 100

    def window(rate: float) -> float:
        return probe_requests(rate, 60, 24) / rate

    cap = asyncio.run(search_capacity(probe, 1.0, max_probes=10,
                                      fits=lambda rate: sum(map(window, seen)) + window(rate) <= budget_s))
    assert seen == [1.0, 2.0, 4.0] and cap.out_of_time and cap.first_fail is None  # a fourth would end at 240 s
    sat = {"queue_growing": True}
    assert not probe_passes({"goodput_fraction": 1.0, "saturation": sat}, 0.9)
    assert probe_passes({"goodput_fraction": 1.0, "saturation": sat}, 0.9, queue=False)
    assert not probe_passes({"goodput_fraction": 0.8, "saturation": None}, 0.9, queue=False)


def test_a_probe_past_capacity_stops_once_it_cannot_pass_and_the_verdict_is_the_whole_runs(tmp_path):
    """At 2x the capacity the TTFT SLO (500 ms) is missed by every request once the queue passes half a
    second: the probe stops when more than 10% of its planned requests have missed, long before its arrivals
    end, and says what it proved. The same probe run whole fails too: stopping changed the time, not the
    verdict. Below capacity nothing stops."""
    rate = 2 * CAPACITY
    flags = ["--probe-seconds", "3", "--probe-min-requests", "24", "--search-max-probes", "1",
             "--search-start-rate", str(rate)]
    cap, [stopped] = _search(tmp_path / "stop", *flags)
    stop = stopped["stopped_early"]
    assert stop and not cap["probes"][0]["passed"] and stopped["meets_goodput_target"] is False
    planned = cap["probes"][0]["requests"]
    assert stop["planned"] == planned == int(rate * 3) and stop["sent"] < planned
    assert stop["missed"] > 0.1 * planned and stop["goodput_fraction_at_most"] < 0.9
    assert stopped["goodput_fraction"] == stop["goodput_fraction_at_most"]
    assert stopped["duration"] < 0.7 * stopped["arrival_window_s"] and stop["settle_s"] is not None
    whole, [full] = _search(tmp_path / "whole", *flags, "--no-probe-early-stop")
    assert full["stopped_early"] is None and not whole["probes"][0]["passed"]
    assert full["num_prompts"] == planned and full["goodput_fraction"] < 0.9
    assert full["duration"] > stopped["duration"] + 1.0
    below, [kept] = _search(tmp_path / "below", "--probe-seconds", "2", "--probe-min-requests", "24",
                            "--search-max-probes", "1", "--search-start-rate", str(CAPACITY / 2))
    assert kept["stopped_early"] is None and below["probes"][0]["passed"] and kept["num_prompts"] == 40


def test_early_stop_counts_only_certain_misses():
    """A miss is certain for TTFT past its limit with no token, for TPOT once the decode so far exceeds
    limit x (max_tokens - 1), for E2E past its limit; the run fails once planned - missed < target x planned."""
    from pdserve.bench.load.early_stop import EarlyStop, server_idle
    from pdserve.bench.load.metrics import RequestRecord

    w = EarlyStop({"ttft": 500.0, "tpot": 100.0}, 0.9, planned=20)
    w.started(0, now=0.0, max_tokens=11)  # no token yet
    assert w.missed(0.49) == 0 and w.missed(0.51) == 1
    w.started(1, now=0.0, max_tokens=11)
    w.first_token(1, 0.1)  # TPOT 100 ms x 10 gaps: certain past 1.0 s of decode, not before
    assert w.missed(1.09) == 1 and w.missed(1.11) == 2
    assert not w.certain_fail(1.11)  # 18 of 20 can still meet: 0.9 x 20
    w.ended(RequestRecord(index=2, policy=None, prompt_len=1, expected_output_len=1, success=False, error="x"))
    assert w.missed(1.11) == 3 and w.certain_fail(1.11)
    w.stop(1.11, 0.0, sent=3)
    assert w.to_dict()["goodput_fraction_at_most"] == 17 / 20 and w.to_dict()["reason"].startswith("3 of 20 planned")
    e = EarlyStop({"e2el": 1000.0}, 0.5, planned=2)
    e.started(0, now=0.0, max_tokens=4)
    e.first_token(0, 0.2)
    assert e.missed(0.9) == 0 and e.missed(1.01) == 1 and not e.certain_fail(1.01)
    assert server_idle({"workers": [{"in_flight": 0, "running": 0, "queue_depth": 0}]})
    assert not server_idle({"workers": [{"in_flight": 0}, {"running": 2}]})
