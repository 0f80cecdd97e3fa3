"""Which UCX transport carries a NIXL transfer's bytes, as UCX itself reports it.

NIXL's Python API does not say: `query_xfer_backend` names the backend ("UCX"), `get_xfer_telemetry`
(with NIXL_TELEMETRY_ENABLE=y) gives bytes and durations, neither the lane. UCX does, in its log:
with UCX_LOG_LEVEL=info it prints each endpoint configuration as it is made

    ini inter-node cfg#1 rma_am(tcp/eth0)  amo_am(tcp/eth0)  am(tcp/eth0)  ka(tcp/eth0)

and with UCX_PROTO_INFO=y the protocol each operation uses, per message size, with its transport:

    | ini intra-node cfg#1                                     |
    | remote memory write by ucp_put* from host memory to host |
    | 0..inf | zero-copy   | cma/memory                        |

The put table is the answer for a NIXL WRITE (the lanes line alone can mislead: above, `rma_am(tcp/lo)`
sits beside puts that really go over cma). So, before UCX loads, `configure(environ)` points UCX's log
at a file of this process (when the user has not chosen a log level or file of their own), and
`UcxLog.read()` parses what was added since the last read into `Lane`s, one per endpoint config.
UCX warnings and errors in that file are handed back too, so moving the log loses none of them.

Measured on this project's CPU machine (nixl 1.5.1, UCX 1.23.0), two processes in separate network
namespaces: with default settings UCX calls them "intra-node" (same kernel) and moves the bytes over
cma, never touching the network between them; with UCX_TLS=tcp they are "inter-node" over tcp/eth0.
That silent choice is what this module makes visible.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from dataclasses import dataclass, field

# levels at which UCX prints the lines this module reads
VERBOSE_LEVELS = {"info", "debug", "trace", "req", "data", "async", "func", "poll", "diag"}
# transports that move GPU memory without staging it through host buffers
GPU_DIRECT = ("cuda_ipc", "rc", "dc", "ud", "gdr_copy", "rocm_ipc")

_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s*")
_CFG_LINE = re.compile(r"UCX\s+INFO\s+(\S+) (self|intra-node|inter-node) cfg#(\d+) (.*)$")
_CFG_TITLE = re.compile(r"^(\S+) (self|intra-node|inter-node) cfg#(\d+)$")
_LEVEL = re.compile(r"UCX\s+(WARN|ERROR|FATAL)\s+(.*)$")
_TL_DEV = re.compile(r"([a-z][a-z0-9_]*)/([\w:.\-\[\]]+)")


def configure(env=os.environ) -> tuple[str | None, str]:
    """Before UCX is loaded: have it log its lanes to a file we can read. Returns (path or None, why):
    the user's own UCX_LOG_FILE is read as is; a UCX_LOG_LEVEL of theirs below info, or one without a
    file (UCX then prints to stdout), leaves the lane unknown and says so."""
    level = env.get("UCX_LOG_LEVEL")
    path = env.get("UCX_LOG_FILE")
    if level is None and path is None:
        env["UCX_LOG_LEVEL"] = "info"
        env["UCX_LOG_FILE"] = path = os.path.join(tempfile.gettempdir(), "pdserve-ucx-%p.log")
    elif level is not None and level.lower() not in VERBOSE_LEVELS:
        return None, f"UCX_LOG_LEVEL={level} hides UCX's lane lines (info or above shows them)"
    elif path is None:
        return None, "UCX_LOG_LEVEL is set without UCX_LOG_FILE: UCX prints its lanes to stdout, not to a file"
    env.setdefault("UCX_PROTO_INFO", "y")
    return path, ""


def expand(path: str, pid: int | None = None) -> str:
    """UCX's own substitutions in UCX_LOG_FILE: %p the pid, %h the host name."""
    return path.replace("%p", str(pid or os.getpid())).replace("%h", socket.gethostname())


@dataclass
class Lane:
    """One UCX endpoint configuration: its lanes, and the transports its puts use."""

    agent: str  # the UCX worker's name: our NIXL agent
    scope: str  # self | intra-node | inter-node
    cfg: int
    lanes: str = ""  # e.g. "rma_am(tcp/eth0) amo_am(tcp/eth0) am(tcp/eth0) ka(tcp/eth0)"
    put: list[str] = field(default_factory=list)  # e.g. ["cma/memory"]: what a WRITE's bytes go over

    @property
    def transports(self) -> list[str]:
        """Transport names carrying the bytes: from the put protocol when UCX printed it, else every
        transport of the RMA and AM lanes (keep-alive excluded)."""
        text = " ".join(self.put) or " ".join(part for part in self.lanes.split() if not part.startswith("ka("))
        out = []
        for tl, _ in _TL_DEV.findall(text):
            if tl not in out:
                out.append(tl)
        return out

    def host_staged_for_gpu(self) -> bool:
        """GPU memory over these transports goes through host buffers (a slow path on a GPU)."""
        return bool(self.transports) and not any(t.startswith(GPU_DIRECT) for t in self.transports)

    def describe(self) -> str:
        put = f"puts over {', '.join(self.put)}" if self.put else "no put protocol printed yet"
        return f"{'+'.join(self.transports) or '?'} ({self.scope} cfg#{self.cfg}: {put}; lanes {self.lanes})"

    def as_dict(self) -> dict:
        return {"transports": self.transports, "scope": self.scope, "cfg": self.cfg, "lanes": self.lanes,
                "put": list(self.put)}


