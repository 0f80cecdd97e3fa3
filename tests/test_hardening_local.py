"""Another local user against pdserve's shared names (issue 28): /dev/shm is everyone's, so anyone may
create `pdserve-kv-*` names there. Workers still start (their pool made O_EXCL, 0600), the sweeps touch
only this user's regular files and never raise, and supervision survives a name planted under a live
worker's pid, a worker it cannot start again, and errors of its own, which /health then names."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from pathlib import Path

import pytest

from pdserve.settings.worker import EngineConfig, WorkerConfig
from pdserve.protocol.shm import SHM_PREFIX, remove_pools
from pdserve.server import launcher as L
from test_server_router import colocated_echo, router, tokenizer  # noqa: F401  (tokenizer: a fixture)

pytestmark = pytest.mark.timeout(60)

DEAD_PID = 4_000_000  # above the default pid_max: no process has it
FOREIGN_UID = 65534  # nobody


def planted(tmp_names: list[Path], name: str, kind: str, owner: int | None = None) -> Path:
    path = Path(f"{SHM_PREFIX}{name}")
    if kind == "dir":
        path.mkdir()
    else:
        path.write_bytes(b"x" * 64)
    if owner is not None:
        os.chown(path, owner, owner)
    tmp_names.append(path)
    return path


@pytest.fixture
def names():
    made: list[Path] = []
    yield made
    for p in made:
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        elif p.exists() or p.is_symlink():
            p.unlink()


def test_planted_names_never_keep_a_worker_from_starting(names):
    from pdserve.workers.engine.kv_cache import KVCache, KVLayout

    tag = uuid.uuid4().hex[:8]
    huge = planted(names, f"99999999999999-{tag}", "file")  # a pid past a C int
    dead_dir = planted(names, f"{DEAD_PID}-{tag}", "dir")  # a directory named after a dead pid
    ours_dead = planted(names, f"{DEAD_PID + 1}-{tag}", "file")  # a pool of ours whose process is gone
    foreign = planted(names, f"{DEAD_PID + 2}-{tag}", "file", FOREIGN_UID if os.geteuid() == 0 else None)
    link = Path(f"{SHM_PREFIX}{DEAD_PID + 3}-{tag}")
    link.symlink_to("/etc/hostname")
    names.append(link)
    kv = KVCache(KVLayout(2, 2, 8, "float32", 16, 8), "cpu", shared=True)  # sweeps first, then makes its pool
    try:
        mode = os.stat(kv.shm_path, follow_symlinks=False).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
    finally:
        kv.close()
    assert huge.exists() and dead_dir.is_dir() and link.is_symlink() and Path("/etc/hostname").exists()
    assert not ours_dead.exists()  # the one thing the sweep may remove: ours, regular, its process gone
    if os.geteuid() == 0:
        assert foreign.exists(), "another user's file was removed"
    assert remove_pools(DEAD_PID) == [] and dead_dir.is_dir()  # a pid's sweep: never a directory


class StandIn(L.Launcher):
    """A Launcher whose workers are stand-ins that exit after a moment (or, `broken`, cannot be started)."""

    broken = False

    def command(self, spec: WorkerConfig) -> list[str]:
        return ["/nonexistent/pdserve-worker"] if self.broken else ["/bin/sleep", "0.3"]


def specs() -> list[WorkerConfig]:
    return [WorkerConfig("colocated", EngineConfig(model="tiny", device="cpu"), worker_id="colocated-0",
                         router="tcp://127.0.0.1:1")]


async def supervise(launcher: L.Launcher, seconds: float, on_exit=lambda *a: None) -> asyncio.Task:
    stop = asyncio.Event()
    task = asyncio.create_task(launcher.watch(stop, on_exit))
    await asyncio.sleep(seconds)
    alive = not task.done()
    stop.set()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    return alive, task


def test_a_directory_planted_under_a_live_workers_pid_does_not_end_supervision(tmp_path, names):
    launcher = StandIn(specs(), str(tmp_path / "keys"), str(tmp_path / "run"))
    launcher.start()
    pid = launcher.pids()["colocated-0"]
    trap = planted(names, f"{pid}-{uuid.uuid4().hex[:8]}", "dir")
    exits = []
    alive, task = asyncio.run(supervise(launcher, 1.5, lambda *a: exits.append(a)))
    launcher.stop(grace_s=2)
    assert alive, f"supervision ended: {task.exception()!r}"
    assert exits and launcher.restarts >= 1, "the worker that exited was not restarted"
    assert trap.is_dir()


def test_a_worker_that_cannot_be_started_again_is_retried_and_named(tmp_path):
    launcher = StandIn(specs(), str(tmp_path / "keys"), str(tmp_path / "run"))
    launcher.start()
    launcher.broken = True  # from its first restart on: the command is gone (as with EMFILE, ENOMEM)

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(launcher.watch(stop, lambda *a: None))
        await asyncio.sleep(1.5)
        seen = launcher.trouble()
        launcher.broken = False  # the next try succeeds: the trouble clears
        await asyncio.sleep(3.0)
        alive = not task.done()
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        return alive, task, seen

    alive, task, seen = asyncio.run(run())
    launcher.stop(grace_s=2)
    assert alive, f"supervision ended: {task.exception()!r}"
    assert "colocated-0" in seen and "cannot restart" in seen["colocated-0"], seen
    assert launcher.restarts >= 1 and "colocated-0" not in launcher.trouble()


def test_supervision_survives_an_error_of_its_own(tmp_path):
    launcher = StandIn(specs(), str(tmp_path / "keys"), str(tmp_path / "run"))
    launcher.start()
    calls = []

    def on_exit(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("the router's handler failed")

    alive, task = asyncio.run(supervise(launcher, 2.5, on_exit))
    launcher.stop(grace_s=2)
    assert alive, f"supervision ended: {task.exception()!r}"
    assert len(calls) >= 2  # it went on: the restarted worker's exit was reported too


class Troubled:
    def trouble(self) -> dict[str, str]:
        return {"colocated-0": "cannot restart it: OSError: [Errno 24] Too many open files; retrying"}


def test_health_says_when_a_worker_cannot_be_restarted(tokenizer):  # noqa: F811
    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))
        assert client.get("/health").json()["status"] == "ok"
        client.app.state.router.supervisor = Troubled()
        h = client.get("/health")
        body = h.json()
        assert h.status_code == 200 and body["status"] == "degraded", body
        assert "Too many open files" in body["message"] and "colocated-0" in body["supervision"]
