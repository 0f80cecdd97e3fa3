"""Colocated role: prefill and decode of a request on one engine, sharing its steps with the others.

Life cycle of a request:
    Generate  -> engine.add_request()        [scheduler.waiting]   (InvalidRequest -> RequestFailed invalid)
              -> prefill step, token 1        [scheduler.running]   -> Tokens
              -> decode steps, a token each                         -> Tokens (the last carries the timeline)
              -> finished: the engine frees its blocks
    Abort     -> engine.abort(): blocks freed, nothing more is sent

Queues: the engine's `scheduler.waiting` (not prefilled yet) and `scheduler.running`; `live` maps
each of our request ids to its Tracked (the Request, when its Generate arrived and was taken, when
token 1 went out).
"""

from __future__ import annotations

import logging

from workers import protocol as P
from workers.engine.request import InvalidRequest, Request
from workers.roles.base import Role, Tracked, now

log = logging.getLogger("pdserve.worker")


class ColocatedRole(Role):
    def __init__(self, worker):
        super().__init__(worker)
        self.live: dict[str, Tracked] = {}

    def handle(self, msg, arrived: float | None = None) -> None:
        taken = now()
        if isinstance(msg, P.Generate):
            req = Request(msg.request_id, list(msg.prompt_ids), msg.sampling.to_params())
            try:
                self.engine.add_request(req)
            except InvalidRequest as e:
                self.fail(msg.request_id, "invalid", str(e))
                return
            self.live[msg.request_id] = Tracked(req, arrived=taken if arrived is None else arrived, taken=taken)
        elif isinstance(msg, P.Abort):
            if self.live.pop(msg.request_id, None) is not None:
                self.engine.abort(msg.request_id)
        else:
            log.error("%s: colocated worker got %s; only Generate and Abort go to colocated workers",
                      self.worker_id, type(msg).__name__)

    def tick(self) -> None:
        if not self.engine.has_work():
            return
        self.step_and_send(self.live)

    def poll_timeout_ms(self, idle_ms: int) -> int:
        return 0 if self.engine.has_work() else idle_ms

    def queue_depth(self) -> int:
        return len(self.engine.scheduler.waiting)
