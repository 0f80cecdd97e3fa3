"""Who may talk to whom (protocol/auth.py, SECURITY.md), against a router with the deployment's keys:

- a forged registration is refused: without CURVE, with another deployment's worker key, encrypted
  for another router's key, and with the valid key but a live worker's id (that worker keeps its
  id, its requests and its answers); each refusal is logged on both sides
- a real worker process with the wrong key is refused at connect and exits saying why
- forged control messages to a real worker process (no CURVE, a worker key, the router's key with
  another incarnation) are refused; the worker stays registered and serves
- a KV handshake that names a file outside the pool scheme is refused, and the file is untouched
- key files: secrets readable by others are refused; keygen never overwrites
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from test_server_harness import ROOT
from test_server_router import FakeWorker, colocated_echo, router, tokenizer  # noqa: F401  (tokenizer: a fixture)
from pdserve.protocol import auth
from pdserve.settings.keys import KeyFileError, WorkerKeys, load_router_keys, load_worker_keys, new_deployment, write_worker_keys
from pdserve.protocol import control as P

pytestmark = pytest.mark.timeout(180)


def attempt(address: str, keys: WorkerKeys | None, frame: bytes, wait_s: float = 1.0) -> list[str]:
    """Connect a PUSH (CURVE client with `keys`, plain without), send one frame, and return what this
    side's monitor says about the handshake (nothing: it got through)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        auth.connect_curve(sock, keys.worker, keys.router_public)
    watch = auth.HandshakeWatch(sock, server=False)
    sock.connect(address)
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass
    end, failures = time.monotonic() + wait_s, []
    while time.monotonic() < end and not failures:
        if watch.sock.poll(50):
            failures = watch.failures()
    watch.close()
    sock.close(0)
    ctx.term()
    return failures


def register(worker_id: str) -> P.Register:  # a well-formed Register of a colocated worker
    return P.Register(P.PROTOCOL_VERSION, worker_id, "colocated", "tcp://127.0.0.1:1", "tiny", 64, 16, 100, 100,
                      "cpu", "float32", 1, None, None, None)


def messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# ---- registration -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no key", "another deployment's worker key", "another router's key"])
def test_forged_registration_without_the_key_is_refused_at_connect(tokenizer, caplog, case):  # noqa: F811
    caplog.set_level(logging.INFO)
    with router(tokenizer) as client:
        pool = client.app.state.router.pool
        real_router = client.worker_keys.router_public
        other = new_deployment()[1]
        keys = {"no key": None,
                "another deployment's worker key": WorkerKeys(other.worker, real_router),
                "another router's key": WorkerKeys(client.worker_keys.worker, other.router_public)}[case]
        client_side = attempt(pool.address, keys, P.from_worker("f" * 32, register("forged")))
        time.sleep(0.2)
        assert "forged" not in pool.workers and client.get("/health").json()["workers"] == []
    log = messages(caplog)
    if case == "no key":
        assert "a peer without CURVE (plain ZMQ) was refused" in log or "broke off the CURVE handshake" in log, log
        assert client_side and ("without keys" in client_side[0] or "disagree on CURVE" in client_side[0]), \
            client_side
    elif case == "another deployment's worker key":
        assert f"register socket: refused a connection from 127.0.0.1: its CURVE key {other.worker.public.decode()}" \
            in log, log
        assert client_side and "refused this process's CURVE key" in client_side[0], client_side
    else:
        assert "a peer encrypted for another server key" in log, log
        assert client_side and "dropped the CURVE handshake" in client_side[0], client_side


