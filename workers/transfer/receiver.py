"""The decode side's endpoint, shared by all transports: handshake, reservations, deadlines, arrivals.

Life cycle of an expected transfer (Expected.state, a ReceiveState; on the receiver's I/O thread):

    expect()            WAITING     blocks reserved; a Begin naming other blocks, or an id not expected, is rejected
    Begin               ACCEPTED    Accept sent: the sender may write into the blocks now; began() reports it
    Done, data landed               -> Arrival(ok=True, first_token) and Ack(ok)
    Abort                           -> Arrival(ok=False, the sender's reason)
    deadline or cancel() WAITING    -> Arrival(ok=False) at once
                        ACCEPTED    zmq (we do the writes): Arrival(ok=False) once our writes in progress
                                    finished, Cancel to the sender
                                    ipc, nixl (the sender writes into our pool): Cancel, then CANCELLING
                        CANCELLING  Arrival(ok=False, released=False) at once (the request fails, its
                                    blocks stay held), then the fence: the sender's Abort (sent once none
                                    of its writes can land), its Done, or its process's death confirmed
                                    (_sender_gone) -> Arrival(ok=False) (released: the blocks may go);
                                    past cancel_grace_s a warning says which blocks wait. A disconnect is
                                    no fence: a process that lost its socket may still write into our pool.

With --kv-checksum the Done carries a digest of every block and the arrival is refused on a difference
(integrity.py). Counted for the heartbeat (figures()): fenced waits, blocks held by a fence now,
integrity failures.

A transport's Receiver sets `transport` (its name) and implements, all on the I/O thread:
    _transport_info(hello) -> P.TransportInfo   what the sender needs to reach the pool (the Welcome);
                                raise TransferError to refuse this sender (another host, for ipc)
and where it needs them:
    _setup_transport() / _teardown_transport()   once, at start / at close (export or register the pool)
    _write_chunk(exp, chunk, data)  one_sided = False (zmq): the bytes come as data frames, this side
                                writes each into the reserved blocks; the base checks every frame
                                (each of its runs) against the reservation first (frames.refusal),
                                and the frame and byte counts against the Done before the arrival;
                                set `stream` when the writes go on a CUDA stream (synchronised
                                before the arrival is reported)
    _progress()                 needs_progress = True (nixl): each loop; count each write's notification
                                into exp.received: the arrival waits for Done.writes of them
    _accept(exp, begin) -> P.Accept   the answer to an accepted Begin (nixl: with a staging grant when the
                                Begin asks for one and there is room); whatever it holds for the request
                                goes back in _report, the one place every transfer ends
    _landed(exp) -> bool        the Done is in: have all its bytes landed (default: one-sided, once
                                Done.writes notifications came; zmq and nixl's staging add their writes)

Why this module keeps a table of its own (`_expected`) beside the engine's requests: it is not a
second record of which requests exist or where they stand (that is the engine's Request.status,
RESERVED -> RECEIVING -> RUNNING, moved by the decode role from what poll() and began() report),
but of where each *transfer* stands on the wire, and the two differ in owner and in life:
- Owner: the I/O thread answers a sender's Begin, Chunk and Done the moment they land, while the
  main thread may be inside a decode step; it cannot read the engine's dict (single-threaded by
  design) without a lock around every engine call. Its entries hold only what the wire needs:
  the blocks a sender may name, the sender's identity, the Done, bytes and chunks received, the
  deadline, why it gave up; touched under this module's lock and handed over as Arrivals.
- Life: an entry outlives the request's RESERVED/RECEIVING states when it must. An aborted request
  is CANCELLING in the engine while its entry keeps refusing and cancelling late writes, until no
  write can land; only then does poll() report it and the blocks go back.
The role never reads the table; the table never learns the request's status.
"""

from __future__ import annotations

import collections
import enum
import logging
import socket
import threading
import time

import msgspec
import zmq

