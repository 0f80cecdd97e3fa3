"""A deployment's CURVE keys (protocol/auth.py: the key pair, the gate) and their files.

Key files (`pdserve keygen DIR`), in ZeroMQ's certificate format; secret files 0600 in 0700 folders:
    DIR/router/router.key_secret  DIR/router/worker.key    stays on the router's machine
    DIR/worker/worker.key_secret  DIR/worker/router.key    copied to every worker machine
`pdserve` (router with its workers) makes fresh keys for each run and writes only the worker folder,
inside its private run directory.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq.auth
from zmq.utils import z85

from pdserve.protocol.auth import KeyPair

ROUTER_SECRET, ROUTER_PUBLIC = "router.key_secret", "router.key"
WORKER_SECRET, WORKER_PUBLIC = "worker.key_secret", "worker.key"


class KeyFileError(ValueError):
    """Key files missing, malformed or readable by others."""


@dataclass(frozen=True)
class RouterKeys:
    router: KeyPair
    worker_public: bytes

    def gate(self) -> dict[bytes, str]:
        return {self.worker_public: "worker"}


@dataclass(frozen=True)
class WorkerKeys:
    worker: KeyPair
    router_public: bytes

    def control_gate(self) -> dict[bytes, str]:
        return {self.router_public: "router"}

    def kv_gate(self) -> dict[bytes, str]:
        return {self.worker.public: "worker"}

    def disk_key(self) -> bytes:
        """The deployment's key for the disk tier's entries (workers/engine/kv_tiers): derived from the
        workers' secret, so every worker of a deployment reads what the others wrote and nobody without
        the deployment's keys can write an entry they accept."""
        return hashlib.blake2b(self.worker.secret, digest_size=32, person=b"pdserve-disk-kv").digest()


def new_deployment() -> tuple[RouterKeys, WorkerKeys]:
    router, worker = KeyPair.generate(), KeyPair.generate()
    return RouterKeys(router, worker.public), WorkerKeys(worker, router.public)


def write_router_keys(folder: str | Path, keys: RouterKeys) -> Path:
    folder = _private_folder(folder)
    _write_cert(folder / ROUTER_SECRET, keys.router.public, keys.router.secret)
    _write_cert(folder / WORKER_PUBLIC, keys.worker_public)
    return folder


def write_worker_keys(folder: str | Path, keys: WorkerKeys) -> Path:
    folder = _private_folder(folder)
    _write_cert(folder / WORKER_SECRET, keys.worker.public, keys.worker.secret)
    _write_cert(folder / ROUTER_PUBLIC, keys.router_public)
    return folder


def keygen(folder: str | Path) -> tuple[Path, Path]:
    """A new deployment's key folders under `folder`: (router folder, worker folder)."""
    router, worker = new_deployment()
    base = _private_folder(folder)
    return write_router_keys(base / "router", router), write_worker_keys(base / "worker", worker)


def load_router_keys(folder: str | Path) -> RouterKeys:
    folder = Path(folder)
    public, secret = _read_cert(folder / ROUTER_SECRET, secret=True, made_by="pdserve keygen DIR; pass DIR/router")
    worker_public, _ = _read_cert(folder / WORKER_PUBLIC, secret=False, made_by="pdserve keygen DIR; pass DIR/router")
    return RouterKeys(KeyPair(public, secret), worker_public)


def load_worker_keys(folder: str | Path) -> WorkerKeys:
    folder = Path(folder)
    public, secret = _read_cert(folder / WORKER_SECRET, secret=True, made_by="pdserve keygen DIR; pass DIR/worker")
    router_public, _ = _read_cert(folder / ROUTER_PUBLIC, secret=False, made_by="pdserve keygen DIR; pass DIR/worker")
    return WorkerKeys(KeyPair(public, secret), router_public)


def _private_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _write_cert(path: Path, public: bytes, secret: bytes | None = None) -> None:
    """ZeroMQ's certificate format (zmq.auth.load_certificate reads it); created 0600, never overwritten."""
    text = ["#   pdserve CURVE " + ("secret key pair: keep it private (0600)" if secret else "public key"),
            "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        text.append(f'    secret-key = "{secret.decode()}"')
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; pdserve keygen does not overwrite keys: pick an empty folder") from None
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(text) + "\n")


def _read_cert(path: Path, secret: bool, made_by: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"no key file {path}; make the key folders with `{made_by}`")
    if secret:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"{path} holds a secret key but is readable by others or not yours "
                            f"(mode {stat.filemode(st.st_mode)}); chmod 600 {path}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except ValueError as e:
        raise KeyFileError(f"{path} is not a CURVE key file ({e}); make it with `{made_by}`") from None
    for name, key in (("public", public), ("secret", secret_key)):
        if key is not None and (len(key) != 40 or len(_z85_decode(key, path)) != 32):
            raise KeyFileError(f"{path}: the {name} key is not a 40-character Z85 CURVE key")
    if secret and secret_key is None:
        raise KeyFileError(f"{path} holds no secret key; make the key folders with `{made_by}`")
    return public, secret_key


def _z85_decode(key: bytes, path: Path) -> bytes:
    try:
        return z85.decode(key)
    except (ValueError, KeyError):
        raise KeyFileError(f"{path}: a key is not valid Z85") from None