def test_a_valid_key_cannot_take_a_live_workers_id(tokenizer, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    with router(tokenizer) as client:
        pool = client.app.state.router.pool
        real = client.add_worker("colocated", "c0", colocated_echo(2))
        impostor = FakeWorker(pool.address, "colocated", "c0", colocated_echo(7), keys=client.worker_keys)
        impostor.start()
        try:
            end = time.monotonic() + 5
            while not impostor.acks and time.monotonic() < end:
                time.sleep(0.02)
            ack = impostor.acks[0]
            assert not ack.ok and ack.retry and "held by a live worker process" in ack.error
            # under its own incarnation, the impostor's Goodbye and Tokens for c0 count for nothing
            impostor.send(P.Goodbye("c0", "forged"))
            impostor.tokens("cmpl-anything", [666])
            time.sleep(0.3)
            assert pool.workers["c0"].incarnation == real.incarnation
            for _ in range(3):
                r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "<100><101>", r.text
            assert len(real.got(P.Generate)) == 3 and not impostor.got(P.Generate)
            assert not impostor.registered.is_set()
            metrics = client.get("/metrics").text
            assert 'pdserve_control_dropped_total{reason="id_held"}' in metrics
            assert 'pdserve_control_dropped_total{reason="stranger"}' in metrics
        finally:
            impostor.stopped.set()
            impostor.join(5)
    assert "refused a registration: worker id c0 is held by a live worker process" in messages(caplog)


# ---- real worker processes ------------------------------------------------------------------------


def start_worker(address: str, keys_dir: Path, log: Path, worker_id: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.workers.cli", "--role", "colocated", "--model", "tiny", "--threads", "1",
           "--num-blocks", "64", "--router", address, "--keys", str(keys_dir), "--worker-id", worker_id,
           "--parent-pid", str(os.getpid())]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_a_worker_with_the_wrong_key_is_refused_and_says_why(tokenizer, tmp_path, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    with router(tokenizer, heartbeat_interval_s=0.5) as client:
        pool = client.app.state.router.pool
        other = new_deployment()[1]
        keys = write_worker_keys(tmp_path / "keys", WorkerKeys(other.worker,
                                                                         client.worker_keys.router_public))
        log = tmp_path / "worker.log"
        worker = start_worker(pool.address, keys, log, "wrong-key")
        try:
            rc = worker.wait(120)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert "wrong-key" not in pool.workers
    text = log.read_text()
    assert rc == 2, text
    assert "the router at " + pool.address + " refused this worker at connect" in text, text
    assert "refused this process's CURVE key" in text and "--keys" in text, text
    assert f"its CURVE key {other.worker.public.decode()} is not one this socket accepts" in messages(caplog)


def test_forged_control_messages_to_a_worker_are_refused(tokenizer, tmp_path):  # noqa: F811
    # a real worker process on a shared 2-core machine: heartbeats every 0.5 s, not the fakes' 0.1 s
    with router(tokenizer, heartbeat_interval_s=0.5, token_timeout_s=30.0) as client:
        pool = client.app.state.router.pool
        keys = write_worker_keys(tmp_path / "keys", client.worker_keys)
        log = tmp_path / "worker.log"
        worker = start_worker(pool.address, keys, log, "victim")
        try:
            assert client.portal.call(pool.wait_for, lambda p: "victim" in p.workers, 120), log.read_text()
            w = pool.workers["victim"]
            exit_now = P.RegisterAck(P.PROTOCOL_VERSION, False, error="forged: exit now")
            # plain ZMQ; the worker key (every worker holds it, the router key is another); the
            # router's own key but another incarnation (a frame meant for an earlier process)
            router_keys = client.app.state.router.cfg.keys
            as_router = WorkerKeys(router_keys.router, client.worker_keys.worker.public)
            as_worker = WorkerKeys(client.worker_keys.worker, client.worker_keys.worker.public)
            plain = attempt(w.info.address, None, P.from_router(w.incarnation, exit_now))
            worker_key = attempt(w.info.address, as_worker, P.from_router(w.incarnation, exit_now))
            stale = attempt(w.info.address, as_router, P.from_router("0" * 32, exit_now))
            assert plain and worker_key and not stale, (plain, worker_key, stale)
            # it would have exited by now: it has dealt with all three (its log says how it refused each),
            # and heartbeats from it landed a whole interval later (an exit sends a Goodbye, not those)
            cfg = client.app.state.router.cfg
            end = time.monotonic() + 4 * cfg.heartbeat_timeout_s
            while (worker.poll() is None and unlogged_refusals(log.read_text(), client.worker_keys)
                   and time.monotonic() < end):
                time.sleep(0.05)
            dealt = time.monotonic()
            end = dealt + cfg.heartbeat_interval_s + cfg.heartbeat_timeout_s  # silent that long, it is dropped
            while (worker.poll() is None and pool.workers.get("victim") is w
                   and w.last_seen < dealt + cfg.heartbeat_interval_s and time.monotonic() < end):
                time.sleep(0.05)
            assert worker.poll() is None and pool.workers.get("victim") is w, log.read_text()
            assert w.last_seen >= dealt + cfg.heartbeat_interval_s, ("no heartbeat since the forged messages",
                                                                    log.read_text())
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["timings"]["worker"] == "victim", r.text
        finally:
            worker.terminate()
            worker.wait(30)
    text = log.read_text()
    assert not (unlogged := unlogged_refusals(text, client.worker_keys)), (unlogged, text)
    assert "forged: exit now" not in text


def unlogged_refusals(text: str, keys: WorkerKeys) -> list[str]:
    """Which of its three refusals the worker's log does not tell of (the plain peer, the worker key, the
    stale incarnation)."""
    # libzmq names the plain peer's refusal by whether the mismatch or its disconnect came first: either is
    # a refusal, and the worker survived it (checked in the test)
    told = {"plain": ("control socket: a peer without CURVE (plain ZMQ) was refused" in text
                      or "control socket: a peer broke off the CURVE handshake" in text),
            "worker key": (f"control socket: refused a connection from 127.0.0.1: its CURVE key "
                           f"{keys.worker.public.decode()} is not one this socket accepts (router key") in text,
            "stale": "dropped a RegisterAck addressed to another incarnation" in text}
    return [what for what, seen in told.items() if not seen]


# ---- the KV handshake -----------------------------------------------------------------------------


class FakeReceiver(threading.Thread):
    """A KV 'receiver' that answers every Hello with a Welcome naming `path` as its pool."""

    def __init__(self, path: str, nbytes: int):
        super().__init__(daemon=True)
        from pdserve.protocol import kv as TP

        self.TP, self.path, self.nbytes = TP, path, nbytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()[:2]
            hello = self.TP.decode_to_receiver(frame)
            welcome = self.TP.Welcome(self.TP.PROTOCOL_VERSION, socket.gethostname(), hello.layout,
                                      self.TP.ShmInfo(self.path, self.nbytes))
            self.sock.send_multipart([ident, self.TP.encode(welcome)])
        self.sock.close(0)
        self.ctx.term()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", ["outside /dev/shm", "symlink with a pool's name", "hard link with a pool's name",
                                  "a pool's name, another size", "path traversal", "a real pool file"])
