"""The prefill side's endpoint, shared by all transports: one connection per decode worker,
the handshake, and the transfers in flight.

Life cycle of a transfer (Transfer.state, base.State; base.MOVES has every legal move):

    open()          OPENED        handshake with the peer if this is the first request to it; Begin sent
    Accept          TRANSFERRING  writes may go out; before it, layer_done() only queues
    finish()        LANDING       the layers left handed over (bulk: all of them); waits until they landed
    every byte in   ACKING        Done sent, waits for the Ack (deadline)
    Ack             DONE
    any failure     ABORTING      Cancel, the writes' own error, a missed deadline, abort(): TransferError to
                                  the caller; the receiver gets an Abort as soon as none of our writes can
                                  land, then FAILED
                    FAILED        Reject, Ack(ok=False), the peer disconnecting: the receiver knows, or is gone

Per peer, the first open() maps or registers the receiver's pool (`_attach`); a disconnect drops
the peer (`_detach`) and the next open() shakes hands again.

Faults stay with their peer: nothing here makes the engine thread wait on a decode worker.
    reach(peer)     READY | CONNECTING | DEAD, at once; starts the handshake if there is none. The I/O
                    thread ends a handshake at its deadline; a peer that failed one, or disconnected,
                    is DEAD for DEAD_RETRY_S (every request to it fails at once), then tried again
                    (reach(peer, fresh=True): at once, e.g. when the router introduces it anew)
    start_finish()  finish() without waiting: poll() moves it on and returns the stats once the decode
    poll()          worker acked; only local work (the copies, the hand-off of frames) runs in poll()
With the deployment's keys the connection is CURVE (endpoint.py): a receiver that cannot prove it
holds the worker key, or refuses ours, fails the handshake, and the peer is dropped at once with that reason.

A transport's Sender sets `transport` (its name), `info` (the TransportInfo types its receiver may
answer with), `transfer_class` (its SenderTransfer), `one_sided` (False when the receiver writes the
bytes itself, zmq: the transfer then ends at the Ack), and implements on the I/O thread:
    _attach(peer, welcome) -> remote    handshake accepted: map / register the receiver's pool; the
                                        result is peer.remote, what its transfers write into
    _detach(peer)                       optional: the peer is gone; let go of what _attach made
    _setup_transport() / _teardown_transport()   optional: once, at start / at close (a NIXL agent)
Its SenderTransfer implements (the base does the rest: the layer_done guard, the ladder, the
deadlines, Begin/Done/Abort, the queue below and when each step may run):
    _move(layers)           caller side: these layers' K/V are in the pool; start moving them, return
                            at once. Layer mode: from layer_done(), then once from finish() with the
                            layers left; bulk: once, from finish(), with every layer. Default: queue
                            (layers, an event on the compute stream) for _post
    _post(what) -> int      I/O thread, in order, once the decode worker accepted and what's event
                            completed: start the writes of one queued item; returns how many writes
                            the receiver counts (Done.writes: NIXL notifications, zmq frames)
    _landed(deadline)       optional, caller side, after the last _move: a Future resolved once every
                            byte landed, or None if they have by the return. Default: a Future the
                            I/O thread resolves once the queue is posted and no write is in flight
    _writes_in_flight()     optional, I/O thread, each loop: check the writes in flight (fail() on an
                            error); True while any is. Default: `last_event` (a CUDA event recorded
                            after the last copy, for transports that copy on a stream) not complete.
                            polls_writes = True: the loop polls them without a nap (NIXL)
    _drop_writes()          optional, I/O thread: the peer is gone; release whatever is in flight
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.protocol import auth
from pdserve.protocol import kv as P
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer.base import LIVE, MOVES, WRITING, KVSender, PeerState, State, Transfer, TransferStats
from pdserve.workers.transfer.endpoint import IDLE_S, NOW_S, Endpoint
from pdserve.workers.transfer.errors import IllegalMove, LayoutMismatch, TransferError, layout_mismatch
from pdserve.workers.transfer.integrity import block_checksums
from pdserve.workers.transfer.fence import process_start
from pdserve.workers.transfer.plan import Plan, make_plan

log = logging.getLogger("pdserve.transfer")

ZERO_COPY_MIN = 64 * 1024  # smaller frames are cheaper to copy than to hand to ZMQ zero-copy
DEAD_RETRY_S = 5.0  # a peer that failed its handshake or went away: requests to it fail at once this long


class Peer:
    """One decode worker this sender talks to (I/O thread only, except `ready`)."""

    def __init__(self, address: str, sock: zmq.Socket, monitor: zmq.Socket):
        self.address = address
        self.sock = sock
        self.monitor = monitor
        self.ready: Future = Future()  # -> self, once the handshake is done
        self.layout: KVLayout | None = None
        self.remote = None  # what the transport attached: a mapped pool, a NIXL agent name
        self.transfers: dict[str, "SenderTransfer"] = {}
        self.alive = True  # False once dropped; the caller side then shakes hands again
        self.lost: str | None = None  # why it was dropped
        self.handshake_deadline = 0.0  # time.monotonic(); the I/O thread drops a peer still silent then


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
        self._peers: dict[str, Peer] = {}  # I/O thread
        self._known: dict[str, Peer] = {}  # caller side: peers past their handshake
        self._pending: dict[str, Future] = {}  # caller side: handshakes under way -> Future[Peer]
        self._dead: dict[str, tuple[str, float]] = {}  # caller side: peer -> (why, time.monotonic())
        self._by_sock: dict[zmq.Socket, Peer] = {}
        self.stream: torch.cuda.Stream | None = None  # on GPU: the side stream of the copies (ipc, zmq)
        self._start(cfg.deadline_s)

    # ---- public (engine thread) ------------------------------------------------------------

    def connect(self, peer: str, deadline_s: float | None = None) -> None:
        """Shake hands with `peer` now and wait for it (open() does it on first use otherwise)."""
        self._connect(peer, self.cfg.deadline_s if deadline_s is None else deadline_s)

    def reach(self, peer: str, fresh: bool = False) -> tuple[PeerState, str | None]:
        """Where the handshake with `peer` stands, at once (and why, when DEAD); starts one if there is
        none. `fresh`: forget that it failed before (it registered anew) and shake hands again."""
        now = time.monotonic()
        if fresh:
            self._dead.pop(peer, None)
        p = self._known.get(peer)
        if p is not None:
            if p.alive:
                return PeerState.READY, None
            del self._known[peer]
            self._dead[peer] = (p.lost or "it went away", now)
            if fresh:
                self._dead.pop(peer)
        fut = self._pending.get(peer)
        if fut is not None:
            if not fut.done():
                return PeerState.CONNECTING, None
            del self._pending[peer]
            try:
                self._known[peer] = fut.result()
                return PeerState.READY, None
            except TransferError as e:
                self._dead[peer] = (str(e), now)
        dead = self._dead.get(peer)
        if dead is not None and now - dead[1] < DEAD_RETRY_S:
            return PeerState.DEAD, dead[0]
        self._dead.pop(peer, None)
        self._pending[peer] = self._handshake(peer)
        return PeerState.CONNECTING, None

    def open(self, request_id: str, peer: str, src_blocks: list[int], dst_blocks: list[int],
             num_tokens: int) -> Transfer:
        """Returns at once for a peer already shaken hands with (the Begin goes out on the I/O thread);
        raises at once for a DEAD one; waits for the handshake of a new one (reach() first to avoid that)."""
        state, why = self.reach(peer)
        if state is PeerState.DEAD:
            raise TransferError(f"request {request_id}: the decode worker at {peer} is unreachable ({why}); "
                                "free the request's prefill blocks and retry it on another decode worker")
        p = self._known[peer] if state is PeerState.READY else self._connect(peer, self.cfg.deadline_s)
        plan = make_plan(request_id, src_blocks, dst_blocks, num_tokens, self.layout, p.layout)
        t = self._new_transfer(p, plan)
        self._submit(self._begin, p, t, list(dst_blocks), num_tokens)
        return t

    def close(self) -> None:
        self._stop()

    def _new_transfer(self, peer: Peer, plan: Plan) -> SenderTransfer:
        """(bench/transfer/check.py wraps this to leave runs out of a plan.)"""
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
        fut = self._pending.pop(address, None) or self._handshake(address)
        try:
            p = fut.result(timeout=max(timeout_s, 0.001))
        except FutureTimeout:
            self._submit(self._drop, address, "no handshake answer")
            error = TransferError(
                f"no handshake answer from the decode worker at {address} within {timeout_s:.1f} s; "
                "check that it runs, that the address is right and reachable, and that it uses the "
                f"{self.transport} transport")
            self._dead[address] = (str(error), time.monotonic())
            raise error from None
        except TransferError as e:
            self._dead[address] = (str(e), time.monotonic())
            raise
        self._dead.pop(address, None)
        self._known[address] = p
        return p

    def _handshake(self, address: str) -> Future:
        """Future[Peer]: resolved by the I/O thread once `address` answered the handshake (or failed it,
        or missed its deadline: TransferError)."""
        out: Future = Future()

        def relay(ready: Future) -> None:
            if ready.exception() is not None:
                out.set_exception(ready.exception())
            else:
                out.set_result(ready.result())

        def start() -> None:  # I/O thread
            self._peer(address).add_done_callback(relay)

        def not_started(f: Future) -> None:  # the sender is closed or broken
            if f.exception() is not None and not out.done():
                out.set_exception(f.exception())

        self._submit(start).add_done_callback(not_started)
        return out

    def _peer(self, address: str) -> Future:  # I/O thread
        p = self._peers.get(address)
        if p is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: data frames are bounded by requests in flight
            self._secure_client(sock)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_FAILURES)
            sock.connect(address)
            p = Peer(address, sock, monitor)
            p.handshake_deadline = time.monotonic() + self.cfg.deadline_s
            self._peers[address] = p
            self._by_sock[sock] = self._by_sock[monitor] = p
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
            self.send(p, P.Hello(P.PROTOCOL_VERSION, self.transport, self.host, P.Layout.of(self.layout),
                                 self.sender_name))
        return p.ready

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

    def _drop(self, address: str, reason: str) -> None:  # I/O thread
        p = self._peers.pop(address, None)
        if p is None:
            return
        p.alive, p.lost = False, reason
        error = TransferError(f"decode worker at {address}: {reason}")
        if not p.ready.done():
            p.ready.set_exception(error)
        for t in list(p.transfers.values()):
            t.fail(TransferError(f"request {t.request_id}: decode worker at {address}: {reason}; free the "
                                 "request's prefill blocks and retry it on another decode worker"), reachable=False)
            t.discard()
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
        for address in list(self._peers):
            self._drop(address, "the sender closed")
        self._teardown_transport()

    def _begin(self, p: Peer, t: "SenderTransfer", dst_blocks: list[int], num_tokens: int) -> None:
        if not p.alive:
            t.fail(TransferError(f"request {t.request_id}: decode worker at {p.address} went away before the "
                                 "transfer began; free the request's prefill blocks"), reachable=False)
            return
        if t.request_id in p.transfers:
            t.fail(TransferError(f"request {t.request_id} is already being sent to {p.address}; use a new "
                                 "request id"), reachable=False)
            return
        p.transfers[t.request_id] = t
        self.send(p, P.Begin(t.request_id, dst_blocks, num_tokens))

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
                    self._drop(p.address, "it disconnected (stopped or crashed)")
                    return
                why = auth.describe_failure(int(event["event"]), int(event["value"]), server=False)
                if why is not None:
                    log.error("KV channel to %s: %s", p.address, why)
                    self._drop(p.address, f"the CURVE handshake failed: {why}")
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
                self._drop(p.address, f"sent a message this version cannot read ({e}); run the same pdserve "
                           "version on both workers")
                return
            if isinstance(msg, (P.Welcome, P.Refused)):
                self._on_handshake(p, msg)
                if p.address not in self._peers:
                    return
                continue
            t = p.transfers.get(msg.request_id)
            if t is None:  # a late answer about a transfer that already ended
                if isinstance(msg, P.Cancel):  # nothing of ours is writing into those blocks
                    self.send(p, P.Abort(msg.request_id, "no transfer of this request is in flight"))
                continue
            if isinstance(msg, P.Accept):
                t.on_accept()
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
            self._drop(p.address, f"handshake refused: {msg.error}")
            return
        try:
            self._on_welcome(p, msg)
        except Exception as e:  # mapping or registering the peer's pool failed: that peer only
            error = e if isinstance(e, TransferError) else TransferError(
                f"decode worker at {p.address}: attaching its KV pool failed: {e!r}")
            p.ready.set_exception(error)
            self._drop(p.address, f"handshake failed: {error}")

    def _tick(self) -> float:
        busy = False
        now = time.monotonic()
        for p in list(self._peers.values()):
            if not p.ready.done() and now > p.handshake_deadline:
                self._drop(p.address, f"no handshake answer within {self.cfg.deadline_s:.1f} s (--handshake-timeout); "
                           f"check that it runs and uses the {self.transport} transport")
                continue
            for t in list(p.transfers.values()):
                t.io_step()
                if t.over:
                    p.transfers.pop(t.request_id, None)
                else:
                    busy = busy or t.busy()
        return NOW_S if busy else IDLE_S


class SenderTransfer(Transfer):
    """The ladder, the finish/abort template and the I/O thread's queue, shared by every transport's transfer."""

    polls_writes = False  # nixl: writes in flight need polling without a nap (check_xfer_state)

    def __init__(self, sender: ChannelSender, peer: Peer, plan: Plan):
        self.request_id = plan.request_id
        self.peer = peer.address
        self.sender, self.p, self.plan = sender, peer, plan
        self.cfg = sender.cfg
        self.src = sender.kv.pool
        self.layered = sender.cfg.mode == "layer"
        self.state = State.OPENED  # moved only by _transition (under lock; `moved` wakes finish())
        self.error: TransferError | None = None  # ABORTING, FAILED: why
        self.lock = threading.RLock()
        self.moved = threading.Condition(self.lock)
        self.started_at = 0.0
        self.finished_at = 0.0
        self.copies = 0
        self.writes = 0  # I/O thread: what the receiver counts (sum of _post's)
        self.last_event: torch.cuda.Event | None = None  # a timed CUDA event after the last copy, if any
        self.layers_sent: set[int] = set()
        self.layers_before_finish = 0
        self.queue: collections.deque = collections.deque()  # I/O thread: (what, ready event) for _post
        self.finishing: Future | None = None  # I/O thread: the default _landed()'s, resolved once all landed
        self._in_flight = False  # I/O thread: _writes_in_flight() at the last step
        self.landing: Future | None = None  # caller side, LANDING: _landed()'s, while not resolved
        self._first_token = -1
        self._deadline = 0.0  # start_finish(): time.monotonic() by which the decode worker must have acked

    # ---- caller side -----------------------------------------------------------------------

    def layer_done(self, layer: int) -> None:
        if not self.layered or layer in self.layers_sent or self.state not in LIVE:
            return
        self.layers_sent.add(layer)
        self._move([layer])

    def finish(self, first_token: int, deadline_s: float | None = None) -> TransferStats:
        """start_finish(), then wait for each answer of the decode worker until poll() is done."""
        self.start_finish(first_token, deadline_s)
        while True:
            seen = self.state
            stats = self.poll()
            if stats is not None:
                return stats
            left = max(self._deadline - time.monotonic(), 0.0)
            if self.landing is not None:
                try:
                    self.landing.result(timeout=left)
                except Exception:
                    pass  # poll() says what happened
            else:
                with self.moved:
                    self.moved.wait_for(lambda: self.state is not seen, left)

    def wait_accepted(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) for the receiver's Accept: True once it came, False on a failure or timeout."""
        with self.moved:
            self.moved.wait_for(lambda: self.state is not State.OPENED, timeout_s)
            return self.state in WRITING or self.state is State.DONE

    def start_finish(self, first_token: int, deadline_s: float | None = None) -> None:
        """Prefill is over: move what is left once the decode worker accepted, then tell it "kv done";
        returns at once, poll() does the rest."""
        self._first_token = first_token
        self._deadline = time.monotonic() + (self.cfg.deadline_s if deadline_s is None else deadline_s)
        self.layers_before_finish = len(self.layers_sent)

    def poll(self) -> TransferStats | None:
        """None while an answer of the decode worker is due (its accept, its ack); the stats once it
        acked. Raises TransferError on a failure or past the deadline. Never waits for the peer: only
        local work runs here (the copies, the hand-off of frames to the I/O thread)."""
        if not self._deadline:
            raise IllegalMove(f"request {self.request_id}: poll() before start_finish()")
        try:
            self.raise_if_failed()
            if self.state is State.OPENED:
                return self._due("the decode worker's accept")
            if self.state is State.TRANSFERRING:
                rest = [layer for layer in range(self.plan.num_layers) if layer not in self.layers_sent]
                self.layers_sent.update(rest)
                if rest:
                    self._move(rest)
                self._transition("land")
                self.landing = self._landed(self._deadline)
            if self.state is State.LANDING:  # the writes are posted: wait for them without blocking
                if self.landing is not None:
                    if not self.landing.done():
                        return self._due("completion of the KV writes")
                    self.landing.result()  # raises the failure that resolved it
                    self.landing = None
                self._transition("send_done")
                done = P.Done(self.request_id, self._first_token, self.plan.num_bytes, self.started_at,
                              self.finished_at, self.writes, self._checksums())
                self.sender._submit(self.sender.send, self.p, done)
            if self.state is State.ACKING:
                return self._due("the decode worker's ack of the done notice")
            self.raise_if_failed()
        except TransferError as e:
            self.fail(e)
            raise self.error from None
        return self.stats()

    def _checksums(self) -> list[int]:
        """--kv-checksum: a digest of each source block, in the order of the destination blocks."""
        if not self.cfg.checksum:
            return []
        return block_checksums(self.src, [s + k for s, _, n in self.plan.runs for k in range(n)])

    def _due(self, name: str) -> None:
        """Still waiting for `name`: None, or TransferError once the deadline passed."""
        if time.monotonic() < self._deadline:
            return None
        raise TransferError(f"request {self.request_id}: no {name} within the deadline (decode worker {self.peer}); "
                            "check that it is alive and reachable; free the request's prefill blocks")

    def abort(self, reason: str) -> None:
        self.fail(TransferError(f"request {self.request_id}: aborted by the prefill worker: {reason}"))

    def stats(self) -> TransferStats:
        return TransferStats(self.plan.num_bytes, self.started_at, self.finished_at, copies=self.copies,
                             layers_sent_before_finish=self.layers_before_finish, runs=len(self.plan.runs),
                             done_event=self.last_event)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def mark_started(self) -> None:
        if not self.started_at:
            self.started_at = time.time()

    def mark(self) -> torch.cuda.Event | None:
        """On GPU: an event on the compute stream where the K/V written so far are complete; whatever
        moves them waits for it (a side stream, or the I/O thread's query), the compute stream never waits."""
        if self.src.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.src.device))
        return ready

    # ---- either thread ---------------------------------------------------------------------

    def _transition(self, name: str) -> None:
        """Take move `name` of base.MOVES; from a failed state, raise the failure instead."""
        to, sources = MOVES[name]
        with self.lock:
            if self.state not in sources:
                self.raise_if_failed()
                allowed = ", ".join(sorted(s.value for s in sources))
                raise IllegalMove(f"request {self.request_id}: cannot {name.replace('_', ' ')} while "
                                  f"{self.state.value} (to {to.value} only from: {allowed})")
            self.state = to
            self.moved.notify_all()

    def fail(self, error: TransferError, reachable: bool = True) -> None:
        """Record the first failure (none once DONE); unless the receiver is gone or already knows, it
        gets an Abort once our writes have stopped (ABORTING, the I/O thread's io_step)."""
        with self.lock:
            if self.state not in LIVE:
                return
            self.error = error
            self._transition("fail" if reachable else "fail_quietly")
        self.sender._submit(_wake)  # the I/O thread: the Abort may be due, or the transfer over

    # ---- I/O thread ------------------------------------------------------------------------

    def on_accept(self) -> None:
        with self.lock:
            if self.state is State.OPENED:
                self._transition("accept")

    def on_ack(self, msg: P.Ack) -> None:
        if not msg.ok:
            self.fail(TransferError(f"request {self.request_id}: the decode worker at {self.peer} refused the "
                                    f"done notice: {msg.error}; free the request's prefill blocks"), reachable=False)
            return
        with self.lock:
            if self.state is State.ACKING:
                if not self.sender.one_sided:  # the bytes landed when the receiver wrote them
                    self.finished_at = time.time()
                self._transition("acked")

    def io_step(self) -> None:
        """Each loop: post what is ready (once accepted, none after a failure), check what is in flight,
        resolve the finish once all landed, tell the receiver of a failure once no write of ours can land."""
        if self.state in WRITING:
            while self.queue and (self.queue[0][1] is None or self.queue[0][1].query()):
                what, _ = self.queue.popleft()
                try:
                    self.writes += self._post(what)
                except TransferError as e:
                    self.fail(e)
                    break
        self._in_flight = self._writes_in_flight()
        if self.finishing is not None and not self.finishing.done() and self.state in WRITING \
                and not self.queue and not self._in_flight:
            self.finished_at = time.time()
            self.finishing.set_result(None)
        if self.state is State.ABORTING and not self._in_flight:
            self.sender.send(self.p, P.Abort(self.request_id, str(self.error)))
            self._transition("aborted")

    @property
    def over(self) -> bool:
        """Nothing more to do on the I/O thread: forget it."""
        return self.state is State.DONE or self.state is State.FAILED

    def busy(self) -> bool:
        """The loop should come back without a nap: posts waiting on a GPU event, NIXL writes in flight,
        an Abort waiting for the last write."""
        queued = bool(self.queue) and self.state in WRITING
        return queued or (self._in_flight and (self.polls_writes or self.state is State.ABORTING))

    def discard(self) -> None:
        """The peer is gone: forget what is queued, release what is in flight."""
        self.queue.clear()
        self._drop_writes()

    def _finish_io(self, fut: Future) -> None:
        self.finishing = fut

    # ---- transports ------------------------------------------------------------------------

    def _move(self, layers: list[int]) -> None:
        """Caller side: these layers' K/V are in the pool (on GPU: enqueued on the current stream);
        start moving them, return at once. Default: queue them for _post behind an event."""
        self.sender._submit(self.queue.append, (layers, self.mark()))

    def _post(self, what) -> int:
        """I/O thread: start the writes of one queued item; how many the receiver counts."""
        raise NotImplementedError

    def _landed(self, deadline: float) -> Future | None:
        """Caller side, after the last _move: a Future resolved (on the I/O thread) once every byte
        landed, or None if they have by the return; finished_at set by then."""
        fut: Future = Future()
        self.sender._submit(self._finish_io, fut)
        return fut  # poll() waits for it without blocking the worker's loop

    def _writes_in_flight(self) -> bool:
        """I/O thread, each loop: are writes still in flight (fail() the transfer if one failed)?"""
        return self.last_event is not None and not self.last_event.query()

    def _drop_writes(self) -> None:
        """I/O thread: the peer is gone; let go of whatever is still in flight."""


def _wake() -> None: ...
