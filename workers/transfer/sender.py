"""The prefill side's endpoint, shared by all transports: one connection per decode worker (peers.py),
the handshake, and the I/O loop that moves the transfers in flight (sender_transfer.py).

Per peer, the first open() shakes hands: Hello out, Welcome (or Refused) back; the Welcome's transport
info is mapped or registered (`_attach`); a disconnect drops the peer (`_detach`) and the next open()
shakes hands again with a new Peer.

Faults stay with their peer: nothing here makes the engine thread wait on a decode worker.
    reach(peer)     READY | CONNECTING | DEAD, at once; starts the handshake if there is none. The I/O
                    thread ends a handshake at its deadline; a peer that failed one, or disconnected,
                    is DEAD for DEAD_RETRY_S (every request to it fails at once), then tried again
                    (reach(peer, fresh=True): at once, e.g. when the router introduces it anew)
    open()          a transfer (sender_transfer.py: its ladder, finish(), start_finish() and poll())
With the deployment's keys the connection is CURVE (endpoint.py): a receiver that cannot prove it
holds the worker key, or refuses ours, fails the handshake, and the peer is dropped at once with that reason.

A transport's Sender sets `transport` (its name), `info` (the TransportInfo types its receiver may
answer with), `transfer_class` (its SenderTransfer), `one_sided` (False when the receiver writes the
bytes itself, zmq: the transfer then ends at the Ack), and implements on the I/O thread:
    _attach(peer, welcome) -> remote    handshake accepted: map / register the receiver's pool; the
                                        result is peer.remote, what its transfers write into
    _detach(peer)                       optional: the peer is gone; let go of what _attach made
    _setup_transport() / _teardown_transport()   optional: once, at start / at close (a NIXL agent)
"""

from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.protocol import auth
from pdserve.protocol import kv as P
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer.base import KVSender, PeerState, Transfer
from pdserve.workers.transfer.endpoint import IDLE_S, NOW_S, Endpoint
from pdserve.workers.transfer.errors import LayoutMismatch, TransferError, layout_mismatch
from pdserve.workers.transfer.fence import process_start
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan, make_plan
from pdserve.workers.transfer.sender_transfer import SenderTransfer

log = logging.getLogger("pdserve.transfer")

ZERO_COPY_MIN = 64 * 1024  # smaller frames are cheaper to copy than to hand to ZMQ zero-copy


