"""Capacity probes that can fail: a probe lasts --probe-seconds of arrivals (or --probe-min-requests), and a
growing queue fails it. On a fake server of known capacity the search finds that capacity within its
precision; the old probe (24 prompts, judged on the SLO target alone) passes far past it."""

import json
import shlex
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.arms import READY
from pdserve.bench.load.early_stop import server_idle

pytestmark = pytest.mark.alone  # a fake server's latencies against SLOs: a neighbour's CPU burst reads as load

# one prefill at a time, 12.5 ms each on the fake's own clock: 80 req/s at most. A fast fake keeps
# the probes short: a 1 s probe at capacity holds 80 requests
CAPACITY = 80.0
SERVER = f"{sys.executable} -m pdserve.bench.load.fake_server --port 0 --itl-ms 1 --prefill-ms-per-token 0 " \
         "--prefill-ms-per-request 12.5"
# near-periodic arrivals (burstiness 50) keep the queue empty below capacity; by default a loose TTFT SLO (300 ms,
# 24 prefills) that a short burst past capacity still meets: only the window's length can expose the queue
COMMON = ["--policies", "colocated", "--capacity-search", "--search-start-rate", "24",
          "--search-precision", "0.1", "--input-len", "8", "--output-len", "2", "--burstiness", "50",
          "--warmup-batch", "2", "--sweep-factors", "", "--no-progress", "--no-plots"]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """One fake server for this file's searches (a server start each would cost more than a probe): each search
    finds it idle, warms it up, and leaves it idle (a probe stopped early settles until nothing is in flight)."""
    log = tmp_path_factory.mktemp("fake") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(shlex.split(SERVER), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (ready := READY.search(log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        yield ready.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _search(url: str, out, *flags, ttft_ms: int = 300) -> tuple[dict, list[dict]]:
    assert server_idle(httpx.get(f"{url}/health").json())
    assert generator.main(COMMON + ["--base-url", url, "--goodput", f"ttft:{ttft_ms}", "--out", str(out), *flags]) == 0
    run = json.loads((out / "results.json").read_text())
    # the probes as judged: a cold fail run again (a stall of this shared host can make a first quarter slow)
    # is judged by its second run
    judged = [b for b in run["results"] if b["phase"] == "probe" and not b.get("repeated_warm")]
    return run["arms"][0]["capacity"], judged


def test_long_probes_find_the_capacity_and_the_old_short_probe_does_not(fake, tmp_path):
    cap, probes = _search(fake, tmp_path / "long", "--probe-seconds", "1", "--probe-min-requests", "24",
                          "--search-max-probes", "7")
    assert cap["probe_judge"] == "goodput+queue" and cap["probe_seconds"] == 1.0
    assert cap["bracket"] == [cap["capacity_rate"], cap["first_failing_rate"]]
    assert cap["converged"], cap
    # the bracket holds the server's capacity, within the search's precision on either side
    assert CAPACITY / 1.25 <= cap["capacity_rate"] <= CAPACITY * 1.1
    assert cap["first_failing_rate"] <= CAPACITY * 1.25
    for p, b in zip(cap["probes"], probes):
        # every probe: >= 1 s of arrivals (rate x 1 requests) and >= 24 requests, its duration recorded
        stop = b["stopped_early"]
        assert p["requests"] == max(24, -(-p["rate"] * 1 // 1))
        assert b["num_prompts"] == (stop["sent"] if stop else p["requests"])
        assert p["arrivals_s"] == b["arrival_window_s"] and p["duration_s"] == b["duration"]
        # a probe stopped before its last arrival ends before its arrival window does; one that sent every
        # request first (the stop can come late on a loaded machine) ran the window out
        cut = stop and stop["sent"] < p["requests"]
        assert (p["duration_s"] < p["arrivals_s"]) if cut else (p["duration_s"] >= p["arrivals_s"]), (p, stop)
        if p["requests"] > 24:
            assert p["arrivals_s"] >= 0.9
        if p["rate"] >= CAPACITY * 1.2:  # past capacity the queue grows over the window: failed on it, or
            # stopped once so many requests had missed the TTFT SLO that the target could not be met
            assert not p["passed"] and (b["saturation"]["queue_growing"] or stop), b["saturation"]
        if p["rate"] <= CAPACITY * 0.7:
            assert p["passed"] and b["saturation"]["lateness_slope"] < 0.05

    # the old probe: 24 prompts whatever the rate, passed on the SLO target alone. At 192 req/s (2.4x the
    # capacity) its 24 requests arrive within 0.125 s and the last waits ~0.2 s: the 300 ms SLO still holds
    old, old_probes = _search(fake, tmp_path / "short", "--probe-seconds", "0", "--probe-min-requests", "24",
                              "--probe-judge", "goodput", "--search-max-probes", "5", "--no-probe-early-stop")
    assert all(p["requests"] == 24 for p in old["probes"])
    assert old["capacity_rate"] >= 1.5 * CAPACITY, old
    assert all(b["arrival_window_s"] < 0.5 for b in old_probes if b["request_rate"] >= CAPACITY)


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


def test_a_probe_past_capacity_stops_once_it_cannot_pass_and_the_verdict_is_the_whole_runs(fake, tmp_path):
    """At 2x the capacity the TTFT SLO (150 ms) is missed by every request once the queue passes 0.15 s: the
    probe stops when more than 10% of its planned requests have missed, long before its arrivals
    end, and says what it proved. The same probe run whole fails too: stopping changed the time, not the
    verdict. Below capacity nothing stops."""
    rate = 2 * CAPACITY
    flags = ["--probe-seconds", "1.5", "--probe-min-requests", "24", "--search-max-probes", "1",
             "--search-start-rate", str(rate)]
    cap, [stopped] = _search(fake, tmp_path / "stop", *flags, ttft_ms=150)
    stop = stopped["stopped_early"]
    assert stop and not cap["probes"][0]["passed"] and stopped["meets_goodput_target"] is False
    planned = cap["probes"][0]["requests"]
    assert stop["planned"] == planned == int(rate * 1.5) and stop["sent"] < planned
    assert stop["missed"] > 0.1 * planned and stop["goodput_fraction_at_most"] < 0.9
    assert stopped["goodput_fraction"] == stop["goodput_fraction_at_most"]
    assert stopped["duration"] < 0.7 * stopped["arrival_window_s"] and stop["settle_s"] is not None
    whole, [full] = _search(fake, tmp_path / "whole", *flags, "--no-probe-early-stop", ttft_ms=150)
    assert full["stopped_early"] is None and not whole["probes"][0]["passed"]
    assert full["num_prompts"] == planned and full["goodput_fraction"] < 0.9
    assert full["duration"] > stopped["duration"] + 1.0
    below, [kept] = _search(fake, tmp_path / "below", "--probe-seconds", "1", "--probe-min-requests", "24",
                            "--search-max-probes", "1", "--search-start-rate", str(CAPACITY / 2), ttft_ms=150)
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


# ---- the fake server these probes rely on: its capacity holds, and a dropped stream is not left in flight -------

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "scheme": "http",
         "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


async def _asgi(app, method: str, path: str, body: dict | None = None, on_send=None) -> list[dict]:
    """One request straight into the ASGI app, as uvicorn (ASGI 2.3) makes it; the messages the app sent.
    on_send(message, gone) may stall a send and set `gone` (the client left: receive() answers disconnect)."""
    import asyncio

    data = json.dumps(body).encode() if body is not None else b""
    gone, sent = asyncio.Event(), []
    pending = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if on_send is not None:
            await on_send(message, gone)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await asyncio.wait_for(app({**SCOPE, "method": method, "path": path, "raw_path": path.encode(),
                                "headers": headers}, receive, send), 10)
    return sent


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_fake_servers_capacity_holds_when_its_sleeps_wake_late(monkeypatch):
    """The probes above take the fake's capacity to be 1 / (prefill time). On a loaded machine every sleep wakes
    late; a prefill that started only when the event loop got round to it would add each lateness to the GPU's
    time, and the capacity would sink with the machine's load. Here every sleep wakes 20 ms late and six 50 ms
    prefills queue at once: after the first, each asks the loop for at most 30 ms (its 50 less the lateness that
    delayed its start), 200 ms in all where 300 would add the lateness up; each still takes its 50 ms."""
    import asyncio

    from pdserve.bench.load import fake_server

    asked: list[float] = []  # every sleep the fake asked for, in seconds

    class LateLoop:  # the fake's asyncio, whose every sleep wakes 20 ms late
        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(seconds: float) -> None:
            asked.append(seconds)
            await asyncio.sleep(seconds + 0.020)

    monkeypatch.setattr(fake_server, "asyncio", LateLoop())
    app = fake_server.make_app(fake_server.FakeConfig(prefill_ms_per_request=50, prefill_ms_per_token=0, itl_ms=0))

    async def six_at_once() -> list[dict]:
        sent = await asyncio.gather(*(_asgi(app, "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 1})
                                      for _ in range(6)))
        return [json.loads(_body(s))["timings"] for s in sent]

    timings = asyncio.run(six_at_once())
    assert all(t["prefill_ms"] >= 50 for t in timings), timings
    assert len(asked) == 2 * 6  # a prefill and a zero-length decode each (max_tokens 1, itl 0)
    assert sum(asked) <= 0.050 + 5 * 0.030 + 1e-6, asked  # 6 x 50 ms if the lateness added up


def test_a_stream_dropped_mid_send_leaves_the_fake_server_idle():
    """The early stop waits for the server's /health to show nothing in flight. A client that drops a stream
    while an event is being sent (its socket full) must not stay counted in the fake's in_flight until the
    garbage collector happens to run: on an idle server that can be never, and the probe's settle times out."""
    import asyncio
    import gc

    from pdserve.bench.load.fake_server import FakeConfig, make_app

    app = make_app(FakeConfig(itl_ms=1, prefill_ms_per_token=0))

    async def stalls_on_the_first_token(message, gone):
        # as uvicorn's send: the first token's waits on a full socket until the client is gone, by which time the
        # server has the second token waiting to be sent; once gone, every send returns at once, the bytes dropped
        if message["type"] == "http.response.body" and message.get("body") and not gone.is_set():
            await asyncio.sleep(0.05)
            gone.set()
            await asyncio.sleep(0.05)

    async def drop_then_ask():
        body = {"prompt": "a b", "max_tokens": 4, "stream": True}
        sent = await _asgi(app, "POST", "/v1/completions", body, stalls_on_the_first_token)
        assert b"tok0" in _body(sent)  # dropped after its first token
        return json.loads(_body(await _asgi(app, "GET", "/health")))

    gc.disable()  # the count must not wait on the collector
    try:
        health = asyncio.run(drop_then_ask())
    finally:
        gc.enable()
    assert health["workers"][0]["in_flight"] == 0, health