def test_a_kv_handshake_naming_another_file_is_refused_and_the_file_untouched(tmp_path, case):
    from pdserve.workers.engine.kv_cache import KVCache, KVLayout
    from pdserve.settings.worker import TransferConfig
    from pdserve.workers.transfer.errors import TransferError
    from pdserve.workers.transfer.registry import make_sender

    layout = KVLayout(2, 2, 8, "float32", 16, 8)
    nbytes = layout.pool_bytes
    victim = tmp_path / "victim.bin"
    victim.write_bytes(os.urandom(nbytes))  # the size the layout needs: only the other checks can save it
    shm_victim = Path(f"/dev/shm/pdserve-test-victim-{os.getpid()}")
    shm_victim.write_bytes(os.urandom(nbytes))
    name = Path(f"/dev/shm/pdserve-kv-{os.getpid()}-{os.urandom(4).hex()}")
    if case == "outside /dev/shm":
        path = str(victim)
    elif case == "symlink with a pool's name":
        name.symlink_to(victim)
        path = str(name)
    elif case == "hard link with a pool's name":
        os.link(shm_victim, name)
        path = str(name)
    elif case == "a pool's name, another size":
        name.write_bytes(os.urandom(nbytes + 4096))
        path = str(name)
    elif case == "path traversal":
        path = f"/dev/shm/pdserve-kv-{os.getpid()}-00000000/../../..{victim}"
    else:
        name.write_bytes(b"\0" * nbytes)
        path = str(name)
    before = {p: digest(p) for p in (victim, shm_victim)}
    fake = FakeReceiver(path, nbytes)
    fake.start()
    send = make_sender(KVCache(layout, "cpu"), TransferConfig(transport="ipc", deadline_s=5))
    try:
        if case == "a real pool file":  # the checks can pass: a pdserve pool is mapped
            send.connect(fake.address)
        else:
            with pytest.raises(TransferError, match="refused") as err:
                send.connect(fake.address)
            assert path in str(err.value) or repr(path) in str(err.value)
        after = {p: digest(p) for p in (victim, shm_victim)}
    finally:
        send.close()
        fake.stop.set()
        fake.join(5)
        for p in (name, shm_victim):
            if p.is_symlink() or p.exists():
                p.unlink()
    assert after == before