# path -> a descriptor of this process on it: the file we made is unlinked as soon as it is open (UCX
# keeps its own descriptor), so it goes away with the process, however that ends
_FDS: dict[str, int] = {}


def _open(path: str) -> int | None:
    if path not in _FDS:
        try:
            _FDS[path] = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # UCX has not opened it yet
            return None
        if os.path.basename(path).startswith("pdserve-ucx-"):
            os.unlink(path)
    return _FDS[path]


class UcxLog:
    """This process's UCX log file, read incrementally (from the NIXL I/O thread only)."""

    def __init__(self, path: str | None, why: str = ""):
        self.path = None if path is None else expand(path)
        self.why = why  # when path is None: why the lane cannot be known
        if self.path is not None:
            _open(self.path)  # made by now (UCX opens it as it loads): take hold of it
        self.offset = 0
        self.cfgs: dict[tuple[str, int], Lane] = {}  # (agent, cfg#) -> lane
        self._partial = ""
        self._table: list[str] = []  # titles of the protocol table being read
        self._lane: Lane | None = None
        self._op = ""

    def read(self) -> tuple[list[Lane], list[str]]:
        """What UCX logged since the last call: (lanes new or changed, its warning/error lines)."""
        fd = _open(self.path) if self.path is not None else None
        if fd is None:
            return [], []
        chunks = []
        while chunk := os.pread(fd, 1 << 20, self.offset):
            chunks.append(chunk)
            self.offset += len(chunk)
        data = b"".join(chunks)
        text = self._partial + data.decode("utf-8", "replace")
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next read
        changed: list[Lane] = []
        problems: list[str] = []
        for raw in lines:
            lane = self._parse(raw, problems)
            if lane is not None and lane not in changed:
                changed.append(lane)
        return changed, problems

    def latest(self, agent: str) -> Lane | None:
        """The most recent non-self configuration of `agent`: a new peer reuses an existing cfg (and
        UCX prints nothing new) when its lanes are the same as an earlier peer's."""
        mine = [lane for (a, _), lane in self.cfgs.items() if a == agent and lane.scope != "self"]
        return mine[-1] if mine else None

    # ---- parsing ----------------------------------------------------------------------------------

    def _get_lane(self, agent: str, scope: str, cfg: int) -> Lane:
        key = (agent, cfg)
        if key not in self.cfgs:
            self.cfgs[key] = Lane(agent, scope, cfg)
        return self.cfgs[key]

    def _parse(self, raw: str, problems: list[str]) -> Lane | None:
        line = _PREFIX.sub("", raw).rstrip()
        m = _CFG_LINE.search(line)
        if m:
            lane = self._get_lane(m.group(1), m.group(2), int(m.group(3)))
            lane.lanes = " ".join(m.group(4).split())
            return lane
        m = _LEVEL.search(line)
        if m:
            problems.append(f"UCX {m.group(1)}: {m.group(2)}")
            return None
        if line.startswith("+"):  # a table's frame: a new table starts after its end frame
            if self._op and self._table and self._table[-1] == "rows":
                self._lane, self._op, self._table = None, "", []
            return None
        if not line.startswith("|"):
            return None
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # a title row: the configuration, then the operation
            m = _CFG_TITLE.match(cells[0])
            if m:
                self._lane = self._get_lane(m.group(1), m.group(2), int(m.group(3)))
                self._op, self._table = "", ["cfg"]
            elif self._lane is not None:
                self._op = cells[0]
                self._table.append("op")
            return None
        if len(cells) >= 3 and cells[0] != "Range" and self._lane is not None:
            if self._table and self._table[-1] != "rows":
                self._table.append("rows")
            if self._op.startswith("remote memory write by ucp_put"):
                for tl, dev in _TL_DEV.findall(cells[2]):
                    via = f"{tl}/{dev}"
                    if via not in self._lane.put:
                        self._lane.put.append(via)
                        return self._lane
        return None
