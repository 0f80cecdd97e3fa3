"""Worker processes that `pdserve` starts on this machine, and their clean end.

Each worker runs `python -m workers.cli --role ... --parent-pid <ours>` in its own process group
(so a terminal's Ctrl-C reaches only us, and we stop the workers in order). A worker dies with us
however we end: we SIGTERM its group on exit, SIGKILL it after a grace period, and the worker
itself holds PR_SET_PDEATHSIG plus a parent-watch thread for the case we are SIGKILLed.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.launcher")

ROLE_ORDER = ("prefill", "decode", "colocated")


@dataclass
class WorkerSpec:
    role: str
    worker_id: str
    device: str
    args: list[str] = field(default_factory=list)  # everything after --role/--device/--worker-id


def default_devices() -> list[str]:
    """Every visible GPU, or the CPU."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def plan_workers(counts: dict[str, int], devices: list[str], common: list[str]) -> list[WorkerSpec]:
    """Workers in role order (prefill, decode, colocated), devices dealt round-robin: with two GPUs the
    prefill worker gets cuda:0 and the decode worker cuda:1."""
    specs = []
    for role in ROLE_ORDER:
        for i in range(counts.get(role, 0)):
            device = devices[len(specs) % len(devices)]
            specs.append(WorkerSpec(role, f"{role}-{i}", device, list(common)))
    return specs


class Launcher:
    def __init__(self, specs: list[WorkerSpec], router_endpoint: str, keys_dir: str):
        self.specs = specs
        self.router_endpoint = router_endpoint
        self.keys_dir = keys_dir  # the worker key folder (0700, its secret file 0600): a path, never a key
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()

    def command(self, spec: WorkerSpec) -> list[str]:
        return [sys.executable, "-m", "workers.cli", "--role", spec.role, "--device", spec.device,
                "--worker-id", spec.worker_id, "--router", self.router_endpoint, "--keys", self.keys_dir,
                "--parent-pid", str(os.getpid()), *spec.args]

    def start(self) -> None:
        for spec in self.specs:
            cmd = self.command(spec)
            log.info("starting %s: %s", spec.worker_id, " ".join(cmd))
            self.procs[spec.worker_id] = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)

    def exited(self) -> list[tuple[str, int]]:
        """Workers that exited since the last call: (worker id, exit code)."""
        out = []
        for wid, p in self.procs.items():
            rc = p.poll()
            if rc is not None and wid not in self.reported:
                self.reported.add(wid)
                out.append((wid, rc))
        return out

    def pids(self) -> dict[str, int]:
        return {wid: p.pid for wid, p in self.procs.items()}

    def terminate(self) -> None:
        """SIGTERM every live worker's group now, without waiting (stop() waits)."""
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker's process group, wait up to grace_s, SIGKILL what is left."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
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


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session: the group id is the worker's pid
    except ProcessLookupError:
        pass  # the whole group is gone already


def _remove_shared_memory(pid: int) -> None:
    """A worker killed before it could close its KV pool leaves /dev/shm/pdserve-kv-<pid>-* behind
    (the CPU pool of the ipc transport, see workers/engine/kv_cache.py)."""
    for path in glob.glob(f"/dev/shm/pdserve-kv-{pid}-*"):
        try:
            os.unlink(path)
            log.info("removed %s left by worker pid %d", path, pid)
        except FileNotFoundError:
            pass
