"""What every role shares: the worker it lives in, token messages, failure reports, timelines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from workers import protocol as P
from workers.engine.request import Request

log = logging.getLogger("pdserve.worker")


def ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds between two time.monotonic() stamps; None if either is missing."""
    if start is None or end is None:
        return None
    return (end - start) * 1e3


@dataclass
class Tracked:
    """A request on this worker: the engine's Request (which stamps prefill start/end and the first
    decode step itself) and the stamps only the role sees. time.monotonic() of this process."""

    req: Request
    arrived: float | None = None  # its message reached this worker's socket (the inbox thread's stamp)
    taken: float | None = None  # the loop handled that message
    landed: float | None = None  # decode: the KV receiver reported the KV in
    adopted: float | None = None  # decode: adopt() returned token 1
    token1_sent: float | None = None  # token 1's Tokens message handed to the router socket

    def timeline(self) -> P.Timeline:
        r = self.req
        made = self.adopted if self.adopted is not None else r.prefill_end  # token 1 exists from here
        return P.Timeline(inbox_ms=ms(self.arrived, self.taken), wait_ms=ms(self.taken, r.prefill_start),
                          prefill_ms=ms(r.prefill_start, r.prefill_end), pickup_ms=ms(self.landed, self.adopted),
                          emit_ms=ms(made, self.token1_sent), first_step_ms=ms(r.first_step_start, r.first_step_end))


class Role:
    kv_address: str | None = None  # decode: where prefill workers send KV

    def __init__(self, worker):
        self.worker = worker
        self.engine = worker.engine
        self.worker_id: str = worker.worker_id

    # the loop's interface ----------------------------------------------------------------------

    def handle(self, msg, arrived: float | None = None) -> None:
        """One control message; `arrived` is when it reached the worker's socket (None: just now)."""
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

    def step_and_send(self, live: dict[str, Tracked]) -> None:
        """One engine step; its tokens go to the router, a finished request's with its timeline.
        A failed step loses the whole batch: every live request is aborted and reported."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("%s: engine step failed", self.worker_id)
            for rid in list(live):
                live.pop(rid)
                self.engine.abort(rid)
                self.fail(rid, "internal", f"engine step failed on {self.worker_id}: {type(e).__name__}: {e}")
            return
        sent = now()  # stamped before the timelines that carry it are built; the send follows at once
        out = []
        for o in outputs:
            entry = live.get(o.request_id)
            if entry is not None and entry.token1_sent is None:
                entry.token1_sent = sent
            if o.finished:
                live.pop(o.request_id, None)
            timeline = entry.timeline() if entry is not None and o.finished else None
            out.append(P.TokenOut(o.request_id, o.token_id, o.text_delta, o.finished, o.finish_reason, timeline))
        self.send_tokens(out)


def now() -> float:
    return time.monotonic()