from pdserve.protocol import kv as P
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.base import Arrival, KVReceiver
from pdserve.workers.transfer.errors import TransferError, layout_mismatch
from pdserve.workers.transfer.endpoint import IDLE_S, MOVING_S, NOW_S, Endpoint
from pdserve.workers.transfer.fence import MAX_SENDERS, SenderProcess
from pdserve.workers.transfer.integrity import first_mismatch

log = logging.getLogger("pdserve.transfer")


class ReceiveState(enum.Enum):
    """Where an expected transfer stands on the receiving side (the life cycle above)."""

    WAITING = "waiting"
    ACCEPTED = "accepted"
    CANCELLING = "cancelling"


class Expected:
    """One reservation waiting for its KV (touched under the receiver's lock)."""

    def __init__(self, request_id: str, dst_blocks: list[int], deadline_s: float):
        self.request_id = request_id
        self.dst_blocks = list(dst_blocks)
        self.block_set = frozenset(dst_blocks)
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s
        self.state = ReceiveState.WAITING
        self.sender: bytes | None = None  # ROUTER identity of the sender that began it
        self.done: P.Done | None = None
        self.received = 0  # zmq: chunks written; nixl: notifications seen
        self.received_bytes = 0
        self.give_up: str | None = None  # why we stopped waiting (deadline, cancel, bad data)
        self.grace_deadline = 0.0
        self.overdue = False  # CANCELLING past its grace: warned once


