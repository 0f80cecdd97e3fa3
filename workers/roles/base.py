"""What every role shares: the worker it lives in, token messages, failure reports, timelines.

A role keeps no record of its requests: each lives in the engine (`engine.requests`, its status
on the ladder of workers/engine/request.py, its timeline in the Request's Stamps), and the
role looks it up there. A role turns control messages into engine calls and engine outputs into
messages. What the heartbeat thread reports (queue depth, running) is a count the main thread
publishes after each tick, so that thread never reads the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pdserve.protocol import control as P
from pdserve.protocol.enums import FailureKind
from pdserve.workers.engine.request import Request, Status

if TYPE_CHECKING:
    from pdserve.workers.engine.outputs import StepOutput

log = logging.getLogger("pdserve.worker")


def timeline(r: Request) -> P.Timeline:
    """What this worker measured of a request, on its own clock: its stamps by name (those not set are
    left out), its cached tokens and their reloads."""
    return P.Timeline(stamps=r.stamps.named(), cached_tokens=r.cached_tokens,
                      tier_tokens=dict(r.tier_tokens),
                      reload_ms=None if r.reload_s is None else r.reload_s * 1e3)


class Role:
    kv_address: str | None = None  # decode: where prefill workers send KV
    QUEUED: tuple[Status, ...] = ()  # the states the heartbeat reports as queue depth
    ACTIVE: tuple[Status, ...] = (Status.PREFILLING, Status.RUNNING)  # ... and as running

    def __init__(self, worker):
        self.worker = worker
        self.engine = worker.engine
        self.worker_id: str = worker.worker_id
        self._counts: dict[Status, int] = dict.fromkeys(Status, 0)  # replaced whole, never mutated

    # the loop's interface ----------------------------------------------------------------------

    def handle(self, msg, arrived: float | None = None) -> None:
        """One control message; `arrived` is when it reached the worker's socket (None: just now)."""
        self.on_message(msg, arrived)
        self._counts = self.engine.counts()

    def tick(self) -> None:
        self.advance()
        self.engine.capture_idle()  # no request on the worker: one decode graph the start left, if any
        self.engine.flush_trace()  # no request on the worker, or lines long enough waiting: the step trace's file
        self._counts = self.engine.counts()

    def wait_ms(self, idle_ms: int) -> int:
        """How long the loop may block before the next tick: the role's answer, or 0 while decode graphs
        wait for idle time (a message that arrives is still read between two captures)."""
        return 0 if self.engine.idle_capture_due() else self.poll_timeout_ms(idle_ms)

    def on_message(self, msg, arrived: float | None) -> None:
        raise NotImplementedError

    def advance(self) -> None:
        """Whatever the role's requests need next: engine steps, prefills, transfers."""
        raise NotImplementedError

    def poll_timeout_ms(self, idle_ms: int) -> int:
        """How long the loop may block on the control socket before the next tick."""
        raise NotImplementedError

    def queue_depth(self) -> int:  # the heartbeat thread
        counts = self._counts
        return sum(counts[s] for s in self.QUEUED)

    def running(self) -> int:  # the heartbeat thread
        counts = self._counts
        return sum(counts[s] for s in self.ACTIVE)

    def faults(self) -> P.FaultFigures | None:  # the heartbeat thread
        """What the heartbeat reports of fences and integrity checks (decode workers: their KV receiver)."""
        return None

    def close(self) -> None:
        pass

    # helpers ------------------------------------------------------------------------------------

    def fail(self, request_id: str, kind: FailureKind, error: str) -> None:
        log.warning("%s: request %s failed (%s): %s", self.worker_id, request_id, kind, error)
        self.worker.send(P.RequestFailed(self.worker_id, request_id, kind, error))

    def step(self) -> None:
        """One engine step; its outputs go to the router."""
        self.emit(self.engine.step())

    def emit(self, outputs: list[StepOutput]) -> None:
        """Tokens in one message (a finished request's with its timeline); a request that failed
        alone (its sampling, its text) is reported on its own, the others go on."""
        sent = now()  # stamped before the timelines that carry it are built; the send follows at once
        tokens = []
        for o in outputs:
            r = o.request
            if o.error is not None:
                self.fail(r.request_id, FailureKind.INTERNAL, f"on {self.worker_id}: {o.error}")
                continue
            if r.stamps.token1_sent is None:
                r.stamps.token1_sent = sent
                self.observe_prefill(r)
            tokens.append(P.TokenOut(r.request_id, o.token_id, o.text_delta, o.finished, o.finish_reason,
                                     timeline(r) if o.finished else None, o.logprobs, o.prompt_logprobs))
        if tokens:
            self.worker.send(P.Tokens(self.worker_id, tokens))


    def observe_prefill(self, r: Request, *batch: Request) -> None:
        """Token 1 exists: the request's prefill speed goes into what prices the next one (KV routing); with
        `batch`, the others of its forward (a prefill worker's batch), observed together."""
        report = getattr(self.worker, "kv_report", None)
        if report is not None:
            report.observe(r, *batch)


def now() -> float:
    return time.monotonic()
