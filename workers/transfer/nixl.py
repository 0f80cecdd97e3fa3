"""`nixl`: NIXL over UCX; the prefill side WRITEs (one-sided push) into the decode pool.

Set-up, once:
    both sides   one agent each (enable_prog_thread=False: the progress thread spins a core when idle),
                 created and used only on the endpoint's I/O thread (sync mode NONE is not thread-safe);
                 the whole pool registered as ONE region (DRAM or VRAM)
    handshake    our own ZMQ Hello/Welcome carries the receiver agent's metadata, the pool's base address
                 and device; the sender add_remote_agent()s it once per peer (remove_remote_agent on
                 disconnect, so a restarted decode worker is re-added cleanly)

Per request: one WRITE per layer (layer mode) or one for all layers (bulk), each with one descriptor
per (layer, paired run), built with numpy from the run table and passed to initialize_xfer; its
notification (an XferNote) tells the receiver that write's bytes are visible. The Done notice says
how many writes to count. NIXL has no timeouts: every wait polls check_xfer_state against our deadline;
a dead receiver surfaces as nixlRemoteDisconnectError, raised as TransferError.

Why (layer, run) descriptors built per request, not prepped per-(layer, block) lists: measured on
this project's CPU machine (2 cores, DRAM over UCX cma, 28 layers x 16,384 blocks of 2 KiB), prepping
the 458,752 per-block descriptors took 86 ms locally plus 38 ms per peer and grows with the pool (a
100 GB Qwen2.5-7B pool is ~3M per side); per request, make_prepped_xfer over the index arrays cost 0.09
ms at 4 blocks and 0.59 ms at 2,048 blocks x 28 layers (it walks every index to merge), while
initialize_xfer with the 28 already-merged run descriptors stayed at 0.13-0.23 ms at every size. The
data moved is identical: NIXL merges contiguous pairs anyway, and our runs are exactly the merges.

UCX settings (environment, read when the agent is created):
    UCX_TLS             default (all) picks cma/shm on one host for DRAM and cuda_ipc for VRAM between
                        two processes; between hosts without RDMA use UCX_TLS=tcp (plus cuda_copy for
                        VRAM); with RDMA (rc/dc over mlx5) GPUDirect needs nvidia-peermem or dmabuf
    UCX_NET_DEVICES     which NIC (e.g. mlx5_0:1 or eth0) between hosts
    UCX_TCP_PORT_RANGE  when a firewall allows only a range
    UCX_RCACHE_MAX_UNRELEASED=1024  set here by default (unreleased registrations otherwise pile up)
    UCX_PROTO_INFO=y / UCX_LOG_LEVEL=info   show which transport a transfer took; set here (into a file of
                        this process, unless the user chose a UCX log level or file) so that both sides log
                        the lane of every peer: "KV to <peer> goes over UCX tcp (inter-node cfg#1: puts over
                        tcp/eth0; ...)" at the handshake, and the sender's TransferStats.ucx_lane
                        carries it (ucx_log.py); GPU memory on a host-staged lane is a warning

Why NIXL moved VRAM at only 0.4 GB/s on the H200 in the first try, and what this transport does:
both agents lived in ONE process, so UCX took its "self" path, a software emulation over tcp/lo. The
decode and prefill workers here are always separate processes, so UCX picks cuda_ipc zero-copy for
GPU->GPU puts on one host (and the prefill side pushes, which is the fast direction for cuda_ipc). And
each request is a handful of large descriptors (one per layer and contiguous run; BlockPool hands out
contiguous ranges), because per-descriptor cost (~6-8 us there) times 28 layers x 2,048 blocks would be
~0.4 s at 32k tokens, while contiguous runs moved at 0.7-1.2 TB/s.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from pdserve.protocol import kv as P
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.transfer.endpoint import log
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan, descriptors
from pdserve.workers.transfer.receiver import ChannelReceiver
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer
from pdserve.workers.transfer.ucx_log import Lane, UcxLog, configure

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
UCX_LOG = configure(os.environ)  # before UCX loads: it reads its log settings once


def make_agent(role: str):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransferError("the nixl transport needs the nixl package: pip install 'pdserve[nixl]' "
                            f"(or pick --transport ipc or zmq): {e}") from None
    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    agent = nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise TransferError("NIXL has no UCX backend here; check the nixl installation (plugins)")
    return agent


@dataclass(frozen=True)
class Region:
    """A registered pool: where it starts and what NIXL calls its memory."""

    base: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"

    @classmethod
    def of(cls, pool: torch.Tensor) -> "Region":
        cuda = pool.device.type == "cuda"
        return cls(pool.data_ptr(), pool.device.index if cuda else 0, "VRAM" if cuda else "DRAM")


def agent_for(role: str, pool: torch.Tensor):
    """An agent (on the calling I/O thread) with `pool` registered as one region."""
    if pool.device.type == "cuda":  # UCX's CUDA transports look for a current context on this thread
        torch.cuda.set_device(pool.device)
    agent = make_agent(role)
    return (agent, *register(agent, pool))


def register(agent, pool: torch.Tensor):
    region = Region.of(pool)
    nbytes = pool.numel() * pool.element_size()
    return region, agent.register_memory([(region.base, nbytes, region.device_id, "")], region.mem_type)


class Receiver(ChannelReceiver):
    transport = "nixl"
    needs_progress = True

    def _setup_transport(self) -> None:
        self.agent, self.region, self.reg = agent_for("decode", self.kv.pool)
        self.ucx = UcxLog(*UCX_LOG)
        self.senders_seen: set[str] = set()

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        r = self.region
        return P.NixlInfo(self.agent.name, self.agent.get_agent_metadata(), r.base, r.device_id, r.mem_type)

    def _progress(self) -> None:
        for agent, msgs in self.agent.get_new_notifs().items():
            if agent not in self.senders_seen:
                self.senders_seen.add(agent)
                report_lane(self.ucx, self.agent.name, f"KV from {agent}", self.region.mem_type)
            for raw in msgs:
                try:
                    note = P.decode_note(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("ignored a NIXL notification that is not ours: %r", bytes(raw[:64]))
                    continue
                with self._lock:
                    exp = self._expected.get(note.request_id)
                if exp is not None:
                    exp.received += 1

    def _teardown_transport(self) -> None:
        self.agent.deregister_memory(self.reg)


def report_lane(ucx: UcxLog, agent: str, what: str, mem_type: str, known: Lane | None = None) -> Lane | None:
    """Log which UCX transport carries `what` (and any UCX warning since the last look), unless it is
    what `known` already said; returns the lane."""
    seen = None if known is None else known.describe()
    _, problems = ucx.read()
    for line in problems:
        log.warning("%s", line)
    if ucx.path is None:
        if known is None:
            log.info("%s: UCX lane unknown: %s", what, ucx.why)
        return None
    lane = ucx.latest(agent)
    if lane is not None and lane.describe() == seen:
        return lane
    if lane is None:
        log.info("%s: UCX has not logged its lanes yet (%s)", what, ucx.path)
    elif mem_type == "VRAM" and lane.host_staged_for_gpu():
        log.warning("%s: GPU memory goes over UCX %s, staged through host memory: a slow path; check UCX_TLS "
                    "(cuda_ipc between processes of one host, rc/dc with GPUDirect between hosts)", what,
                    lane.describe())
    else:
        log.info("%s goes over UCX %s", what, lane.describe())
    return lane


@dataclass
class Remote:
    agent: str
    region: Region
    layout: KVLayout
    lane: Lane | None = None  # which UCX transport carries our writes (None: UCX did not say)
    lane_checked_after_write: bool = False


class NixlTransfer(SenderTransfer):
    """Queue items: (layers, the compute stream's event); each posts one WRITE with one XferNote."""

    polls_writes = True  # check_xfer_state is how NIXL makes progress: poll it without a nap

    def __init__(self, sender: Sender, peer: Peer, plan: Plan):
        super().__init__(sender, peer, plan)
        self.agent = sender.agent
        self.local = sender.region
        self.remote: Remote = peer.remote
        runs = np.array(plan.runs, dtype=np.int64).reshape(-1, 3)
        self.src_starts, self.dst_starts, self.lengths = runs[:, 0], runs[:, 1], runs[:, 2]
        self.handles: list = []  # I/O thread: transfers posted, not yet DONE

    # ---- I/O thread ------------------------------------------------------------------------

    def _post(self, layers: list[int]) -> int:
        try:
            self.mark_started()
            ids = np.array(layers, dtype=np.int64)
            local = descriptors(self.local.base, self.sender.layout, self.src_starts, self.lengths, ids,
                                self.local.device_id)
            remote = descriptors(self.remote.region.base, self.remote.layout, self.dst_starts, self.lengths, ids,
                                 self.remote.region.device_id)
            note = P.encode(P.XferNote(self.request_id, self.writes))
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.local.mem_type),
                                                self.agent.get_xfer_descs(remote, self.remote.region.mem_type),
                                                self.remote.agent, note)
            self.handles.append(handle)
            self.copies += len(local)
            if self.agent.transfer(handle) == "ERR":
                raise TransferError("transfer() returned ERR")
        except Exception as e:  # nixl's own exception types, turned into ours
            raise TransferError(f"request {self.request_id}: posting the NIXL write to {self.peer} failed: {e!r}; "
                                "free the request's prefill blocks") from None
        return 1

    def _writes_in_flight(self) -> bool:
        still = []
        for handle in self.handles:
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:  # nixlRemoteDisconnectError and friends
                state, error = "ERR", e
            else:
                error = None
            if state == "PROC":
                still.append(handle)
                continue
            if state == "ERR":
                self.fail(TransferError(f"request {self.request_id}: a NIXL write to {self.peer} failed "
                                        f"({error!r}); the decode worker may be gone; free the request's prefill "
                                        "blocks"))
            else:
                self.sender._lane_after_write(self.p)
            self._release(handle)
        self.handles = still
        return bool(still)

    def _drop_writes(self) -> None:
        for handle in self.handles:
            self._release(handle)
        self.handles = []

    def _release(self, handle) -> None:
        try:
            handle.release()
        except Exception as e:  # NIXL may refuse for a failed or half-gone transfer; dropped either way
            log.info("releasing a NIXL transfer handle of %s: %r", self.request_id, e)

    def stats(self):
        st = super().stats()
        lane = self.remote.lane if self.remote is not None else None
        st.ucx_lane = lane.as_dict() if lane is not None else {"unknown": self.sender.ucx.why or
                                                               "UCX logged no lane for this peer"}
        return st


