"""The arms of a load comparison, and a fresh server for each.

    Arm.parse("colo=colocated:--prefill-workers 0 --decode-workers 0")
        an arm labelled "colo", whose requests carry policy "colocated", served by its own server
        started with those flags (after the common --server-args)
    Arm("colocated", "colocated")          an arm served by the server at --base-url
    with_cache_modes(arms, ["cache-off", "gpu", "gpu+host"], host_gb=8)
                                            each arm once per KV cache mode, labelled "colocated:gpu+host",
                                            its workers given that mode's flags (CACHE_MODES)
    async with ArmServer(cmd, log) as url   start the server, wait for its "ready: <url>" line,
                                            stop it on the way out (SIGTERM, waiting for it to exit
                                            (pdserve waits for its workers), so the next arm finds
                                            the devices free; SIGKILL after 60 s)

The server is a subprocess whose stdout and stderr go to the log file; `pdserve` and
`python -m pdserve.bench.load.fake_server` both print "... ready: http://host:port" once they serve.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"\bready: (http://\S+)")
LABEL = re.compile(r"[\w.+:-]+")  # also a file name part (server-<label>.log)

# KV cache mode -> what it asks of every worker (pdserve passes --worker-arg on); the prefix cache is on by
# default, the host and disk tiers off. {host_gb}, {disk_dir}, {disk_gb}: the sizes given to with_cache_modes.
CACHE_MODES = {
    "cache-off": ("--no-prefix-cache",),
    "gpu": (),
    "gpu+host": ("--host-cache-gb={host_gb}",),
    "gpu+host+disk": ("--host-cache-gb={host_gb}", "--disk-cache-dir={disk_dir}", "--disk-cache-gb={disk_gb}"),
}


class ArmError(RuntimeError):
    """An arm's server did not start; the message names the arm, the log and its tail."""


@dataclass(frozen=True)
class Arm:
    label: str  # names the arm in results.json, the tables and the plots
    policy: str | None  # the "policy" field its requests carry (None: the server's default)
    server_args: tuple[str, ...] | None = None  # None: no server started, use --base-url

    @classmethod
    def parse(cls, spec: str) -> "Arm":
        """LABEL=POLICY:FLAGS, e.g. "colocated=colocated:--prefill-workers 0 --decode-workers 0"."""
        label, eq, rest = spec.partition("=")
        policy, colon, flags = rest.partition(":")
        if not (eq and colon and label.strip() and policy.strip()) or not LABEL.fullmatch(label.strip()):
            raise ValueError(f"bad --arm {spec!r}: use LABEL=POLICY:SERVER-FLAGS with a label of letters, digits, "
                             "'.', '+', ':', '-', e.g. colocated=colocated:--prefill-workers 0 --decode-workers 0")
        return cls(label.strip(), policy.strip(), tuple(shlex.split(flags)))

    def describe(self) -> str:
        where = "the server at --base-url" if self.server_args is None else \
            f"its own server ({shlex.join(self.server_args) or 'common flags only'})"
        return f"{self.label}: policy {self.policy or '(server default)'}, {where}"


def with_cache_modes(arms: list[Arm], modes: list[str], *, host_gb: float | None = None,
                     disk_dir: str | None = None, disk_gb: float | None = None) -> list[Arm]:
    """Each arm once per mode, in arm-major order (all of one policy's modes, then the next policy's). The
    disk tier gets one folder per arm under disk_dir, so no arm reads another's entries."""
    unknown = [m for m in modes if m not in CACHE_MODES]
    if unknown or not modes:
        raise ValueError(f"unknown cache mode(s) {unknown or modes}: use a comma-separated list of "
                         f"{', '.join(CACHE_MODES)}")
    if any(a.server_args is None for a in arms):
        raise ValueError("--cache-arms sets each arm's worker flags, so each arm needs its own server: give the "
                         "arms by --arm, not --policies")
    needs = {"{host_gb}": ("--cache-host-gb", host_gb), "{disk_dir}": ("--cache-disk-dir", disk_dir),
             "{disk_gb}": ("--cache-disk-gb", disk_gb)}
    out = []
    for arm in arms:
        for mode in modes:
            label = f"{arm.label}:{mode}"
            flags = []
            for template in CACHE_MODES[mode]:
                for key, (flag, value) in needs.items():
                    if key in template and value is None:
                        raise ValueError(f"cache mode {mode} needs {flag}")
                value = template.format(host_gb=host_gb, disk_gb=disk_gb,
                                        disk_dir=disk_dir and str(Path(disk_dir) / re.sub(r"[^\w.+-]", "_", label)))
                flags.append(f"--worker-arg={value}")
            out.append(Arm(label, arm.policy, (*arm.server_args, *flags)))
    return out


def default_server_command() -> list[str]:
    """pdserve on any free port, stopping itself if this process dies."""
    return [sys.executable, "-m", "pdserve.server.cli", "--port", "0", "--parent-pid", str(os.getpid())]


class ArmServer:
    def __init__(self, command: list[str], log_path: Path, *, start_timeout_s: float = 900.0, label: str = ""):
        self.command = command
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.label = label
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # process start -> ready line

    def _fail(self, why: str) -> ArmError:
        tail = "".join(self.log_path.read_text(errors="replace").splitlines(True)[-30:])
        return ArmError(f"arm {self.label}: the server {why} (command: {shlex.join(self.command)}; "
                        f"log {self.log_path}, last lines:\n{tail})")

    async def __aenter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # own session: a signal to this process group (Ctrl-C) does not hit the server twice
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            while True:
                match = READY.search(self.log_path.read_text(errors="replace"))
                if match:
                    self.startup_s = time.monotonic() - t0
                    return match.group(1)
                if self.proc.poll() is not None:
                    raise self._fail(f"exited with code {self.proc.returncode} before it was ready")
                if time.monotonic() - t0 > self.start_timeout_s:
                    raise self._fail(f"was not ready within {self.start_timeout_s:.0f} s")
                await asyncio.sleep(0.2)
        except BaseException:  # __aexit__ does not run when __aenter__ raises: stop it here
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
