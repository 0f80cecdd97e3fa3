"""Colocated role: prefill and decode of a request on one engine, sharing its steps with the others.

Life cycle of a request (its status, in the engine: workers/engine/request.py):
    Generate  -> engine.add_request()     WAITING      in the scheduler's queue (InvalidRequest -> RequestFailed invalid)
              -> prefill step(s)          PREFILLING   its prompt, whole or in chunks among the decodes
              -> token 1                  RUNNING      -> Tokens, then a token each step
              -> stop, length             FINISHED     blocks freed; the last Tokens carries the timeline
    preempted (the pool ran out)          PREEMPTED    blocks freed, back at the queue's front, recomputed
    its sampling or text failed           FINISHED     (error) blocks freed -> RequestFailed internal; the
                                                       rest of the batch goes on
    Abort     -> engine.abort()           FINISHED     (abort) blocks freed, nothing more is sent

No queues of its own: the engine's dict holds the requests, the scheduler orders them.
"""

from __future__ import annotations

import logging

from pdserve.protocol import control as P
from pdserve.protocol.enums import FailureKind
from pdserve.workers.engine.request import InvalidRequest, Request, Stamps, Status
from pdserve.workers.roles.base import Role, now

log = logging.getLogger("pdserve.worker")


class ColocatedRole(Role):
    QUEUED = (Status.WAITING, Status.PREEMPTED)

    def on_message(self, msg, arrived: float | None) -> None:
        taken = now()
        if isinstance(msg, P.Generate):
            req = Request(msg.request_id, list(msg.prompt_ids), msg.sampling,
                          stamps=Stamps(arrived=taken if arrived is None else arrived, taken=taken))
            try:
                self.engine.add_request(req)
            except InvalidRequest as e:
                self.fail(msg.request_id, FailureKind.INVALID, str(e))
        elif isinstance(msg, P.Abort):
            self.engine.abort(msg.request_id)  # no-op once it finished
        else:
            log.error("%s: colocated worker got %s; only Generate and Abort go to colocated workers",
                      self.worker_id, type(msg).__name__)

    def advance(self) -> None:
        if self.engine.has_work():
            self.step()

    def poll_timeout_ms(self, idle_ms: int) -> int:
        return 0 if self.engine.has_work() else idle_ms
