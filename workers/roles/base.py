"""What every role shares: the worker it lives in, token messages, failure reports, timelines."""

from __future__ import annotations

import logging
import time
from typing import Callable

from workers import protocol as P
from workers.engine.request import Request

log = logging.getLogger("pdserve.worker")


def ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds between two time.monotonic() stamps; None if either is missing."""
    if start is None or end is None:
        return None
    return (end - start) * 1e3


class Role:
    kv_address: str | None = None  # decode: where prefill workers send KV

    def __init__(self, worker):
        self.worker = worker
        self.engine = worker.engine
        self.worker_id: str = worker.worker_id

    # the loop's interface ----------------------------------------------------------------------

    def handle(self, msg) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def poll_timeout_ms(self, idle_ms: int) -> int:
        """How long the loop may block on the control socket before the next tick."""
        raise NotImplementedError

    def queue_depth(self) -> int:
        raise NotImplementedError

    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def close(self) -> None:
        pass

    # helpers ------------------------------------------------------------------------------------

    def fail(self, request_id: str, kind: str, error: str) -> None:
        log.warning("%s: request %s failed (%s): %s", self.worker_id, request_id, kind, error)
        self.worker.send(P.RequestFailed(self.worker_id, request_id, kind, error))

    def send_tokens(self, outputs: list[P.TokenOut]) -> None:
        if outputs:
            self.worker.send(P.Tokens(self.worker_id, outputs))

    def step_and_send(self, live: dict, timeline_of: Callable[[object], P.Timeline]) -> None:
        """One engine step; its tokens go to the router, a finished request's with its timeline
        (`timeline_of(live[request_id])`). A failed step loses the whole batch: every live
        request is aborted and reported."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("%s: engine step failed", self.worker_id)
            for rid in list(live):
                live.pop(rid)
                self.engine.abort(rid)
                self.fail(rid, "internal", f"engine step failed on {self.worker_id}: {type(e).__name__}: {e}")
            return
        out = []
        for o in outputs:
            entry = live.pop(o.request_id, None) if o.finished else None
            timeline = timeline_of(entry) if entry is not None else None
            out.append(P.TokenOut(o.request_id, o.token_id, o.text_delta, o.finished, o.finish_reason, timeline))
        self.send_tokens(out)

    @staticmethod
    def timeline(req: Request, received: float | None) -> P.Timeline:
        return P.Timeline(wait_ms=ms(received, req.prefill_start), prefill_ms=ms(req.prefill_start, req.prefill_end),
                          first_step_ms=ms(req.first_step_start, req.first_step_end))


def now() -> float:
    return time.monotonic()
