"""`pdserve router` alone, with a worker started separately by `pdserve-worker` (as on another
machine) holding the worker keys of `pdserve keygen`: it registers, serves, and on SIGTERM says
goodbye so the router stops routing to it at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from test_server_harness import ROOT, Pdserve, wait_gone

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_router_alone_with_a_worker_started_elsewhere(tmp_path):
    keygen = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "keygen", str(tmp_path / "keys")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert keygen.returncode == 0, keygen.stderr
    register = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pdserve.server.cli", "router", "--model", "tiny", "--port", "0", "--register", register,
           "--heartbeat-interval", "2", "--keys", str(tmp_path / "keys" / "router")]
    with Pdserve(command=cmd) as srv:
        h = srv.get("/health")
        assert h.status_code == 503 and h.json()["workers"] == [] and register in h.json()["message"]
        r = srv.post("/v1/completions", {"prompt": "Hi"})
        assert r.status_code == 503 and "no colocated worker" in r.json()["error"]["message"]

        worker = subprocess.Popen([sys.executable, "-m", "pdserve.workers.cli", "--role", "colocated", "--model", "tiny",
                                   "--router", register, "--worker-id", "far-away", "--threads", "1",
                                   "--keys", str(tmp_path / "keys" / "worker"),
                                   "--num-blocks", "64", "--parent-pid", str(os.getpid())], cwd=ROOT)
        try:
            h = srv.wait_for(lambda h: h["status"] == "ok", timeout=120, what="the worker to register")
            [w] = h["workers"]
            assert (w["id"], w["role"], w["pid"], w["num_blocks"]) == ("far-away", "colocated", worker.pid, 64)
            r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["timings"]["worker"] == "far-away"
            worker.terminate()  # SIGTERM: Goodbye, no waiting for missed heartbeats
            start = time.monotonic()
            assert worker.wait(30) == 0
            srv.wait_for(lambda h: h["workers"] == [], timeout=0.5, what="the router to drop the worker on Goodbye")
            assert time.monotonic() - start < 3.0  # 3 missed heartbeats would take 6 s
        finally:
            if worker.poll() is None:
                worker.kill()
            assert not wait_gone([worker.pid], 10)
