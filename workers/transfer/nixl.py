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

A fragmented request (many short runs: staging.stages) goes through a staging region on each side instead
(nixl_staging.py), registered once at start (--kv-staging-gb; default half the pool, at most 2 GiB) and named
in NixlInfo. The Begin asks for a grant once the sender took a range of its own; the Accept grants a range of
the receiver's, or none when there is no room (then run by run: no wait, no failure). The sender gathers a
span of layers into its range and WRITEs it with ONE descriptor (per layer in layer mode, per WRITE_BYTES in
bulk: O(layers), not O(runs x layers)); the receiver checks each StagedNote against the grant and scatters it
into the reserved blocks before the arrival. Both ranges go back on every path (the receiver's after its fence).

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

import collections
import logging
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
from pdserve.workers.transfer.nixl_staging import Grants, StagedSend, Staging
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan, descriptors
from pdserve.workers.transfer.receiver import ChannelReceiver, Expected, ReceiveState
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer
from pdserve.workers.transfer.staging import groups, layers_per_write, region_bytes
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


def deregister(agent, *regs) -> None:
    for reg in regs:
        if reg is not None:
            agent.deregister_memory(reg)


class Receiver(ChannelReceiver):
    transport = "nixl"
    needs_progress = True

    def _setup_transport(self) -> None:
        self.agent, self.region, self.reg = agent_for("decode", self.kv.pool)
        self.ucx = UcxLog(*UCX_LOG)
        self.senders_seen: set[str] = set()
        self.staging = Staging.register(self.agent, self.kv.pool,
                                        region_bytes(self.cfg.staging_gb, self.layout.pool_bytes))
        stream = torch.cuda.Stream(self.kv.pool.device) if self.kv.pool.is_cuda else None  # the scatters
        self.grants = Grants(self.staging, self.kv.pool, stream) if self.staging is not None else None

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        r, st = self.region, self.staging
        return P.NixlInfo(self.agent.name, self.agent.get_agent_metadata(), r.base, r.device_id, r.mem_type,
                          st.base if st else 0, st.space.nbytes if st else 0)

    def _accept(self, exp: Expected, begin: P.Begin) -> P.Accept:
        """A staging grant when the Begin asks for one and the region has room; else none (run by run)."""
        if not begin.stage or self.grants is None:
            return P.Accept(exp.request_id)
        layer_bytes = len(exp.dst_blocks) * self.layout.block_bytes
        grant = self.grants.take(exp, self.layout.num_layers * layer_bytes, layer_bytes)
        if grant is None:
            self._throttle("staging", logging.INFO, "%s: no room in the staging region (--kv-staging-gb) for "
                           "request %s: it goes run by run", self._name, exp.request_id)
        return P.Accept(exp.request_id, grant)

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
                if exp is None:
                    continue
                if isinstance(note, P.StagedNote):
                    self._unstage(exp, note)
                else:
                    exp.received += 1

    def _unstage(self, exp: Expected, note: P.StagedNote) -> None:
        """A staged write landed: its layers into the reserved blocks, once checked against the grant."""
        if exp.give_up is not None or exp.state is not ReceiveState.ACCEPTED:
            return  # given up on: nothing more is scattered into its blocks
        refused = self.grants.unstage(exp, note) if self.grants is not None else "no staging region here"
        if refused is not None:
            self._give_up(exp, f"request {exp.request_id}: refused a staged write from the prefill worker "
                          f"(bytes {note.offset}..{note.offset + note.nbytes - 1} of the staging region): {refused}")
            return
        exp.received += 1

    def _landed(self, exp: Expected) -> bool:
        if not super()._landed(exp):
            return False
        if self.grants is None:
            return True
        landed = self.grants.landed(exp, self.layout.num_layers)
        if isinstance(landed, str):
            exp.give_up = exp.give_up or f"request {exp.request_id}: {landed}"
            return False
        return landed

    def _report(self, exp: Expected, arrival) -> None:
        if self.grants is not None:
            self.grants.release(exp)
        super()._report(exp, arrival)

    def _teardown_transport(self) -> None:
        deregister(self.agent, self.reg, self.staging.reg if self.staging else None)


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
    staging_base: int = 0  # its staging region (NixlInfo), staging_bytes 0: none
    staging_bytes: int = 0


class NixlTransfer(SenderTransfer):
    """Queue items: (layers, the compute stream's event). Run by run: each posts one WRITE of a descriptor per
    (layer, run) with one XferNote. Staged (a grant in the Accept): each is gathered into our staging range
    and posted as one WRITE per span of layers (staging.groups) with one StagedNote, on GPU once its gather's
    event completed (`gathered`)."""

    polls_writes = True  # check_xfer_state is how NIXL makes progress: poll it without a nap

    def __init__(self, sender: Sender, peer: Peer, plan: Plan):
        super().__init__(sender, peer, plan)
        self.agent = sender.agent
        self.local = sender.region
        self.remote: Remote = peer.remote
        runs = np.array(plan.runs, dtype=np.int64).reshape(-1, 3)
        self.src_starts, self.dst_starts, self.lengths = runs[:, 0], runs[:, 1], runs[:, 2]
        self.handles: list = []  # I/O thread: transfers posted, not yet DONE
        self.staged: StagedSend | None = None  # I/O thread: the staged path, from the Begin (None: run by run)
        self.gathered: collections.deque = collections.deque()  # GPU: (first, count, event) waiting to be written
        self.descriptors = 0  # NIXL descriptor pairs posted
        self.notes = 0  # writes posted (each note's seq)

    # ---- I/O thread ------------------------------------------------------------------------

    def begin(self, dst_blocks: list[int], num_tokens: int) -> P.Begin:
        self.staged = StagedSend.ask(self.sender.staging, self.remote.staging_bytes, self.plan, self.src)
        return P.Begin(self.request_id, dst_blocks, num_tokens, stage=self.staged is not None)

    def on_accept(self, grant: P.StagingGrant | None = None) -> None:
        if self.staged is None or grant is None:
            if self.staged is not None:  # asked, and no room there: run by run
                self.staged.give_back()
                self.staged = None
            super().on_accept(grant)  # (a grant not asked for is refused there)
            return
        refused = self.staged.refusal(grant, self.remote.staging_bytes)
        if refused is not None:
            self.fail(TransferError(f"request {self.request_id}: the decode worker at {self.peer} granted staging "
                                    f"space this transfer cannot use ({refused}); refused; run the same pdserve "
                                    "version on both workers"))
            return
        self.staged.grant = grant
        self._accepted()

    def let_go(self) -> None:
        """Over, or the peer gone: no write of ours reads our range any more (a later gather into it runs
        after ours on the side stream)."""
        if self.staged is not None:
            self.staged.give_back()

    def _post(self, layers: list[int]) -> int:
        self.mark_started()
        if self.staged is None or self.staged.grant is None:
            return self._post_runs(layers)
        try:
            return self._post_staged(layers)
        except (RuntimeError, ValueError) as e:  # a gather torch refused
            raise TransferError(f"request {self.request_id}: gathering its blocks into staging failed: {e!r}; "
                                "free the request's prefill blocks") from None

    def _post_runs(self, layers: list[int]) -> int:
        ids = np.array(layers, dtype=np.int64)
        local = descriptors(self.local.base, self.sender.layout, self.src_starts, self.lengths, ids,
                            self.local.device_id)
        remote = descriptors(self.remote.region.base, self.remote.layout, self.dst_starts, self.lengths, ids,
                             self.remote.region.device_id)
        self._write(local, remote, P.XferNote(self.request_id, self.notes))
        return 1

    def _post_staged(self, layers: list[int]) -> int:
        """Gather each span of these layers into our range; write it at once (CPU) or once its gather's event
        completed (GPU, in _writes_in_flight)."""
        spans = groups(layers, layers_per_write(self.plan.layer_bytes))
        stream = self.sender.stream
        for first, count in spans:
            if stream is None:
                self.copies += self.staged.gather(first, count)
                self._write_staged(first, count)
                continue
            with torch.cuda.stream(stream):
                self.copies += self.staged.gather(first, count)
                self.gathered.append((first, count, stream.record_event()))
        return len(spans)

    def _write_staged(self, first: int, count: int) -> None:
        region = self.remote.region
        self._write(*self.staged.write_rows(first, count, self.remote.staging_base, region.device_id, self.notes))

    def _write(self, local: np.ndarray, remote: np.ndarray, note) -> None:
        """One WRITE of these (addr, bytes, device) rows, with its note."""
        try:
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.local.mem_type),
                                                self.agent.get_xfer_descs(remote, self.remote.region.mem_type),
                                                self.remote.agent, P.encode(note))
            self.handles.append(handle)
            self.copies += len(local)
            self.descriptors += len(local)
            self.notes += 1
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as e:  # nixl's own exception types, turned into ours
            raise TransferError(f"request {self.request_id}: posting the NIXL write to {self.peer} failed: {e!r}; "
                                "free the request's prefill blocks") from None

    def _writes_in_flight(self) -> bool:
        while self.gathered and self.error is None and self.gathered[0][2].query():
            first, count, _ = self.gathered.popleft()
            try:
                self._write_staged(first, count)
            except TransferError as e:
                self.fail(e)
        if self.error is not None:
            self.gathered.clear()  # written no more; our range goes back once the transfer is over
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
        return bool(still or self.gathered)

    def _drop_writes(self) -> None:
        self.gathered.clear()
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
        self.staging = Staging.register(self.agent, self.kv.pool,
                                        region_bytes(self.cfg.staging_gb, self.layout.pool_bytes))

    def _attach(self, peer: Peer, welcome: P.Welcome) -> Remote:
        info = welcome.info
        try:
            self.agent.add_remote_agent(info.metadata)
            self.agent.make_connection(info.agent)
        except Exception as e:  # nixl raises its own exception types (nixlMismatchError, ...)
            raise TransferError(f"NIXL could not add the decode worker at {peer.address} ({info.agent}): {e!r}; "
                                "check UCX_TLS / UCX_NET_DEVICES on both hosts") from None
        lane = report_lane(self.ucx, self.agent.name, f"KV to {peer.address} ({info.agent})", self.region.mem_type)
        return Remote(info.agent, Region(info.base_addr, info.device_id, info.mem_type), peer.layout, lane,
                      staging_base=info.staging_addr, staging_bytes=info.staging_bytes)

    def _detach(self, peer: Peer) -> None:
        try:
            self.agent.remove_remote_agent(peer.remote.agent)
        except Exception as e:  # already gone on NIXL's side: nothing left to remove
            log.info("removing the NIXL agent of %s: %r", peer.address, e)

    def _teardown_transport(self) -> None:
        deregister(self.agent, self.reg, self.staging.reg if self.staging else None)

    def _tick(self) -> float:
        """While a finish() waits for writes in flight, poll them without a nap (a 50 us nap is ~100 us
        of sleep, 7% of a 1.8 GiB bulk write on one H200); layer mode's writes during prefill keep it."""
        wait_s = super()._tick()
        finishing = any((t.handles or t.gathered) and t.finishing is not None for p in self._connected.values()
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
