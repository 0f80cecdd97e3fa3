"""Supervision in pdserve, and workers that die with it.

    a worker SIGKILLed   the router drops it at once (its request fails with worker_lost), /health counts
                         it missing, its /dev/shm pool is gone at once; it is restarted, registers again,
                         the prefill worker shakes hands with it anew and disaggregated requests work
    pdserve SIGKILLed    while a stream runs: every worker exits within 2 s, and nothing is left of the
                         run: no run directory (keys, register socket), no /dev/shm pool
    the backoff          Launcher alone, with a stand-in command: restarts after 0.5 s, doubled per quick
                         death; --no-restart: never
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.settings.worker import WorkerConfig
from pdserve.server import launcher as L
from test_server_harness import TINY, Pdserve, wait_gone

pytestmark = pytest.mark.timeout(300)


def shm_of(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"pdserve-kv-{pid}-*"))


def test_a_killed_worker_is_restarted_and_a_killed_pdserve_leaves_nothing():
    srv = Pdserve(*TINY, "--colocated-workers", "0", "--heartbeat-interval", "0.5").__enter__()
    try:
        h = srv.health()
        rundir = Path(h["register"].removeprefix("ipc://")).parent
        assert rundir.is_dir() and rundir.name.startswith("pdserve-")
        [decode] = [w for w in h["workers"] if w["role"] == "decode"]
        assert shm_of(decode["pid"]), "the ipc transport on CPU keeps the decode pool in /dev/shm"

        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "policy": "disaggregated", "stream": True}
        events = []
        for _, event in srv.stream("/v1/completions", body):
            events.append(event)
            if len(events) == 3:
                os.kill(decode["pid"], signal.SIGKILL)
                killed = time.monotonic()
        failed_after = time.monotonic() - killed
        assert events[-2]["error"]["code"] == "worker_lost", events[-2:]
        assert failed_after < 1.5, f"the request failed {failed_after:.1f}s after the kill"  # not at a heartbeat timeout
        h = srv.health()
        # its only decode worker gone, nothing can serve (no colocated worker here): 503 until it is back
        assert h["status"] == "unavailable" and h["missing"] == {"decode": 1}, h
        assert not shm_of(decode["pid"]), "the killed worker's /dev/shm pool outlived it"

        h = srv.wait_for(lambda h: h["status"] == "ok", timeout=90, what="the decode worker restarted")
        [again] = [w for w in h["workers"] if w["role"] == "decode"]
        assert again["id"] == decode["id"] and again["pid"] != decode["pid"]
        print(f"decode-0 back {time.monotonic() - killed:.1f}s after the kill")
        r = srv.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 4, "policy": "disaggregated"})
        assert r.status_code == 200 and r.json()["timings"]["worker"] == decode["id"], r.text
        assert "restarted (pid" in srv.log_text()

        # pdserve SIGKILLed mid-stream: no chance to clean up; the workers must do it, and at once
        pids = {w["id"]: w["pid"] for w in srv.health()["workers"]}
        decoding = threading.Event()

        def consume() -> None:
            with contextlib.suppress(httpx.HTTPError):  # cut when pdserve dies: that is the point
                for i, _ in enumerate(srv.stream("/v1/completions", body)):
                    if i == 2:  # tokens after the first come from the decode worker
                        decoding.set()

        stream = threading.Thread(target=consume, daemon=True)
        stream.start()
        assert decoding.wait(30), "the stream did not run"
        srv.proc.kill()
        gone_from = time.monotonic()
        left = wait_gone(pids.values(), 2.0)
        took = time.monotonic() - gone_from
        assert not left, f"workers {left} outlived a SIGKILLed pdserve by 2 s"
        print(f"every worker gone {took:.2f}s after pdserve was SIGKILLed")
        end = time.monotonic() + 0.2
        while rundir.exists() and time.monotonic() < end:
            time.sleep(0.01)
        assert not rundir.exists(), f"{rundir} outlived pdserve: {list(rundir.iterdir())}"
        assert not [p for pid in pids.values() for p in shm_of(pid)]
    finally:
        srv.kill()


class Stub(L.Launcher):
    """A Launcher whose workers are stand-ins that exit at once; it notes when each one started."""

    def command(self, spec: WorkerConfig) -> list[str]:
        return ["/bin/true"]

    def _start(self, spec: WorkerConfig) -> None:
        super()._start(spec)
        self.starts = getattr(self, "starts", []) + [time.monotonic()]


def run_watch(launcher: Stub, until, timeout_s: float) -> list[tuple[str, int, str]]:
    """Run the launcher's watch() until until() holds or timeout_s passed: the exits it reported."""
    import asyncio

    exits = []

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(launcher.watch(stop, lambda wid, pid, why: exits.append((wid, pid, why))))
        end = time.monotonic() + timeout_s
        while not until() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        stop.set()
        await task

    asyncio.run(main())
    return exits


def test_restarts_back_off_and_no_restart_means_none(tmp_path):
    spec = WorkerConfig("colocated", worker_id="colocated-0")
    quick = Stub([spec], "/nowhere", str(tmp_path / "quick"))
    quick.start()
    exits = run_watch(quick, lambda: quick.restarts == 3, 15.0)
    quick.stop(grace_s=1)
    assert quick.restarts == 3 and [wid for wid, _, _ in exits][:3] == ["colocated-0"] * 3, exits
    assert "exited with code 0" in exits[0][2]
    gaps = [b - a for a, b in zip(quick.starts, quick.starts[1:])]
    print(f"restarts {[round(g, 2) for g in gaps]} s apart")
    for gap, backoff in zip(gaps, (0.5, 1.0, 2.0)):  # each death within STABLE_S of its start doubles it
        assert backoff <= gap < backoff + 1.0, gaps

    off = Stub([spec], "/nowhere", str(tmp_path / "off"), restart=False)
    off.start()
    exits = run_watch(off, lambda: False, 1.5)
    off.stop(grace_s=1)
    assert len(exits) == 1 and off.restarts == 0 and len(off.starts) == 1
