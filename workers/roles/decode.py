"""Decode role: reserve blocks, receive a request's KV into them, continue it from decode step 2.

Life cycle of a request (its status, in the engine: workers/engine/request.py):
    Reserve   -> engine.admit()             WAITING     for room, in arrival order: blocks for its prompt and
                                                        a seat (at most --max-num-seqs requests SEATED:
                                                        adopt() joins the batch unasked, and a decode
                                                        step past max_num_seqs has no CUDA graph)
                                                        (InvalidRequest -> RequestFailed invalid; past its
                                                        deadline -> RequestFailed capacity)
              -> engine.reserve()           RESERVED    its leading blocks may be cached here already (the
                                                        prefix cache): receiver.expect(the others, deadline)
                                                        -> Reserved(those blocks, our KV receiver address,
                                                        cached tokens: the prefill worker skips them)
    receiver.began()                        RECEIVING   the sender's Begin was accepted: it writes now
    receiver.poll() -> Arrival ok           RUNNING     engine.adopt(req, first_token): the running batch
                                                        -> Tokens(token 1: it travelled with the KV, we emit it first)
                    -> Arrival failed or past its deadline
                                            FINISHED    (error) engine.fail() frees the blocks -> RequestFailed transfer
                    -> Arrival failed, not released (the sender may still write: its fence is due)
                                            CANCELLING  -> RequestFailed transfer now; engine.release() at the
                                                        Arrival(released=True) that follows
    decode steps                            RUNNING     -> Tokens, a token each; the last carries the timeline
                                            FINISHED    stop, length: blocks freed; its sampling or text failed:
                                                        blocks freed -> RequestFailed internal, the batch goes on
    preempted (the pool ran out)            PREEMPTED   recomputed here from its tokens, then RUNNING again
    Abort     -> RESERVED, RECEIVING: engine.cancel(), receiver.cancel()             CANCELLING
                 until the receiver reports (Arrival ok=False) that no write can land any more, then
                 engine.release()                                                   FINISHED (abort)
                 (a block freed earlier could take a late byte meant for this request)
              -> any other state: engine.abort(), blocks freed at once             FINISHED (abort)

No queues of its own: the engine's dict holds every request and its state; the receiver keeps only
each transfer's progress on the wire (see workers/transfer/receiver.py). Every reservation has a
deadline (the Request's `deadline`, handed to the receiver); blocks come back on completion,
abort, transfer failure and timeout.

Token 1's time here (the `decode_pickup` phase): the receiver's I/O thread stamps the moment it
reports the KV in (`Arrival.reported_at`); the loop finds it at its next tick, after the step it
may be running, adopts, and stamps token 1's message as it goes out.
"""

from __future__ import annotations

import logging

from pdserve.protocol import control as P
from pdserve.protocol.enums import FailureKind
from pdserve.workers.engine.request import InvalidRequest, Request, Status
from pdserve.workers.roles.base import Role, now
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_receiver

log = logging.getLogger("pdserve.worker")

EXPECTING_POLL_MS = 1  # KV in flight: check the receiver this often
IN_FLIGHT = (Status.RESERVED, Status.RECEIVING, Status.CANCELLING)  # the receiver holds their blocks' fate
# in the running batch or on their way into it (a preempted one is seated again by the scheduler, under the
# same cap): reservations stop while max_num_seqs of them are here
SEATED = (Status.RESERVED, Status.RECEIVING, Status.RUNNING, Status.PREFILLING, Status.PREEMPTED)


