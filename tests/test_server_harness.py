"""Start `pdserve` as a real subprocess for the serving tests, and check it leaves nothing behind.

    with Pdserve("--model", "tiny") as srv:      # waits for the "pdserve ready: <url>" line
        srv.post("/v1/completions", {...})
        srv.worker_pids()                        # from GET /health
    # on exit: SIGTERM, wait, then assert every worker process is gone

The tests in this file check the harness's own promises: the ready line, and no orphans after
SIGTERM or after the router is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--model", "tiny", "--threads", "1", "--num-blocks", "512")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < end:
        left = [p for p in left if pid_alive(p)]
        time.sleep(0.05)
    return left


class Pdserve:
    def __init__(self, *args: str, command: list[str] | None = None, startup_timeout: float = 300.0,
                 env: dict | None = None):
        self.command = command or [sys.executable, "-m", "pdserve.server.cli", "--port", "0", *args]
        self.startup_timeout = startup_timeout
        # CPU even on a GPU machine: the oracles (transformers on the CPU, float32) and the timings
        # these tests check are the CPU ones; deploy/check.py is the GPU check
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.stdout: list[str] = []
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-test-", suffix=".log", delete=False)
        self.http = httpx.Client(timeout=120.0)
        self._pids: dict[str, int] = {}

    def __enter__(self) -> "Pdserve":
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + self.startup_timeout
        while self.url is None:
            if time.monotonic() > end:
                self._fail(f"no ready line within {self.startup_timeout:.0f}s")
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._fail(f"pdserve exited with code {self.proc.returncode} before it was ready")
                continue
            if line.startswith("pdserve ready:") or line.startswith("pdserve router ready:"):
                self.url = line.split("ready:")[1].split()[0]
        self._pids = self.worker_pids()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(keep_log=exc_type is not None)  # a failing test keeps its log to look into

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line.strip())

    def _fail(self, why: str):
        text = self.log_text()
        self.kill(keep_log=True)
        pytest.fail(f"{why} (log: {self.log.name})\n--- pdserve log ---\n{text[-6000:]}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    # ---- HTTP ---------------------------------------------------------------------------------------

    def get(self, path: str) -> httpx.Response:
        return self.http.get(self.url + path)

    def post(self, path: str, body, **kw) -> httpx.Response:
        if isinstance(body, (dict, list)):
            return self.http.post(self.url + path, json=body, **kw)
        return self.http.post(self.url + path, content=body, headers={"content-type": "application/json"}, **kw)

    def stream(self, path: str, body: dict):
        """Yield (seconds since the request was sent, event payload as dict or "[DONE]")."""
        start = time.perf_counter()
        with self.http.stream("POST", self.url + path, json=body) as r:
            assert r.status_code == 200, r.read().decode()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    yield time.perf_counter() - start, payload if payload == "[DONE]" else json.loads(payload)

    def health(self) -> dict:
        return self.get("/health").json()

    def worker_pids(self) -> dict[str, int]:
        return {w["id"]: w["pid"] for w in self.health()["workers"]}

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = self.health()
            if predicate(h):
                return h
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last /health: {json.dumps(self.health())}")

    # ---- ending -------------------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0, keep_log: bool = False) -> None:
        """SIGTERM pdserve; assert it and every worker it started exit. The log goes unless `keep_log` or
        an assertion here fails."""
        if self.proc is None or self.proc.poll() is not None:  # the test stopped it (and checked how) itself
            self._close()
            if not keep_log:
                Path(self.log.name).unlink(missing_ok=True)
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pdserve ignored SIGTERM for {timeout}s\n{self.log_text()[-4000:]}")
        left = wait_gone(self._pids.values(), 10.0)
        assert not left, f"worker processes {left} outlived pdserve\n{self.log_text()[-4000:]}"
        assert self.proc.returncode == 0, f"pdserve exit code {self.proc.returncode}\n{self.log_text()[-4000:]}"
        leaked = [p for pid in self._pids.values() for p in Path("/dev/shm").glob(f"pdserve-kv-{pid}-*")]
        assert not leaked, f"KV pools left in shared memory: {leaked}"
        self._close()
        if not keep_log:
            Path(self.log.name).unlink()

    def kill(self, keep_log: bool = False) -> None:
        """SIGKILL pdserve and (as a safety net for the test run) its workers, by pid; its log goes unless
        `keep_log` (a failure to look into)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self._pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._close()
        if not keep_log:
            Path(self.log.name).unlink(missing_ok=True)

    def _close(self) -> None:
        self.http.close()
        self.log.close()


def test_ready_line_health_and_no_orphans_after_sigkill():
    """Every other serving test ends with SIGTERM (Pdserve.stop asserts a clean exit and no orphans).
    Here the router is SIGKILLed, leaving it no chance to clean up: PR_SET_PDEATHSIG and the workers'
    parent-watch must end them, and the launcher's /dev/shm files must not pile up."""
    srv = Pdserve(*TINY, "--prefill-workers", "0", "--decode-workers", "0").__enter__()
    try:
        h = srv.health()
        assert h["status"] == "ok" and h["model"] == "tiny"
        assert [w["role"] for w in h["workers"]] == ["colocated"]
        r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        pids = srv.worker_pids()
        srv.proc.kill()
        srv.proc.wait()
        left = wait_gone(pids.values(), 15.0)
    finally:
        srv.kill()
    assert not left, f"workers {left} outlived a SIGKILLed pdserve"
