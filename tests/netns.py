"""Three (or more) "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge,
each with its own address, for tests and benches that must cross a real network (as root).

    with Hosts(("router", "prefill", "decode")) as net:   # up on enter, always down on exit
        net["decode"].ip                    # 10.x.y.3: its address on the bridge
        net.popen("decode", [...])          # a process inside that namespace (ip netns exec)
        net.link("decode", up=False)        # pull the decode host's cable (both ends of its veth)
        net.shape("decode", rate_mbit=100)  # tbf on both directions of its link
        net.url("router", 8000)             # reachable from the test process too: the bridge has
                                            # an address in the root namespace

Names: every set has a tag (pid + random), so parallel runs never collide, and `up()` first removes
the namespaces and bridges of sets whose pid is dead (a run killed before its teardown). Interface
names stay within Linux's 15 characters: bridge `pdb<tag>`, root-side veth `pd<tag><i>`; inside each
namespace the other end is `eth0`. The subnet (10.213-254.N.0/24) is one no interface here uses.

`deploy/netns.sh` builds the same topology from the shell for a person; this is its twin for tests.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pdt"  # namespaces: pdt-<pid>-<rand>-<host>


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no veth/bridge support): skip, saying why."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def tc(*args: str, ns: str | None = None) -> None:
    argv = ([] if ns is None else ["ip", "netns", "exec", ns]) + ["tc", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    # named like a set of this process, so a probe cut short is swept like any stale set
    short = f"{random.getrandbits(24):06x}"
    probe, veth, bridge = f"{PREFIX}-{os.getpid()}-{short}-probe", f"pd{short}p", f"pdb{short}"
    try:
        ip("netns", "add", probe)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", probe)
        ip("link", "add", bridge, "type", "bridge")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a namespace, veth pair and bridge here: {e}"
    finally:
        ip("link", "del", veth, check=False)
        ip("link", "del", bridge, check=False)
        ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces and bridges of sets whose creating process is gone; returns their names."""
    gone = []
    for name in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-([0-9a-f]+)-\w+", name)
        if m and not _pid_alive(int(m.group(1))):
            kill_inside(name)
            ip("netns", "del", name, check=False)
            gone.append(name)
    for line in ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        m = re.match(r"\d+: (pdb([0-9a-f]{6}))[:@]", line)
        if m and not _owner_alive(m.group(2)):
            ip("link", "del", m.group(1), check=False)
            _marker(m.group(2)).unlink(missing_ok=True)
            gone.append(m.group(1))
    return gone


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def _marker(short: str) -> Path:
    """Written before a set's bridge is made: the pid that owns it."""
    return Path(tempfile.gettempdir()) / f"pdserve-netns-{short}.pid"


def _owner_alive(short: str) -> bool:
    try:
        return _pid_alive(int(_marker(short).read_text()))
    except (OSError, ValueError):
        return False


def kill_inside(ns: str) -> None:
    """SIGKILL every process still inside namespace `ns` (a test that failed before its teardown)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@dataclass(frozen=True)
class Host:
    name: str
    ns: str  # namespace name
    ip: str  # address on the bridge
    veth: str  # root-side end of its veth pair (the bridge port)
    dev: str = "eth0"  # its end, inside the namespace


class Hosts:
    def __init__(self, names=("router", "prefill", "decode")):
        self.tag = f"{os.getpid()}-{random.getrandbits(24):06x}"
        short = self.tag.split("-")[1]
        self.bridge = f"pdb{short}"
        self.subnet = _free_subnet()
        self.gateway = f"{self.subnet}.1"  # the bridge's own address, in the root namespace
        self.hosts = {n: Host(n, f"{PREFIX}-{self.tag}-{n}", f"{self.subnet}.{i + 2}", f"pd{short}{i}")
                      for i, n in enumerate(names)}
        self._up = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Hosts":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        sweep_stale()
        short = self.tag.split("-")[1]
        _marker(short).write_text(str(os.getpid()))
        self._up = True
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for h in self.hosts.values():
            ip("netns", "add", h.ns)
            ip("link", "add", h.veth, "type", "veth", "peer", "name", h.dev, "netns", h.ns)
            ip("link", "set", h.veth, "master", self.bridge)
            ip("link", "set", h.veth, "up")
            ip("addr", "add", f"{h.ip}/24", "dev", h.dev, ns=h.ns)
            ip("link", "set", h.dev, "up", ns=h.ns)
            ip("link", "set", "lo", "up", ns=h.ns)
            ip("route", "add", "default", "via", self.gateway, ns=h.ns)

    def down(self) -> None:
        """Kill what still runs inside, delete every namespace, veth and the bridge. Never raises."""
        if not self._up:
            return
        for h in self.hosts.values():
            kill_inside(h.ns)
            ip("netns", "del", h.ns, check=False)  # its veth pair goes with it
            ip("link", "del", h.veth, check=False)
        ip("link", "del", self.bridge, check=False)
        short = self.tag.split("-")[1]
        _marker(short).unlink(missing_ok=True)
        self._up = False

    # ---- using it -------------------------------------------------------------------------------

    def argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kw)

    def run(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True, timeout=60, **kw)

    def url(self, host: str, port: int, scheme: str = "http") -> str:
        return f"{scheme}://{self.hosts[host].ip}:{port}"

    def link(self, host: str, up: bool) -> None:
        """Take the host's link down (both ends, as a pulled cable) or bring it back."""
        h = self.hosts[host]
        state = "up" if up else "down"
        ip("link", "set", h.veth, state)
        ip("link", "set", h.dev, state, ns=h.ns)

    def shape(self, host: str, rate_mbit: float | None, burst_kib: int | None = None) -> None:
        """tbf at `rate_mbit` on both directions of the host's link (None: remove it). netem is not
        available on these machines; tbf is. The burst is 2 ms of the rate, at least 32 KiB (veths
        hand over segments up to 64 KiB, which tbf splits), the queue 200 ms: a slow link queues
        rather than drops, so TCP's own rate is the tbf rate."""
        h = self.hosts[host]
        for dev, ns in ((h.veth, None), (h.dev, h.ns)):
            subprocess.run((["ip", "netns", "exec", ns] if ns else []) + ["tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)
            if rate_mbit is None:
                continue
            burst = burst_kib or max(32, int(rate_mbit * 1e6 / 8 * 0.002 / 1024))
            tc("qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst}kb",
               "latency", "200ms", ns=ns)

    def listeners(self, host: str) -> list[str]:
        """Local addresses of every listening TCP socket inside the host (ss -ltn)."""
        out = self.run(host, ["ss", "-Hltn"]).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]


def _free_subnet() -> str:
    used = set(re.findall(r"inet (\d+\.\d+\.\d+)\.\d+/", ip("-4", "-o", "addr").stdout))
    rng = random.Random()
    for _ in range(200):
        cand = f"10.{rng.randrange(213, 255)}.{rng.randrange(0, 256)}"
        if cand not in used:
            return cand
    raise NetnsUnavailable("no free 10.213-254.x.0/24 subnet for the test namespaces")