class DecodeRole(Role):
    QUEUED = (Status.WAITING, Status.RESERVED, Status.RECEIVING, Status.PREEMPTED)

    def __init__(self, worker):
        super().__init__(worker)
        self.receiver = make_receiver(self.engine.kv, worker.cfg.transfer)
        self.kv_address = self.receiver.address

    # ---- control messages -----------------------------------------------------------------------

    def on_message(self, msg, arrived: float | None) -> None:
        if isinstance(msg, P.Reserve):
            received = now() if arrived is None else arrived  # its deadline counts from here
            req = Request(msg.request_id, list(msg.prompt_ids), msg.sampling,
                          deadline=received + msg.deadline_s)
            try:
                self.engine.admit(req)
            except InvalidRequest as e:
                self.fail(msg.request_id, FailureKind.INVALID, str(e))
                return
            self._reserve_waiting()
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id)
        else:
            log.error("%s: decode worker got %s; only Reserve and Abort go to decode workers",
                      self.worker_id, type(msg).__name__)

    def _abort(self, rid: str) -> None:
        req = self.engine.requests.get(rid)
        if req is None or req.status is Status.CANCELLING:
            return
        if req.status in (Status.RESERVED, Status.RECEIVING):  # a write may be on its way into the blocks
            self.engine.cancel(rid)
            self.receiver.cancel(rid)
        else:
            self.engine.abort(rid)

    # ---- the loop -------------------------------------------------------------------------------

    def advance(self) -> None:
        self._reserve_waiting()
        if self.engine.in_state(*IN_FLIGHT):
            self._follow_transfers()
        if self.engine.has_work():
            self.step()

    def _reserve_waiting(self) -> None:
        """Reserve for the WAITING requests in arrival order while there is room; fail those past
        their deadline (a later request never jumps an earlier one). Room: the prompt's blocks, and a seat
        while fewer than max_num_seqs requests are SEATED."""
        waiting = self.engine.in_state(Status.WAITING)
        if not waiting:
            return
        seats, seated = self.engine.config.max_num_seqs, len(self.engine.in_state(*SEATED))
        for req in waiting:
            rid = req.request_id
            if now() >= req.deadline:
                error = (f"decode worker {self.worker_id} had no room for {len(req.prompt_ids)} prompt tokens "
                         f"within {req.deadline - req.stamps.arrived:.1f}s ({self.engine.blocks.num_free} blocks free, "
                         f"{seated} of --max-num-seqs {seats} seats taken); add decode workers, KV memory "
                         f"(--kv-memory-gb) or seats (--max-num-seqs)")
                self.engine.fail(rid, error)
                self.fail(rid, FailureKind.CAPACITY, error)
                continue
            if seated >= seats:
                return
            blocks = self.engine.reserve(rid, len(req.prompt_ids))
            if blocks is None:
                return
            dst_blocks = blocks[req.cached_tokens // self.engine.layout.block_size:]  # the rest is cached here
            try:
                self.receiver.expect(rid, dst_blocks, max(0.0, req.deadline - now()))
            except TransferError as e:
                self.engine.fail(rid, str(e))
                self.fail(rid, FailureKind.TRANSFER, f"decode worker {self.worker_id} cannot take KV for request {rid}: {e}")
                continue
            seated += 1
            self.worker.send(P.Reserved(self.worker_id, rid, dst_blocks, self.kv_address, req.cached_tokens))

    def _follow_transfers(self) -> None:
        for rid in self.receiver.began():
            req = self.engine.requests.get(rid)
            if req is not None and req.status is Status.RESERVED:
                self.engine.begin_receiving(rid)
        adopted = []
        for arrival in self.receiver.poll():
            rid = arrival.request_id
            req = self.engine.requests.get(rid)
            if req is None or req.status not in IN_FLIGHT:
                log.error("%s: the KV receiver reported request %s, which this worker does not expect (%s)",
                          self.worker_id, rid, "unknown" if req is None else req.status.value)
                continue
            if req.status is Status.CANCELLING:  # aborted (or failed, fenced): once no write can land,
                if arrival.released:  # the blocks may go
                    self.engine.release(rid)
                continue
            if not arrival.ok:
                error = f"KV for request {rid} did not arrive at {self.worker_id}: {arrival.error}"
                if arrival.released:
                    self.engine.fail(rid, error)
                else:  # the request fails now; a write may still land in its blocks: they wait for the fence
                    self.engine.cancel(rid)
                self.fail(rid, FailureKind.TRANSFER, error)
                continue
            try:
                first = self.engine.adopt(req, arrival.first_token)
            except InvalidRequest as e:  # the engine finished it and freed its blocks
                self.fail(rid, FailureKind.INVALID, str(e))
                continue
            req.stamps.kv_received, req.stamps.token1 = arrival.reported_at, now()
            adopted.append(first)
        self.emit(adopted)  # token 1 of each, in one message

    def poll_timeout_ms(self, idle_ms: int) -> int:
        if self.engine.has_work() or self.engine.in_state(Status.WAITING):
            return 0
        return EXPECTING_POLL_MS if self.engine.in_state(*IN_FLIGHT) else idle_ms

    def faults(self) -> P.FaultFigures:
        waits, held, integrity = self.receiver.figures()
        return P.FaultFigures(fenced_waits=waits, fenced_blocks=held, integrity_failures=integrity)

    def close(self) -> None:
        self.receiver.close()