class Sender(ChannelSender):
    transport = "nixl"
    info = (P.NixlInfo,)
    transfer_class = NixlTransfer

    def _setup_transport(self) -> None:
        self.agent, self.region, self.reg = agent_for("prefill", self.kv.pool)
        self.ucx = UcxLog(*UCX_LOG)

    def _attach(self, peer: Peer, welcome: P.Welcome) -> Remote:
        info = welcome.info
        try:
            self.agent.add_remote_agent(info.metadata)
            self.agent.make_connection(info.agent)
        except Exception as e:  # nixl raises its own exception types (nixlMismatchError, ...)
            raise TransferError(f"NIXL could not add the decode worker at {peer.address} ({info.agent}): {e!r}; "
                                "check UCX_TLS / UCX_NET_DEVICES on both hosts") from None
        lane = report_lane(self.ucx, self.agent.name, f"KV to {peer.address} ({info.agent})", self.region.mem_type)
        return Remote(info.agent, Region(info.base_addr, info.device_id, info.mem_type), peer.layout, lane)

    def _detach(self, peer: Peer) -> None:
        try:
            self.agent.remove_remote_agent(peer.remote.agent)
        except Exception as e:  # already gone on NIXL's side: nothing left to remove
            log.info("removing the NIXL agent of %s: %r", peer.address, e)

    def _teardown_transport(self) -> None:
        self.agent.deregister_memory(self.reg)

    def _tick(self) -> float:
        """While a finish() waits for writes in flight, poll them without a nap (a 50 us nap is ~100 us
        of sleep, 7% of a 1.8 GiB bulk write on one H200); layer mode's writes during prefill keep it."""
        wait_s = super()._tick()
        finishing = any(t.handles and t.finishing is not None for p in self._connected.values()
                        for t in p.transfers.values())
        return 0.0 if finishing else wait_s

    def _lane_after_write(self, peer: Peer) -> None:
        """Once, after the first write to a peer: UCX prints some protocols only at first use, and a
        lane it had not logged at the handshake shows up now."""
        remote: Remote = peer.remote
        if remote is None or remote.lane_checked_after_write:
            return
        remote.lane_checked_after_write = True
        remote.lane = report_lane(self.ucx, self.agent.name, f"KV to {peer.address} ({remote.agent})",
                                  self.region.mem_type, remote.lane)