class ChannelReceiver(Endpoint, KVReceiver):
    transport = ""
    one_sided = True  # the sender writes into our pool itself (ipc, nixl); zmq: this side writes
    needs_progress = False  # nixl: the agent must be polled while data moves
    stream = None  # a CUDA stream _write_chunk writes on (zmq on GPU)

    def __init__(self, kv: KVCache, cfg: TransferConfig):
        KVReceiver.__init__(self, kv, cfg)
        Endpoint.__init__(self, f"kv-receiver-{self.transport}", cfg.keys)
        self.layout = kv.layout
        self.host = socket.gethostname()
        self.address = ""
        self._lock = threading.Lock()
        self._expected: dict[str, Expected] = {}
        self._arrivals: list[Arrival] = []  # each stamped with reported_at: token 1's pickup starts there
        self._began: list[str] = []  # Begins accepted since the last began()
        self._senders: collections.OrderedDict[bytes, SenderProcess] = collections.OrderedDict()  # I/O thread
        self.fenced_waits = 0  # transfers given up on that had to wait for their fence
        self.integrity_failures = 0  # arrivals refused: a block differed from the sender's checksum
        self._start(cfg.deadline_s)

    # ---- public (engine thread) ------------------------------------------------------------

    def expect(self, request_id: str, dst_blocks: list[int], deadline_s: float | None = None) -> None:
        if not dst_blocks:
            raise TransferError(f"request {request_id}: expect() needs the reserved block ids, got none")
        bad = [b for b in dst_blocks if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise TransferError(f"request {request_id}: blocks {bad[:5]} outside the pool of {self.layout.num_blocks}")
        with self._lock:
            if self._broken is not None:
                raise TransferError(f"request {request_id}: the KV receiver is broken ({self._broken}); restart the worker")
            if request_id in self._expected:
                raise TransferError(f"request {request_id} is already expected; use a new request id")
            deadline_s = self.cfg.deadline_s if deadline_s is None else deadline_s
            self._expected[request_id] = Expected(request_id, dst_blocks, deadline_s)

    def poll(self) -> list[Arrival]:
        with self._lock:
            if self._broken is not None:  # the I/O thread is gone: fail everything still waiting; blocks a
                for exp in self._expected.values():  # sender may still write into stay held for good
                    held = self.one_sided and exp.state is not ReceiveState.WAITING
                    self._arrivals.append(Arrival(exp.request_id, False, error=f"request {exp.request_id}: "
                                                  f"the KV receiver failed ({self._broken})",
                                                  reported_at=time.monotonic(), released=not held))
                self._expected.clear()
            out, self._arrivals = self._arrivals, []
        return out

    def began(self) -> list[str]:
        with self._lock:
            out, self._began = self._began, []
        return out

    def cancel(self, request_id: str) -> None:
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is not None and exp.give_up is None:
                exp.give_up = f"request {request_id}: cancelled on the decode worker"
        self._submit(lambda: None)  # wake the I/O thread

    def figures(self) -> tuple[int, int, int]:
        """(fenced waits so far, blocks a fence holds now, integrity failures so far)"""
        with self._lock:
            held = sum(len(e.dst_blocks) for e in self._expected.values() if e.state is ReceiveState.CANCELLING)
        return self.fenced_waits, held, self.integrity_failures

    def close(self) -> None:
        self._stop()

    # ---- transport hooks (I/O thread) --------------------------------------------------------

    def _setup_transport(self) -> None: ...

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        raise NotImplementedError

    def _write_chunk(self, exp: Expected, chunk: P.Chunk, data: memoryview) -> None:
        raise TransferError(f"request {chunk.request_id}: the {self.transport} transport takes no data frames")

    def _progress(self) -> None: ...

    def _accept(self, exp: Expected, begin: P.Begin) -> P.Accept:
        return P.Accept(exp.request_id)

    def _teardown_transport(self) -> None: ...

    # ---- the I/O thread ----------------------------------------------------------------------

    def _setup(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a sender that is gone raises EHOSTUNREACH
        sock.setsockopt(zmq.RCVHWM, 0)
        self._secure_server(sock)  # CURVE with the deployment's keys (endpoint.py)
        if self.cfg.port:
            sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
            port = self.cfg.port
        else:
            port = sock.bind_to_random_port(f"tcp://{self.cfg.host}")
        self.address = f"tcp://{self.cfg.host}:{port}"
        self._sock = sock
        self._poller.register(sock, zmq.POLLIN)
        self._setup_transport()

    def _teardown(self) -> None:
        self._teardown_transport()
        for proc in self._senders.values():
            proc.close()

    def _on_readable(self, sock: zmq.Socket) -> None:
        for _ in range(1000):  # bounded, so deadlines and progress still get their turn
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue  # not one of ours: a message has at least the identity and a header
            ident, header, data = frames[0].bytes, frames[1].buffer, frames[2:]
            try:
                msg = P.decode_to_receiver(header)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._send(ident, P.Refused("version", f"decode worker at {self.address} could not read a message "
                                            f"({e}); run the same pdserve version (protocol {P.PROTOCOL_VERSION}) on both workers"))
                continue
            if isinstance(msg, P.Hello):
                self._on_hello(ident, msg)
            elif isinstance(msg, P.Begin):
                self._on_begin(ident, msg)
            elif isinstance(msg, P.Chunk):
                self._on_chunk(ident, msg, data[0].buffer if data else memoryview(b""))
            elif isinstance(msg, P.Done):
                self._on_done(ident, msg)
            elif isinstance(msg, P.Abort):
                self._on_abort(ident, msg)

    def _on_hello(self, ident: bytes, hello: P.Hello) -> None:
        theirs = KVLayout.from_wire(hello.layout)
        if hello.version != P.PROTOCOL_VERSION:
            refusal = P.Refused("version", f"protocol version {hello.version} (prefill {hello.sender}) vs "
                                f"{P.PROTOCOL_VERSION} (decode {self.address}); run the same pdserve version on both")
        elif hello.transport != self.transport:
            refusal = P.Refused("transport", f"prefill worker {hello.sender} uses transport {hello.transport!r}, "
                                f"decode worker {self.address} uses {self.transport!r}; start both with the same one")
        elif not theirs.compatible_with(self.layout):
            refusal = P.Refused("layout", str(layout_mismatch(theirs, self.layout, self.address)))
        else:
            try:
                info = self._transport_info(hello)
            except (TransferError, RuntimeError) as e:  # other host, or the pool cannot be exported
                refusal = P.Refused("host", str(e))
            else:
                if self.one_sided:
                    self._remember(ident, SenderProcess(hello.sender, self.host))
                self._send(ident, P.Welcome(P.PROTOCOL_VERSION, self.host, P.Layout.of(self.layout), info))
                return
        log.warning("refused a handshake: %s", refusal.error)
        self._send(ident, refusal)

    def _remember(self, ident: bytes, proc: SenderProcess) -> None:
        old = self._senders.pop(ident, None)
        if old is not None:
            old.close()
        self._senders[ident] = proc
        while len(self._senders) > MAX_SENDERS:
            self._senders.popitem(last=False)[1].close()

    def _sender_gone(self, exp: Expected) -> bool:
        """The fence a receiver controls: the sender's process is confirmed dead (no write of it can land)."""
        proc = self._senders.get(exp.sender)
        return proc is not None and proc.gone()

    def _on_begin(self, ident: bytes, msg: P.Begin) -> None:
        rid = msg.request_id
        with self._lock:
            exp = self._expected.get(rid)
            if exp is None or exp.give_up is not None:
                error = (f"decode worker at {self.address} is not waiting for request {rid} (not reserved there, "
                         "cancelled, or past its deadline); free the prefill blocks and retry the request")
            elif exp.state is not ReceiveState.WAITING:
                error = f"request {rid} is already being sent by another transfer"
            elif exp.dst_blocks != list(msg.dst_blocks):
                error = (f"request {rid}: the transfer names destination blocks {msg.dst_blocks[:8]}..., the "
                         f"reservation holds {exp.dst_blocks[:8]}...; pass the block ids reserve() returned")
            else:
                exp.state, exp.sender, error = ReceiveState.ACCEPTED, ident, None
                self._began.append(rid)
        self._send(ident, P.Reject(rid, error) if error else self._accept(exp, msg))

    def _on_chunk(self, ident: bytes, chunk: P.Chunk, data: memoryview) -> None:
        with self._lock:
            exp = self._expected.get(chunk.request_id)
        if exp is None or exp.state is not ReceiveState.ACCEPTED or exp.sender != ident or exp.give_up:
            return  # late frames of a request we gave up on: dropped, never written
        bad = frames.refusal(chunk, data.nbytes, self.layout, exp.block_set)
        if bad is not None:
            self._give_up(exp, f"request {chunk.request_id}: bad data frame: {bad}")
            return
        try:
            self._write_chunk(exp, chunk, data)
        except (TransferError, RuntimeError) as e:  # a frame we cannot place fails its request, not the receiver
            self._give_up(exp, f"request {chunk.request_id}: could not write a data frame: {e}")
            return
        exp.received += 1
        exp.received_bytes += data.nbytes

    def _on_done(self, ident: bytes, msg: P.Done) -> None:
        with self._lock:
            exp = self._expected.get(msg.request_id)
        if exp is None or exp.sender != ident:
            self._send(ident, P.Ack(msg.request_id, False, f"decode worker at {self.address} is not waiting for "
                                    f"request {msg.request_id} any more (deadline passed or cancelled)"))
        elif exp.state is ReceiveState.CANCELLING:  # it finished before it saw our Cancel: no more writes
            self._send(ident, P.Ack(msg.request_id, False, exp.give_up))
            self._report(exp, Arrival(exp.request_id, False, error=exp.give_up))
        else:
            exp.done = msg

    def _on_abort(self, ident: bytes, msg: P.Abort) -> None:
        with self._lock:
            exp = self._expected.get(msg.request_id)
        if exp is not None and exp.sender == ident:
            error = exp.give_up or f"request {msg.request_id}: the prefill worker gave up: {msg.reason}"
            self._report(exp, Arrival(exp.request_id, False, error=error))

    def _tick(self) -> float:
        self._progress()
        now = time.monotonic()
        with self._lock:
            pending = list(self._expected.values())
        wait_s = IDLE_S
        for exp in pending:
            if exp.give_up is None and exp.state is ReceiveState.ACCEPTED and exp.done is not None \
                    and self._landed(exp):
                self._arrive(exp)
                continue
            if exp.give_up is None and now > exp.deadline:
                exp.give_up = (f"request {exp.request_id}: its KV did not arrive within {exp.deadline_s:.1f} s "
                               f"({exp.state.value}); free its blocks")
            if exp.give_up is not None and exp.state is not ReceiveState.CANCELLING:
                self._give_up(exp, exp.give_up)
            elif exp.state is ReceiveState.CANCELLING and self._sender_gone(exp):
                self._report(exp, Arrival(exp.request_id, False, error=f"{exp.give_up} (the prefill worker's "
                                          "process exited)"))
            elif exp.state is ReceiveState.CANCELLING and now > exp.grace_deadline and not exp.overdue:
                exp.overdue = True
                log.warning("request %s: the prefill worker did not confirm within %.1f s that it stopped writing "
                            "into %d blocks; they stay held until it does or its process exits",
                            exp.request_id, self.cfg.cancel_grace_s, len(exp.dst_blocks))
            elif self.needs_progress and exp.state is not ReceiveState.WAITING:
                # data moving: make progress now and then; once the Done is in, watch for the last notes
                wait_s = min(wait_s, NOW_S if exp.done is not None else MOVING_S)
        return wait_s

    def _landed(self, exp: Expected) -> bool:
        """exp.done is in: have all its bytes landed? One-sided writes, once their notifications are in
        (ipc has none: Done.writes is 0); data frames came before the Done on the same connection."""
        return not self.one_sided or exp.received >= exp.done.writes

    def _arrive(self, exp: Expected) -> None:
        done = exp.done
        if not self.one_sided and (exp.received != done.writes or exp.received_bytes != done.num_bytes):
            self._give_up(exp, f"request {exp.request_id}: {exp.received_bytes} bytes in {exp.received} frames "
                          f"arrived, the prefill worker sent {done.num_bytes} in {done.writes}")
            return
        if self.stream is not None:
            self.stream.synchronize()
        if self.cfg.checksum:
            differs = first_mismatch(self.kv.pool, exp.dst_blocks, list(done.checksums))
            if differs is not None:
                self.integrity_failures += 1
                log.error("request %s: integrity check failed: %s", exp.request_id, differs)
                self._send(exp.sender, P.Ack(exp.request_id, False, f"integrity check failed: {differs}"))
                self._report(exp, Arrival(exp.request_id, False, error=f"request {exp.request_id}: the KV failed "
                                          f"its integrity check (--kv-checksum): {differs}"))
                return
        self._report(exp, Arrival(exp.request_id, True, first_token=done.first_token, num_bytes=done.num_bytes,
                                  started_at=done.started_at, finished_at=done.finished_at))
        self._send(exp.sender, P.Ack(exp.request_id, True))

    def _give_up(self, exp: Expected, reason: str) -> None:
        exp.give_up = exp.give_up or reason
        if exp.state is ReceiveState.WAITING:
            self._report(exp, Arrival(exp.request_id, False, error=exp.give_up))
            return
        self._send(exp.sender, P.Cancel(exp.request_id, exp.give_up))
        if not self.one_sided:  # we do the writes: none lands once ours in progress finished (_report)
            self._report(exp, Arrival(exp.request_id, False, error=exp.give_up))
        else:  # the sender writes: even one we cannot reach any more (it may have lost only its socket)
            self._fence(exp)

    def _fence(self, exp: Expected) -> None:
        """The request fails now; its blocks are held until the sender confirms it stopped writing, or
        its process is gone."""
        exp.state = ReceiveState.CANCELLING
        exp.grace_deadline = time.monotonic() + self.cfg.cancel_grace_s
        self.fenced_waits += 1
        with self._lock:
            self._arrivals.append(Arrival(exp.request_id, False, error=exp.give_up, reported_at=time.monotonic(),
                                          released=False))

    def _report(self, exp: Expected, arrival: Arrival) -> None:
        with self._lock:
            if self._expected.pop(exp.request_id, None) is not None:
                arrival.reported_at = time.monotonic()
                self._arrivals.append(arrival)

    def _send(self, ident: bytes, msg: msgspec.Struct) -> bool:
        try:
            self._sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: that sender is gone
            log.info("could not reach a sender: %s", e)
            return False
