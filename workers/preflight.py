"""What a worker checks before it loads its model, so that a mistake costs a second and one line,
not the model's load and a traceback: every TCP port it will bind is free, and the device it names
is there.

    preflight(cfg) -> str | None          why this worker cannot start (what to do), or None
    StartupError                          the same found later (a port taken between the check and the
                                          bind): workers/cli.py prints it in one line, exit code 2
"""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

from pdserve.protocol.enums import Role, Transport
from pdserve.settings.worker import WorkerConfig


class StartupError(RuntimeError):
    """This worker cannot start for a reason its user can fix (the message says how)."""


def preflight(cfg: WorkerConfig) -> str | None:
    for flag, host, port in ports(cfg):
        problem = port_problem(flag, host, port)
        if problem is not None:
            return problem
    return device_problem(cfg.engine.device)


def ports(cfg: WorkerConfig) -> list[tuple[str, str, int]]:
    """(flag, host, port) of each fixed TCP port this worker binds (port 0, any free one, needs no check)."""
    out = []
    control = urlsplit(cfg.control)
    if control.scheme == "tcp" and control.port:
        out.append(("--control", control.hostname or "", control.port))
    t = cfg.transfer
    if cfg.role == Role.DECODE and t.port:
        out.append(("--kv-port", t.host, t.port))
        if t.transport == Transport.ZMQ and t.plaintext:
            out.append(("--kv-port + 1 (the --kv-plaintext data port)", t.host, t.port + 1))
    return out


def port_problem(flag: str, host: str, port: int) -> str | None:
    host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            return describe_bind_error(flag, f"{host or '*'}:{port}", e)
    return None


def describe_bind_error(flag: str, where: str, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"{flag}: {where} is in use by another process (another worker on this port?); stop it, or "
                "pick another port (0: any free one)")
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return f"{flag}: {where} is not an address of this machine; give one of its interfaces (or 0.0.0.0)"
    if e.errno == errno.EACCES:
        return f"{flag}: {where}: binding a port below 1024 needs privileges; pick a port of 1024 or more"
    return f"{flag}: cannot bind {where}: {e.strerror or e}"


def device_problem(device: str) -> str | None:
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    import torch  # the engine imports it next anyway

    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no NVIDIA GPU or driver that torch can use; CUDA_VISIBLE_DEVICES may hide them")
        return f"--device {device}: this machine has no CUDA GPU ({why}); use --device cpu"
    count = torch.cuda.device_count()
    if int(index or 0) >= count:
        return f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}; pick one of them"
    return None
