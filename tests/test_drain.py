"""Graceful drain: SIGTERM during streams. New requests get 503 + Retry-After and /health says
"draining"; the streams in flight (colocated and disaggregated) complete; then pdserve and every
worker exit on their own (exit code 0, no SIGKILL, nothing left in /dev/shm). With a short
--drain-timeout, a stream still running is ended by an error event that says why."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server_harness import TINY, Pdserve, wait_gone

pytestmark = pytest.mark.timeout(300)


class Stream(threading.Thread):
    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.started = threading.Event()  # the first tokens are here
        self.ended_at: float | None = None

    def run(self) -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", self.url + "/v1/completions", json=self.body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    if len(self.events) >= 3:
                        self.started.set()
        self.ended_at = time.monotonic()
        self.started.set()


def sigterm(srv: Pdserve) -> tuple[float, dict]:
    """SIGTERM pdserve: (when, its workers' pids)."""
    pids = dict(srv._pids)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    return start, pids


def assert_clean_exit(srv: Pdserve, pids: dict, start: float, within: float) -> float:
    """pdserve exits 0 within `within` s of `start`, every worker on its own (none SIGKILLed)."""
    srv.proc.wait(timeout=within + 30)
    took = time.monotonic() - start
    log = srv.log_text()
    assert srv.proc.returncode == 0, log[-4000:]
    assert not wait_gone(pids.values(), 5.0), f"workers outlived pdserve\n{log[-4000:]}"
    assert "ignored SIGTERM" not in log, log[-4000:]  # every worker exited on its own
    assert not [p for pid in pids.values() for p in Path("/dev/shm").glob(f"pdserve-kv-{pid}-*")]
    assert took < within, f"pdserve took {took:.1f}s to exit"
    return took


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_requests():
    with Pdserve(*TINY, "--drain-timeout", "60", "--retry-after", "4") as srv:
        streams = [Stream(srv.url, {"prompt": f"Story {i}: once upon a time", "max_tokens": 300, "ignore_eos": True,
                                    "stream": True, "policy": policy})
                   for i, policy in enumerate(["colocated", "disaggregated", "colocated", "disaggregated"])]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60)
        assert all(s.ended_at is None for s in streams), "the streams ended before SIGTERM: make them longer"
        start, pids = sigterm(srv)
        time.sleep(0.2)  # the signal is handled
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "4", r.text
        assert r.json()["error"]["code"] == "shutting_down" and "shutting down" in r.json()["error"]["message"]
        h = httpx.get(srv.url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        assert any(s.ended_at is None for s in streams), "every stream ended before the probe: make them longer"
        for s in streams:
            s.join(60)
        for s in streams:
            assert s.events[-1] == "[DONE]" and "error" not in s.events[-2], s.events[-2:]
            assert s.events[-2]["choices"][0]["finish_reason"] == "length", s.events[-2]
            assert s.events[-2]["usage"]["completion_tokens"] == 300
        took = assert_clean_exit(srv, pids, start, 60)
        last = max(s.ended_at for s in streams) - start
        print(f"streams done {last:.1f}s after SIGTERM, pdserve exited after {took:.1f}s")


def test_streams_past_the_drain_timeout_end_with_an_error_that_says_so():
    timeout = 1.0
    with Pdserve(*TINY, "--drain-timeout", str(timeout)) as srv:
        streams = [Stream(srv.url, {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                                    "policy": policy}) for policy in ("colocated", "disaggregated")]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60)
        start, pids = sigterm(srv)
        for s in streams:
            s.join(30)
            assert s.ended_at is not None and s.ended_at - start < timeout + 2.0, "not cut at the drain timeout"
            assert s.events[-1] == "[DONE]"
            err = s.events[-2]["error"]
            assert err["code"] == "shutting_down" and "--drain-timeout" in err["message"], err
            assert len(s.events) < 1000
        # the workers were told to abort, then stopped: every one (prefill too) exits on its own
        assert_clean_exit(srv, pids, start, timeout + 15)