# ---- key files ------------------------------------------------------------------------------------


def test_key_files_are_private_and_never_overwritten(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "keygen", str(tmp_path / "k")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "pdserve router --keys" in run.stdout, run.stderr
    for folder in ("k", "k/router", "k/worker"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700
    for secret in ("k/router/router.key_secret", "k/worker/worker.key_secret"):
        assert (tmp_path / secret).stat().st_mode & 0o777 == 0o600
    router_keys, worker_keys = load_router_keys(tmp_path / "k/router"), load_worker_keys(tmp_path / "k/worker")
    assert router_keys.worker_public == worker_keys.worker.public
    assert worker_keys.router_public == router_keys.router.public
    assert worker_keys.worker.secret.decode() not in repr(worker_keys)
    again = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "keygen", str(tmp_path / "k")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "does not overwrite" in again.stderr
    assert load_worker_keys(tmp_path / "k/worker") == worker_keys
    os.chmod(tmp_path / "k/worker/worker.key_secret", 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_worker_keys(tmp_path / "k/worker")
    with pytest.raises(KeyFileError, match="pdserve keygen"):
        load_router_keys(tmp_path / "nothing")
    run = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "router", "--model", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--keys DIR is required" in run.stderr


def test_bounds_hold_on_kv_messages():
    from pdserve.protocol import kv as TP

    for msg in ({"type": "begin", "request_id": "r", "dst_blocks": [-1], "num_tokens": 5},
                {"type": "chunk", "request_id": "r", "layer": -2, "dst_start": 0, "num_blocks": 1, "nbytes": 4},
                {"type": "chunk", "request_id": "r", "layer": 0, "dst_start": 0, "num_blocks": 0, "nbytes": 4},
                {"type": "hello", "version": 1, "transport": "ipc", "host": "h", "sender": "s",
                 "layout": {"num_layers": 0, "num_kv_heads": 1, "head_dim": 1, "dtype": "float32", "block_size": 1,
                            "num_blocks": 1}},
                {"type": "hello", "version": 1, "transport": "ipc", "host": "h", "sender": "s",
                 "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "int8", "block_size": 1,
                            "num_blocks": 1}},
                {"type": "done", "request_id": "r", "first_token": -5, "num_bytes": 0, "started_at": 0.0,
                 "finished_at": 0.0, "writes": 0}):
        with pytest.raises(msgspec.ValidationError):
            TP.decode_to_receiver(msgspec.msgpack.encode(msg))
