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
        assert p["requests"] == b["num_prompts"] == max(24, -(-p["rate"] * 2 // 1))
        assert p["arrivals_s"] == b["arrival_window_s"] and p["duration_s"] == b["duration"] >= p["arrivals_s"]
        if p["requests"] > 24:
            assert p["arrivals_s"] >= 1.8
        if p["rate"] >= CAPACITY * 1.2:  # past capacity the queue grows over the window: failed on it
            assert not p["passed"] and b["saturation"]["queue_growing"], b["saturation"]
        if p["rate"] <= CAPACITY * 0.7:
            assert p["passed"] and b["saturation"]["lateness_slope"] < 0.05

    # the old probe: 24 prompts whatever the rate, passed on the SLO target alone. At 96 req/s (2.4x the
    # capacity) its 24 requests arrive within 0.25 s and the last waits ~0.35 s: the 500 ms SLO still holds
    old, old_probes = _search(tmp_path / "short", "--probe-seconds", "0", "--probe-min-requests", "24",
                              "--probe-judge", "goodput", "--search-max-probes", "5")
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
