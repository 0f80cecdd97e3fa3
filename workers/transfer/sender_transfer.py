"""One transfer on the prefill side, shared by all transports: its ladder, the finish/abort template,
and the queue of writes the I/O thread posts.

Life cycle of a transfer (Transfer.state, base.TransferState; base.MOVES has every legal move):

    open()          OPENED        Begin sent (the sender's open(); it shakes hands first with a new peer)
    Accept          TRANSFERRING  writes may go out; before it, layer_done() only queues
    finish()        LANDING       the layers left handed over (bulk: all of them); waits until they landed
    every byte in   ACKING        Done sent, waits for the Ack (deadline)
    Ack             DONE
    any failure     ABORTING      Cancel, the writes' own error, a missed deadline, abort(): TransferError to
                                  the caller; the receiver gets an Abort as soon as none of our writes can
                                  land, then FAILED
                    FAILED        Reject, Ack(ok=False), the peer disconnecting: the receiver knows, or is gone

The caller's side never waits for the decode worker except in finish(): start_finish() and poll() do the
same without waiting (poll() moves it on and returns the stats once the decode worker acked; only local
work, the copies and the hand-off of frames, runs in poll()).

A transport's SenderTransfer implements (the base does the rest: the layer_done guard, the ladder, the
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
    begin(dst_blocks, num_tokens) -> P.Begin   optional, I/O thread: the Begin to send (nixl: asking for a
                            staging grant, with its own staging range taken)
    on_accept(grant)        I/O thread: the receiver's Accept and the StagingGrant it carries (None: none);
                            nixl checks and keeps it; the base moves the ladder
    let_go()                optional, I/O thread, once: the transfer is over or its peer gone; give back what
                            it holds besides its writes (nixl: its staging range)
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch

from pdserve.protocol import kv as P
from pdserve.workers.transfer.base import LIVE, MOVES, WRITING, Transfer, TransferState, TransferStats
from pdserve.workers.transfer.errors import IllegalMove, TransferError
from pdserve.workers.transfer.integrity import block_checksums
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan

if TYPE_CHECKING:
    from pdserve.settings.worker import TransferConfig
    from pdserve.workers.engine.kv_cache import KVCache


class SenderLink(Protocol):
    """What a transfer uses of its sender (sender.ChannelSender): named here, so this module needs
    nothing of sender.py."""

    cfg: TransferConfig
    kv: KVCache
    one_sided: bool  # False (zmq): the receiver writes the bytes itself, so they landed once it acked

    def _submit(self, fn, *args) -> Future: ...  # run fn on the I/O thread

    def send(self, p: Peer, msg: msgspec.Struct, data=None) -> None: ...  # I/O thread


class SenderTransfer(Transfer):
    """The ladder, the finish/abort template and the I/O thread's queue, shared by every transport's transfer."""

    polls_writes = False  # nixl: writes in flight need polling without a nap (check_xfer_state)

    def __init__(self, sender: SenderLink, peer: Peer, plan: Plan):
        self.request_id = plan.request_id
        self.peer = peer.address
        self.sender, self.p, self.plan = sender, peer, plan
        self.cfg = sender.cfg
        self.src = sender.kv.pool
        self.layered = sender.cfg.mode == "layer"
        self.state = TransferState.OPENED  # moved only by _transition (under lock; `moved` wakes finish())
        self.error: TransferError | None = None  # ABORTING, FAILED: why
        self.lock = threading.RLock()
        self.moved = threading.Condition(self.lock)
        self.started_at = 0.0
        self.finished_at = 0.0
        self.copies = 0
        self.writes = 0  # I/O thread: what the receiver counts (sum of _post's)
        self.last_event: torch.cuda.Event | None = None  # a timed CUDA event after the last copy, if any
        self.start_event: torch.cuda.Event | None = None  # ipc on GPU: a timed one before the first copy
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
            self.moved.wait_for(lambda: self.state is not TransferState.OPENED, timeout_s)
            return self.state in WRITING or self.state is TransferState.DONE

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
            if self.state is TransferState.OPENED:
                return self._due("the decode worker's accept")
            if self.state is TransferState.TRANSFERRING:
                rest = [layer for layer in range(self.plan.num_layers) if layer not in self.layers_sent]
                self.layers_sent.update(rest)
                if rest:
                    self._move(rest)
                self._transition("land")
                self.landing = self._landed(self._deadline)
            if self.state is TransferState.LANDING:  # the writes are posted: wait for them without blocking
                if self.landing is not None:
                    if not self.landing.done():
                        return self._due("completion of the KV writes")
                    self.landing.result()  # raises the failure that resolved it
                    self.landing = None
                self._transition("send_done")
                done = P.Done(self.request_id, self._first_token, self.plan.num_bytes, self.started_at,
                              self.finished_at, self.writes, self._checksums())
                self.sender._submit(self.sender.send, self.p, done)
            if self.state is TransferState.ACKING:
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
                             done_event=self.last_event, start_event=self.start_event)

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

    def begin(self, dst_blocks: list[int], num_tokens: int) -> P.Begin:
        return P.Begin(self.request_id, dst_blocks, num_tokens)

    def on_accept(self, grant: P.StagingGrant | None = None) -> None:
        if grant is not None:
            self.fail(TransferError(f"request {self.request_id}: the decode worker at {self.peer} granted staging "
                                    "space this transfer did not ask for; run the same pdserve version on both"))
            return
        self._accepted()

    def _accepted(self) -> None:
        with self.lock:
            if self.state is TransferState.OPENED:
                self._transition("accept")

    def on_ack(self, msg: P.Ack) -> None:
        if not msg.ok:
            self.fail(TransferError(f"request {self.request_id}: the decode worker at {self.peer} refused the "
                                    f"done notice: {msg.error}; free the request's prefill blocks"), reachable=False)
            return
        with self.lock:
            if self.state is TransferState.ACKING:
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
        elif self.finishing is not None and not self.finishing.done() and self.error is not None \
                and not self._in_flight:  # a finish() waiting for the landing wakes to the failure, not the deadline
            self.finishing.set_exception(self.error)
        if self.state is TransferState.ABORTING and not self._in_flight:
            self.sender.send(self.p, P.Abort(self.request_id, str(self.error)))
            self._transition("aborted")

    @property
    def over(self) -> bool:
        """Nothing more to do on the I/O thread: forget it."""
        return self.state is TransferState.DONE or self.state is TransferState.FAILED

    def busy(self) -> bool:
        """The loop should come back without a nap: posts waiting on a GPU event, NIXL writes in flight,
        an Abort waiting for the last write."""
        queued = bool(self.queue) and self.state in WRITING
        return queued or (self._in_flight and (self.polls_writes or self.state is TransferState.ABORTING))

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

    def let_go(self) -> None:
        """I/O thread, once the transfer is over or its peer gone: give back what it holds besides its writes."""


def _wake() -> None: ...
