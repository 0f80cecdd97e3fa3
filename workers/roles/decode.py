"""Decode role: reserve blocks, receive a request's KV into them, continue it from decode step 2.

Life cycle of a request:
    Reserve   -> engine.reserve(n prompt tokens)   no room now: [reserving] until blocks free up or the
                                                   deadline passes (-> RequestFailed capacity)
              -> receiver.expect(blocks, deadline) [expecting] -> Reserved(blocks, our KV receiver address)
    receiver.poll() -> Arrival ok   -> engine.adopt(req, first_token) [scheduler.running]
                                       -> Tokens(token 1: it travelled with the KV, we emit it first)
                    -> Arrival failed or past its deadline -> engine.release() -> RequestFailed transfer
    decode steps -> Tokens, a token each; the last carries the timeline; the engine frees the blocks
    Abort     -> reserving: dropped; running: engine.abort(); expecting: receiver.cancel() -> [cancelling]
                 until the receiver reports (Arrival ok=False) that no write can land any more, then
                 engine.release() (a block freed earlier could take a late byte meant for this request)

Queues: `reserving` (waiting for free blocks), `expecting` (blocks reserved, KV in flight),
`cancelling` (aborted while in flight), then the engine's `scheduler.running`. Every reservation has
a deadline; blocks come back on completion, abort, transfer failure and timeout.

Token 1's time here (the `decode_pickup` phase): the receiver's I/O thread stamps the moment it
reports the KV in (`receiver.reported_at`); the loop finds it at its next tick, after the step it
may be running, adopts, and stamps token 1's message as it goes out.
"""

from __future__ import annotations

import logging
from collections import deque

from workers import protocol as P
from workers.engine.request import InvalidRequest, Request
from workers.roles.base import Role, Tracked, now
from workers.transfer.base import make_receiver

log = logging.getLogger("pdserve.worker")

EXPECTING_POLL_MS = 1  # KV in flight: check the receiver this often


class DecodeRole(Role):
    def __init__(self, worker):
        super().__init__(worker)
        self.receiver = make_receiver(self.engine.kv, worker.cfg.transfer)
        self.kv_address = self.receiver.address
        self.reserving: deque[tuple[P.Reserve, float]] = deque()  # (message, received)
        self.expecting: dict[str, Tracked] = {}
        self.cancelling: set[str] = set()
        self.live: dict[str, Tracked] = {}  # adopted, decoding

    # ---- control messages -----------------------------------------------------------------------

    def handle(self, msg, arrived: float | None = None) -> None:
        if isinstance(msg, P.Reserve):
            received = now() if arrived is None else arrived  # its deadline counts from here
            if self.reserving or not self._try_reserve(msg, received):
                self.reserving.append((msg, received))
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id)
        else:
            log.error("%s: decode worker got %s; only Reserve and Abort go to decode workers",
                      self.worker_id, type(msg).__name__)

    def _try_reserve(self, msg: P.Reserve, received: float) -> bool:
        rid = msg.request_id
        try:
            blocks = self.engine.reserve(rid, len(msg.prompt_ids))
        except InvalidRequest as e:
            self.fail(rid, "invalid", str(e))
            return True
        if blocks is None:
            return False
        req = Request(rid, list(msg.prompt_ids), msg.sampling.to_params())
        req.block_ids = blocks
        remaining = max(0.0, received + msg.deadline_s - now())
        self.receiver.expect(rid, blocks, remaining)
        self.expecting[rid] = Tracked(req)
        self.worker.send(P.Reserved(self.worker_id, rid, blocks, self.kv_address))
        return True

    def _abort(self, rid: str) -> None:
        for item in self.reserving:
            if item[0].request_id == rid:
                self.reserving.remove(item)
                return
        if self.expecting.pop(rid, None) is not None:
            self.receiver.cancel(rid)
            self.cancelling.add(rid)
        elif self.live.pop(rid, None) is not None:
            self.engine.abort(rid)

    # ---- the loop -------------------------------------------------------------------------------

    def tick(self) -> None:
        self._retry_reservations()
        if self.expecting or self.cancelling:
            self._collect_arrivals()
        if self.engine.has_work():
            self._step()

    def _retry_reservations(self) -> None:
        while self.reserving:
            msg, received = self.reserving[0]
            if now() - received >= msg.deadline_s:
                self.reserving.popleft()
                self.fail(msg.request_id, "capacity",
                          f"decode worker {self.worker_id} had no room for {len(msg.prompt_ids)} prompt tokens "
                          f"within {msg.deadline_s:.1f}s ({self.engine.blocks.num_free} blocks free); add decode "
                          f"workers or KV memory (--kv-memory-gb)")
                continue
            if not self._try_reserve(msg, received):
                return  # keep arrival order: later reservations wait behind this one
            self.reserving.popleft()

    def _collect_arrivals(self) -> None:
        adopted = []
        for arrival in self.receiver.poll():
            landed = self.receiver.reported_at.pop(arrival.request_id, None)
            if arrival.request_id in self.cancelling:  # aborted: now no write can land, the blocks may go
                self.cancelling.discard(arrival.request_id)
                self.engine.release(arrival.request_id)
                continue
            entry = self.expecting.pop(arrival.request_id, None)
            if entry is None:
                log.error("%s: the KV receiver reported request %s, which this worker does not expect",
                          self.worker_id, arrival.request_id)
                continue
            req = entry.req
            if not arrival.ok:
                self.engine.release(req.request_id)
                self.fail(req.request_id, "transfer", f"KV for request {req.request_id} did not arrive at "
                          f"{self.worker_id}: {arrival.error}")
                continue
            try:
                first = self.engine.adopt(req, arrival.first_token)
            except InvalidRequest as e:
                self.engine.release(req.request_id)
                self.fail(req.request_id, "invalid", str(e))
                continue
            entry.landed, entry.adopted = landed, now()
            adopted.append((entry, first))
        if not adopted:
            return
        sent = now()  # token 1 of each goes out in the one message below
        out = []
        for entry, first in adopted:
            entry.token1_sent = sent
            if not first.finished:
                self.live[entry.req.request_id] = entry
            out.append(P.TokenOut(entry.req.request_id, first.token_id, first.text_delta, first.finished,
                                  first.finish_reason, entry.timeline() if first.finished else None))
        self.send_tokens(out)

    def _step(self) -> None:
        self.step_and_send(self.live)

    def poll_timeout_ms(self, idle_ms: int) -> int:
        if self.engine.has_work() or self.reserving:
            return 0
        return EXPECTING_POLL_MS if self.expecting or self.cancelling else idle_ms

    def queue_depth(self) -> int:
        return len(self.reserving) + len(self.expecting) + len(self.engine.scheduler.waiting)

    def close(self) -> None:
        self.receiver.close()