class ChannelSender(Endpoint, KVSender):
    transport = ""
    info: tuple[type, ...] = ()  # the P.TransportInfo types a Welcome of this transport may carry
    transfer_class: type[SenderTransfer]
    one_sided = True  # our writes land by themselves (ipc, nixl); zmq: the receiver writes what we send

    def __init__(self, kv: KVCache, cfg: TransferConfig):
        KVSender.__init__(self, kv, cfg)
        Endpoint.__init__(self, f"kv-sender-{self.transport}", cfg.keys)
        self.layout = kv.layout
        self.host = socket.gethostname()
        # host:pid:start: the receiver's fence confirms this process's death by it (receiver.SenderProcess)
        self.sender_name = f"{self.host}:{os.getpid()}:{process_start(os.getpid()) or ''}"
        self._peers: dict[str, Peer] = {}  # caller side: the latest Peer of each address
        self._connected: dict[str, Peer] = {}  # I/O thread: the Peers with a connection, by address
        self._by_sock: dict[zmq.Socket, Peer] = {}  # I/O thread: ... and by socket (its own, its monitor)
        self.stream: torch.cuda.Stream | None = None  # on GPU: the side stream of the copies (ipc, zmq)
        self._start(cfg.deadline_s)

    # ---- public (engine thread) ------------------------------------------------------------

    def connect(self, peer: str, deadline_s: float | None = None) -> None:
        """Shake hands with `peer` now and wait for it (open() does it on first use otherwise)."""
        self._connect(peer, self.cfg.deadline_s if deadline_s is None else deadline_s)

    def reach(self, peer: str, fresh: bool = False) -> tuple[PeerState, str | None]:
        """Where the handshake with `peer` stands, at once (and why, when DEAD); starts one if there is
        none. `fresh`: forget that it failed before (it registered anew) and shake hands again."""
        p = self._peers.get(peer)
        state = None if p is None else p.look(time.monotonic())
        if state is None or (fresh and state is PeerState.DEAD):
            self._handshake(peer)
            return PeerState.CONNECTING, None
        return state, p.why if state is PeerState.DEAD else None

    def open(self, request_id: str, peer: str, src_blocks: list[int], dst_blocks: list[int],
             num_tokens: int) -> Transfer:
        """Returns at once for a peer already shaken hands with (the Begin goes out on the I/O thread);
        raises at once for a DEAD one; waits for the handshake of a new one (reach() first to avoid that)."""
        state, why = self.reach(peer)
        if state is PeerState.DEAD:
            raise TransferError(f"request {request_id}: the decode worker at {peer} is unreachable ({why}); "
                                "free the request's prefill blocks and retry it on another decode worker")
        p = self._peers[peer] if state is PeerState.READY else self._connect(peer, self.cfg.deadline_s)
        plan = make_plan(request_id, src_blocks, dst_blocks, num_tokens, self.layout, p.layout)
        t = self._new_transfer(p, plan)
        self._submit(self._begin, p, t, list(dst_blocks), num_tokens)
        return t

    def close(self) -> None:
        self._stop()

    def _new_transfer(self, peer: Peer, plan: Plan) -> SenderTransfer:
        """(bench/transfer_check.py wraps this to leave runs out of a plan.)"""
        return self.transfer_class(self, peer, plan)

    # ---- for transports (I/O thread) -----------------------------------------------------------

    def _setup_transport(self) -> None: ...

    def _attach(self, peer: Peer, welcome: P.Welcome):
        """Handshake accepted: map / register the receiver's pool; returns what Peer.remote holds."""
        return welcome.info

    def _detach(self, peer: Peer) -> None: ...

    def _teardown_transport(self) -> None: ...

    # ---- handshake -------------------------------------------------------------------------

    def _connect(self, address: str, timeout_s: float) -> Peer:
        """Wait (up to timeout_s) for the handshake with `address`, starting it if none is under way."""
        p = self._peers.get(address)
        if p is None or p.look(time.monotonic()) not in (PeerState.CONNECTING, PeerState.READY):
            p = self._handshake(address)
        try:
            return p.wait(timeout_s)
        except FutureTimeout:
            self._submit(self._drop, p, "no handshake answer")
            error = TransferError(
                f"no handshake answer from the decode worker at {address} within {timeout_s:.1f} s; "
                "check that it runs, that the address is right and reachable, and that it uses the "
                f"{self.transport} transport")
            p.dead(str(error))
            raise error from None

    def _handshake(self, address: str) -> Peer:
        """A new Peer for `address`, its handshake started on the I/O thread: p.ready resolves once
        `address` answered it (or failed it, or missed its deadline: TransferError)."""
        p = self._peers[address] = Peer(address)

        def not_started(f) -> None:  # the sender is closed or broken
            if f.exception() is not None and not p.ready.done():
                p.ready.set_exception(f.exception())

        self._submit(self._hello, p).add_done_callback(not_started)
        return p

    def _hello(self, p: Peer) -> None:  # I/O thread
        old = self._connected.get(p.address)
        if old is not None:  # the caller's previous Peer of this address: its drop is always queued first
            self._drop(old, "a new handshake replaced it")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: data frames are bounded by requests in flight
        self._secure_client(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_FAILURES)
        sock.connect(p.address)
        p.sock, p.monitor = sock, monitor
        p.handshake_deadline = time.monotonic() + self.cfg.deadline_s
        self._connected[p.address] = p
        self._by_sock[sock] = self._by_sock[monitor] = p
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self.send(p, P.Hello(P.PROTOCOL_VERSION, self.transport, self.host, P.Layout.of(self.layout),
                             self.sender_name))

    def _on_welcome(self, p: Peer, msg: P.Welcome) -> None:
        theirs = KVLayout.from_wire(msg.layout)
        if msg.version != P.PROTOCOL_VERSION:
            raise TransferError(f"decode worker at {p.address} speaks protocol {msg.version}, this prefill worker "
                                f"{P.PROTOCOL_VERSION}; run the same pdserve version on both")
        if not self.layout.compatible_with(theirs):
            raise layout_mismatch(self.layout, theirs, p.address)
        if not isinstance(msg.info, self.info):
            raise TransferError(f"decode worker at {p.address} answered the {self.transport} handshake with "
                                f"{type(msg.info).__name__}")
        p.layout = theirs
        p.remote = self._attach(p, msg)
        p.ready.set_result(p)

    def _drop(self, p: Peer, reason: str) -> None:  # I/O thread
        if self._connected.get(p.address) is not p:
            return
        del self._connected[p.address]
        p.alive, p.lost = False, reason
        error = TransferError(f"decode worker at {p.address}: {reason}")
        if not p.ready.done():
            p.ready.set_exception(error)
        for t in list(p.transfers.values()):
            t.fail(TransferError(f"request {t.request_id}: decode worker at {p.address}: {reason}; free the "
                                 "request's prefill blocks and retry it on another decode worker"), reachable=False)
            t.discard()
            t.let_go()
        p.transfers.clear()
        if p.remote is not None:
            self._detach(p)
            p.remote = None  # a mapping goes with its last reference
        for s in (p.sock, p.monitor):
            self._poller.unregister(s)
            self._by_sock.pop(s, None)
        p.sock.disable_monitor()
        p.monitor.close(linger=0)
        p.sock.close(linger=0)

    # ---- the I/O thread ----------------------------------------------------------------------

    def _setup(self) -> None:
        device = self.kv.pool.device
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
        self._setup_transport()

    def _teardown(self) -> None:
        for p in list(self._connected.values()):
            self._drop(p, "the sender closed")
        self._teardown_transport()

    def _begin(self, p: Peer, t: SenderTransfer, dst_blocks: list[int], num_tokens: int) -> None:
        if not p.alive:
            t.fail(TransferError(f"request {t.request_id}: decode worker at {p.address} went away before the "
                                 "transfer began; free the request's prefill blocks"), reachable=False)
            return
        if t.request_id in p.transfers:
            t.fail(TransferError(f"request {t.request_id} is already being sent to {p.address}; use a new "
                                 "request id"), reachable=False)
            return
        p.transfers[t.request_id] = t
        self.send(p, t.begin(dst_blocks, num_tokens))

    def send(self, p: Peer, msg: msgspec.Struct, data=None) -> None:
        if data is None:
            p.sock.send(P.encode(msg))
        else:
            p.sock.send(P.encode(msg), zmq.SNDMORE)
            p.sock.send(data, copy=data.nbytes < ZERO_COPY_MIN)

    def _on_readable(self, sock: zmq.Socket) -> None:
        p = self._by_sock.get(sock)
        if p is None:
            return
        if sock is p.monitor:
            while p.monitor.poll(0):
                event = recv_monitor_message(p.monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._drop(p, "it disconnected (stopped or crashed)")
                    return
                why = auth.describe_failure(int(event["event"]), int(event["value"]), server=False)
                if why is not None:
                    log.error("KV channel to %s: %s", p.address, why)
                    self._drop(p, f"the CURVE handshake failed: {why}")
                    return
            return
        for _ in range(1000):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode_to_sender(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._drop(p, f"sent a message this version cannot read ({e}); run the same pdserve "
                           "version on both workers")
                return
            if isinstance(msg, (P.Welcome, P.Refused)):
                self._on_handshake(p, msg)
                if not p.alive:
                    return
                continue
            t = p.transfers.get(msg.request_id)
            if t is None:  # a late answer about a transfer that already ended
                if isinstance(msg, P.Cancel):  # nothing of ours is writing into those blocks
                    self.send(p, P.Abort(msg.request_id, "no transfer of this request is in flight"))
                continue
            if isinstance(msg, P.Accept):
                t.on_accept(msg.staging)
            elif isinstance(msg, P.Reject):
                t.fail(TransferError(msg.error), reachable=False)
            elif isinstance(msg, P.Ack):
                t.on_ack(msg)
            elif isinstance(msg, P.Cancel):
                t.fail(TransferError(f"request {t.request_id}: the decode worker at {p.address} stopped waiting: "
                                     f"{msg.reason}; free the request's prefill blocks"))

    def _on_handshake(self, p: Peer, msg: P.Welcome | P.Refused) -> None:
        if p.ready.done():
            return
        if isinstance(msg, P.Refused):
            error = LayoutMismatch(msg.error) if msg.kind == "layout" else TransferError(msg.error)
            p.ready.set_exception(error)
            self._drop(p, f"handshake refused: {msg.error}")
            return
        try:
            self._on_welcome(p, msg)
        except Exception as e:  # mapping or registering the peer's pool failed: that peer only
            error = e if isinstance(e, TransferError) else TransferError(
                f"decode worker at {p.address}: attaching its KV pool failed: {e!r}")
            p.ready.set_exception(error)
            self._drop(p, f"handshake failed: {error}")

    def _tick(self) -> float:
        busy = False
        now = time.monotonic()
        for p in list(self._connected.values()):
            if not p.ready.done() and now > p.handshake_deadline:
                self._drop(p, f"no handshake answer within {self.cfg.deadline_s:.1f} s (--handshake-timeout); "
                           f"check that it runs and uses the {self.transport} transport")
                continue
            for t in list(p.transfers.values()):
                t.io_step()
                if t.over:
                    p.transfers.pop(t.request_id, None)
                    t.let_go()
                else:
                    busy = busy or t.busy()
        return NOW_S if busy else IDLE_S
