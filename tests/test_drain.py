"""Graceful drain: SIGTERM during streams. New requests get 503 + Retry-After and /health says
"draining"; the streams in flight (colocated and disaggregated) complete; then pdserve and every
worker exit on their own (exit code 0, no SIGKILL, nothing left in /dev/shm). With a short
--drain-timeout, a stream still running is ended by an error event that says why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server_harness import ROOT, TINY, Pdserve, wait_gone

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
        streams = [Stream(srv.url, {"prompt": f"Story {i}: once upon a time", "max_tokens": 1200, "ignore_eos": True,
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
            assert s.events[-2]["usage"]["completion_tokens"] == 1200
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


STOPPING = """
import logging, signal, threading, time
import zmq
from pdserve.protocol import auth
from pdserve.workers.worker import Inbox, Worker

w = Worker.__new__(Worker)  # only what stop() and the main loop's wait touch
w._stop = threading.Event()
w.inbox = Inbox(zmq.Context(), "tcp://127.0.0.1:0", None, None, auth.Throttle(logging.getLogger()))
w.inbox.start()

def on_signal(signum, frame):
    w.stop("signal SIGTERM")
    time.sleep(0.2)  # a handler slower than the loop's 50 ms wait, as on a loaded machine

signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
while not w._stop.is_set():
    w.inbox.take(0.05)  # the worker's main loop, idle
print("stopped", flush=True)
"""


def test_a_sigterm_whose_handler_outlasts_the_loops_wait_still_stops_the_loop():
    """The drain test's worker that held out 10 s after SIGTERM: its main thread waits in
    SimpleQueue.get(timeout); in CPython 3.11, a signal handler that runs past that timeout leaves it
    waiting forever (until the next control frame, and none comes after SIGTERM). stop() wakes it."""
    p = subprocess.Popen([sys.executable, "-c", STOPPING], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)  # hung, it would wait forever
        assert p.stdout.read().strip() == "stopped"
    finally:
        p.kill()
