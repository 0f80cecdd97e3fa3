"""A bounded junk flood on a live router's register socket (`pdserve router`, CURVE keys from
`pdserve keygen`; tests/flood_peer.py in a process of its own): raw TCP garbage, plain ZMQ junk,
connections with a wrong key, and, holding the valid worker key, junk frames and heartbeats of
5,000 unknown worker ids.

During the flood and right after it: /health answers within 1 s every time; a worker that stops
heartbeating mid-flood is dropped within its heartbeat deadline (plus the sweep's period and some
slack), a steady worker is never dropped; the router's log grows by a few lines, not one per frame;
its open file descriptors and memory stay bounded; the flood shows in pdserve_control_dropped.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_server_harness import ROOT, Pdserve
from test_server_router import FakeWorker
from pdserve.settings.keys import keygen, load_worker_keys

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]

HEARTBEAT_S, MISSES = 0.25, 3
DEADLINE_S = HEARTBEAT_S * MISSES
FLOOD_S = 4.0
STOP_AFTER_S = 1.0  # into the flood, one worker falls silent
SLACK_S = 0.75  # the sweep runs every interval / 4; the rest is a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_junk_flood_leaves_health_and_liveness_responsive(tmp_path):
    router_dir, worker_dir = keygen(tmp_path / "keys")
    keys = load_worker_keys(worker_dir)
    register = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pdserve.server.cli", "router", "--model", "tiny", "--port", "0", "--register", register,
           "--keys", str(router_dir), "--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES)]
    with Pdserve(command=cmd) as srv:
        pid = srv.proc.pid
        steady = FakeWorker(register, "colocated", "steady", keys=keys)
        stops = FakeWorker(register, "colocated", "stops", keys=keys)
        for w in (steady, stops):
            w.start()
        try:
            assert steady.registered.wait(10) and stops.registered.wait(10)
            srv.wait_for(lambda h: len(h["workers"]) == 2, timeout=5, what="both fake workers")
            time.sleep(1.0)
            fds_before, rss_before, log_before = fds(pid), rss_mb(pid), len(srv.log_text().splitlines())

            flood = subprocess.Popen([sys.executable, str(ROOT / "tests" / "flood_peer.py"), register,
                                      str(worker_dir), str(FLOOD_S)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            start = time.monotonic()
            silenced = threading.Timer(STOP_AFTER_S, stops.silent.set)
            silenced.start()
            slowest, dropped_after, peak_fds, seen_steady_gone = 0.0, None, fds_before, False
            while flood.poll() is None or time.monotonic() - start < FLOOD_S + 1.0:
                t0 = time.monotonic()
                h = srv.health()
                slowest = max(slowest, time.monotonic() - t0)
                ids = {w["id"] for w in h["workers"]}
                seen_steady_gone |= "steady" not in ids
                if dropped_after is None and "stops" not in ids and stops.silent.is_set():
                    dropped_after = time.monotonic() - start - STOP_AFTER_S
                peak_fds = max(peak_fds, fds(pid))
                time.sleep(0.05)
            sent = json.loads(flood.stdout.read().strip().splitlines()[-1])
            flood.wait(10)
            time.sleep(2.0)  # the short-lived answer sockets linger 0.5 s
            t0 = time.monotonic()
            h = srv.health()
            after_s = time.monotonic() - t0
            metrics = srv.get("/metrics").text
            log_lines = srv.log_text().splitlines()[log_before:]
            fds_after, rss_after = fds(pid), rss_mb(pid)
        finally:
            for w in (steady, stops):
                w.stopped.set()
                w.join(5)

    shown = f"sent {sent}; health slowest {slowest:.3f}s; log:\n" + "\n".join(log_lines[-40:])
    assert sent["keyed_junk"] > 1000 and sent["keyed_unknown_heartbeats"] > 1000, shown  # the flood was real
    assert sent["raw_tcp_connections"] > 50 and sent["wrong_key_connections"] > 50, shown
    assert slowest < 1.0 and after_s < 1.0, shown
    assert not seen_steady_gone and [w["id"] for w in h["workers"]] == ["steady"], shown
    assert dropped_after is not None and dropped_after <= DEADLINE_S + SLACK_S, f"dropped after {dropped_after}; {shown}"
    assert len(log_lines) <= 40, shown  # per kind of event one line at once, then one per 10 s
    for reason in ("junk", "rate_limited"):
        assert f'pdserve_control_dropped_total{{reason="{reason}"}}' in metrics, metrics
    assert peak_fds <= fds_before + 200 and fds_after <= fds_before + 20, (fds_before, peak_fds, fds_after)
    assert rss_after <= rss_before * 1.2 + 20, (rss_before, rss_after)
