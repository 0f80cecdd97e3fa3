"""Worker processes that `pdserve` starts on this machine: their supervision and their clean end.

Each worker runs `python -m pdserve.workers.cli --worker-config <run dir>/workers/<id>.json`: the file (0600,
written once, read again by each restart) is its whole WorkerConfig, with our pid and our run
directory, without keys; `--keys` gives the key folder's path (never key material); --worker-arg
extras follow on the command line and apply on top. Each worker is in its own process group (so a terminal's Ctrl-C reaches only us, and
we stop the workers in order). A worker
dies with us however we end: we SIGTERM its group on exit, SIGKILL it after a grace period, and the
worker itself holds PR_SET_PDEATHSIG plus a parent-watch thread for the case we are SIGKILLed (it
then removes its /dev/shm pool and our run directory, and exits at once).

Supervision (`watch()`, on the event loop, from the moment pdserve is ready):
    a worker exits      its /dev/shm pool is removed at once; on_exit(worker id, pid, why) tells the
                        router, which drops it now (its requests fail at once, not at the heartbeat
                        timeout) and /health says "degraded" until it is back
    restart             after a backoff: RESTART_MIN_S, doubled for each death within STABLE_S of
                        its start, at most RESTART_MAX_S; the new process registers under the same
                        worker id and the router has the prefill workers shake hands with it anew
    --no-restart        a worker that exits stays gone
    errors              supervision survives any error of its own: a worker that cannot be started
                        (out of file descriptors, of memory) is retried with the same backoff and
                        trouble() names it for /health; an error of the loop itself is logged and the
                        loop goes on after RESTART_MIN_S
Workers are started from the event loop's thread (the main thread): PR_SET_PDEATHSIG fires when
the thread that forked a child ends, so a worker started from a helper thread would die with it.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from pdserve.settings.worker import EngineConfig, WorkerConfig, write_worker_config
from pdserve.protocol.enums import ROLES
from pdserve.protocol.shm import remove_pools

log = logging.getLogger("pdserve.launcher")

RESTART_MIN_S = 0.5  # the first restart of a worker waits this long
RESTART_MAX_S = 30.0  # the backoff doubles per quick death, up to this
STABLE_S = 30.0  # a worker up this long before it died starts its backoff from the bottom again
WATCH_S = 0.2  # how often the supervisor looks at its workers


def default_devices() -> list[str]:
    """Every visible GPU, or the CPU. A machine with no NVIDIA driver to be seen (no GPU under
    /proc/driver/nvidia, no WSL GPU device, no nvidia-smi) has the CPU only, known without importing
    torch (seconds the workers' start would wait for); elsewhere torch counts what CUDA can use
    (CUDA_VISIBLE_DEVICES, a CPU-only torch build)."""
    n = cuda_devices()
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def cuda_devices() -> int:
    """How many CUDA devices the workers will see (0 without importing torch where no driver is to be seen)."""
    if not (glob.glob("/proc/driver/nvidia/gpus/*") or os.path.exists("/dev/dxg") or shutil.which("nvidia-smi")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_problem(devices: list[str], flag: str = "--devices") -> str | None:
    """Why the workers could not start on `devices` (given by `flag`; checked before any starts), or None."""
    wanted = {d: int(i or 0) for d in devices for kind, _, i in [d.partition(":")] if kind == "cuda" and
              (i == "" or i.isdigit())}  # other spellings: refused by the worker config (plan)
    if not wanted:
        return None
    n = cuda_devices()
    missing = [d for d, i in wanted.items() if i >= n]
    if not missing:
        return None
    if n == 0:
        return (f"{flag} {','.join(missing)}: this machine has no CUDA GPU that torch can use; use {flag} cpu "
                "(or leave it out: every GPU, else the CPU)")
    return f"{flag} {','.join(missing)}: this machine has {n} CUDA GPU(s), cuda:0..cuda:{n - 1}; pick among them"


def plan_workers(counts: dict[str, int], devices: list[str], engine: EngineConfig, **shared) -> list[WorkerConfig]:
    """Workers in role order (prefill, decode, colocated), devices dealt round-robin: with two GPUs the
    prefill worker gets cuda:0 and the decode worker cuda:1. Each gets `engine` on its device and the
    WorkerConfig fields in `shared`; its id is <role>-<i>."""
    out = []
    for role in ROLES:
        for i in range(counts.get(role, 0)):
            device = devices[len(out) % len(devices)]
            out.append(WorkerConfig(role, replace(engine, device=device), worker_id=f"{role}-{i}", **shared))
    return out


class Launcher:
    def __init__(self, workers: list[WorkerConfig], keys_dir: str, run_dir: str, extra_args: Sequence[str] = (),
                 log_level: str = "INFO", restart: bool = True):
        self.specs = {w.worker_id: w for w in workers}
        self.keys_dir = keys_dir  # the worker key folder (0700, its secret file 0600): a path, never a key
        self.run_dir = run_dir  # pdserve's private one (0700): the workers' config files go here
        self.extra_args = list(extra_args)  # --worker-arg: flags for every worker, on top of its config
        self.log_level = log_level
        self.restart = restart
        self.procs: dict[str, subprocess.Popen] = {}  # worker id -> its current process
        self.started_at: dict[str, float] = {}
        self.restarts = 0
        self.stopping = False
        self._quick_deaths: dict[str, int] = {}  # worker id -> deaths in a row within STABLE_S of a start
        self._due: dict[str, float] = {}  # worker id -> time.monotonic() of its restart
        self._reported: set[int] = set()  # pids whose exit was reported
        self._trouble: dict[str, str] = {}  # worker id (or "supervision") -> why it is not running as it should

    def config_file(self, spec: WorkerConfig) -> str:
        return os.path.join(self.run_dir, "workers", f"{spec.worker_id}.json")

    def command(self, spec: WorkerConfig) -> list[str]:
        """The same for each start of the worker: a restart reads the same file."""
        return [sys.executable, "-m", "pdserve.workers.cli", "--worker-config", self.config_file(spec),
                "--keys", self.keys_dir, "--log-level", self.log_level, *self.extra_args]

    def start(self) -> None:
        os.makedirs(os.path.join(self.run_dir, "workers"), mode=0o700, exist_ok=True)
        for spec in self.specs.values():
            write_worker_config(spec, self.config_file(spec))
        for spec in self.specs.values():
            self._start(spec)

    def _start(self, spec: WorkerConfig) -> None:
        cmd = self.command(spec)
        log.info("starting %s: %s", spec.worker_id, " ".join(cmd))
        self.procs[spec.worker_id] = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        self.started_at[spec.worker_id] = time.monotonic()
        self._trouble.pop(spec.worker_id, None)

    def trouble(self) -> dict[str, str]:
        """Worker id (or "supervision") -> why supervision cannot keep it running now, e.g. a restart
        that failed; empty when all is well (the router's /health shows it)."""
        return dict(self._trouble)

    def exited(self) -> list[tuple[str, int, int]]:
        """Workers that exited since the last call: (worker id, pid, exit code; -N: killed by signal N).
        Their shared memory is removed now; with restarts on, each one's restart is scheduled."""
        out = []
        now = time.monotonic()
        for wid, p in self.procs.items():
            rc = p.poll()
            if rc is None or p.pid in self._reported:
                continue
            self._reported.add(p.pid)
            _remove_shared_memory(p.pid)
            out.append((wid, p.pid, rc))
            if self.restart and not self.stopping:
                self._schedule(wid, quick=now - self.started_at[wid] < STABLE_S)
        return out

    def _schedule(self, wid: str, quick: bool) -> None:
        deaths = self._quick_deaths.get(wid, 0) + 1 if quick else 1
        self._quick_deaths[wid] = deaths
        self._due[wid] = time.monotonic() + min(RESTART_MIN_S * 2 ** (deaths - 1), RESTART_MAX_S)

    def restart_due(self) -> list[str]:
        """Start again the workers whose backoff is over; their ids."""
        now = time.monotonic()
        due = [wid for wid, at in self._due.items() if at <= now and not self.stopping]
        started = []
        for wid in due:
            del self._due[wid]
            try:
                self._start(self.specs[wid])
            except Exception as e:  # EMFILE, ENOMEM, EAGAIN from fork: try again later, say so on /health
                self._trouble[wid] = f"cannot restart it: {type(e).__name__}: {e}; retrying"
                log.error("worker %s: %s", wid, self._trouble[wid])
                self._schedule(wid, quick=True)
                continue
            self.restarts += 1
            started.append(wid)
        return started

    async def watch(self, stop: asyncio.Event, on_exit) -> None:
        """Until `stop`: report each worker's exit to on_exit(worker id, pid, why) and restart it."""
        while not stop.is_set():
            try:
                self._watch_once(on_exit)
                self._trouble.pop("supervision", None)
            except Exception as e:  # never let supervision end: log, say so on /health, go on
                self._trouble["supervision"] = f"supervision failed: {type(e).__name__}: {e}; retrying"
                log.exception("supervision failed; retrying in %.1fs", RESTART_MIN_S)
                await asyncio.sleep(RESTART_MIN_S)
            await asyncio.sleep(WATCH_S)

    def _watch_once(self, on_exit) -> None:
        for wid, pid, rc in self.exited():
            why = f"its process (pid {pid}) " + (f"was killed by {_signal_name(-rc)}" if rc < 0
                                                 else f"exited with code {rc}")
            delay = self._due.get(wid)
            log.error("worker %s: %s; %s", wid, why, "restarting it in %.1fs" % (delay - time.monotonic())
                      if delay is not None else "not restarted (--no-restart)")
            on_exit(wid, pid, why)
        for wid in self.restart_due():
            log.warning("worker %s restarted (pid %d)", wid, self.procs[wid].pid)

    def pids(self) -> dict[str, int]:
        return {wid: p.pid for wid, p in self.procs.items()}

    def terminate(self) -> None:
        """SIGTERM every live worker's group now, without waiting (stop() waits); no more restarts."""
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker's process group, wait up to grace_s, SIGKILL what is left."""
        self.stopping = True
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped worker handles its SIGTERM only once it runs
        end = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d ignored SIGTERM for %.0fs; killing it", p.pid, grace_s)
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)  # stragglers in the group, even if the leader exited
            if p.poll() is None:
                p.wait()
            _remove_shared_memory(p.pid)

    def kill_now(self) -> None:
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session: the group id is the worker's pid
    except ProcessLookupError:
        pass  # the whole group is gone already


def _remove_shared_memory(pid: int) -> None:
    """A worker killed before it could close its KV pool leaves /dev/shm/pdserve-kv-<pid>-* behind
    (the CPU pool of the ipc transport); only this user's regular files go, and nothing raises."""
    for path in remove_pools(pid):
        log.info("removed %s left by worker pid %d", path, pid)
