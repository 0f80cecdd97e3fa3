"""Running planned requests: what every plan's run leans on, whatever its policy.

    Dispatcher(cfg, pool, metrics)
      .admission                      tickets per role (server/admission.py); the planner admits with it
      .execute(plan)                  a plan's Token/Done events; /metrics counts the request, its ticket
                                      is released however it ends
      .execute_all(plans)             (choice index, event) of the n sequences of one prompt
      .attach / .next / .raise_for / .abort
                                      one request's link to its workers (used by the plans' runs): depend on
                                      a worker, its next message within a deadline, a failure as an APIError,
                                      Abort to the workers of a request that ends unfinished
      .drain(timeout_s) / .abort_in_flight(reason)
                                      SIGTERM: stop admitting, let in-flight requests finish, fail the rest

Which workers serve a request and how they are driven is server/routing.py's; this module holds the
request's vocabulary there (Job in, Token and Done out) and the token stream's stamps and metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import msgspec

from pdserve.protocol import control as P
from pdserve.protocol import sampling as S
from pdserve.protocol.enums import FailureKind, Policy
from pdserve.protocol.timings import Timings
from pdserve.server.admission import Admission, unavailable
from pdserve.settings.router import RouterConfig
from pdserve.server.errors import APIError, bad_request, timed_out, worker_failed
from pdserve.server.metrics import Metrics
from pdserve.server.pool import NoWorker, WorkerLost, WorkerPool, WorkerState
from pdserve.server.timeline import Clock

if TYPE_CHECKING:
    from pdserve.server.routing import Plan

log = logging.getLogger("pdserve.router")

PREFILL_REPORT_GRACE_S = 10.0  # after D finished, how long to wait for P's (already sent) report


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: P.Sampling
    policy: str | None  # as the request asked (None: the router's --policy); its plan resolves it
    clock: Clock = field(default_factory=Clock.start)
    auto: str | None = None  # policy auto: why its plan took the policy it did (timings.route.auto)


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str
    last: bool  # a Done follows at once (streaming puts both in one event)
    logprobs: P.TokenLogprobs | None = None  # when the request asked (Sampling.logprobs)
    prompt_logprobs: list[P.TokenLogprobs] | None = None  # token 1, when it asked (Sampling.prompt_logprobs)


@dataclass(frozen=True)
class Done:
    finish_reason: str
    timings: Timings
    token_ids: list[int]


class Shutdown:
    """Put in every in-flight request's inbox when the drain timeout passes: the request fails."""

    def __init__(self, reason: str):
        self.reason = reason


class Dispatcher:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, metrics: Metrics):
        self.cfg, self.pool, self.metrics = cfg, pool, metrics
        self._background: set[asyncio.Task] = set()
        self.admission = Admission(cfg, pool, metrics)

    # ---- running ----------------------------------------------------------------------------------

    async def execute(self, plan: Plan) -> AsyncIterator[Token | Done]:
        self.metrics.in_flight.inc()
        outcome, finish_reason = "cancelled", None
        try:
            async for event in plan.run(self):
                if isinstance(event, Done):
                    outcome, finish_reason = "ok", event.finish_reason
                    self.metrics.observe_timings(event.timings)
                yield event
        except APIError as e:
            outcome = e.code or e.type
            raise
        finally:
            if plan.ticket is not None:
                plan.ticket.release()
            self.metrics.in_flight.dec()
            self.metrics.request_ended(plan.policy, outcome, finish_reason, plan.job.sampling.max_tokens)

    async def execute_all(self, plans: list[Plan]) -> AsyncIterator[tuple[int, Token | Done]]:
        """(choice index, event) of every plan's run, as they come; the first error ends them all.
        A prompt of a full KV block or more: the others start once the first has its token 1, so that
        its prompt's blocks are in the workers' prefix cache and the others reuse them instead of
        computing the prompt again (their TTFT pays the first's prefill; the workers compute it once).
        Prompt logprobs: only the first asks (fan_out), whatever the prompt's length; the others wait for it
        and show its copy (the prompt is the same), so n choices cost one prompt-logprob pass, not n."""
        if len(plans) == 1:
            async for event in self.execute(plans[0]):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        lead_prefilled = asyncio.Event()
        first = plans[0].job
        if len(first.prompt_ids) <= plans[0].lead.info.block_size and first.sampling.prompt_logprobs is None:
            lead_prefilled.set()  # no full block to share, no prompt logprobs to wait for

        async def run(i: int, plan: Plan) -> None:
            try:
                if i:
                    await lead_prefilled.wait()
                async for event in self.execute(plan):
                    queue.put_nowait((i, event))
                    if i == 0:
                        lead_prefilled.set()
            except Exception as e:  # APIError and the rest: the response's, raised below
                queue.put_nowait((i, e))
            finally:
                if i == 0:
                    lead_prefilled.set()
                queue.put_nowait((i, end))

        tasks = [asyncio.ensure_future(run(i, plan)) for i, plan in enumerate(plans)]
        shared, started = None, set()  # the first's prompt logprobs; choices whose token 1 was seen
        try:
            running = len(tasks)
            while running:
                i, event = await queue.get()
                if event is end:
                    running -= 1
                elif isinstance(event, Exception):
                    raise event
                else:
                    if isinstance(event, Token) and i not in started:
                        started.add(i)
                        if i == 0:
                            shared = event.prompt_logprobs
                        elif shared is not None and event.prompt_logprobs is None:
                            event = dataclasses.replace(event, prompt_logprobs=shared)
                    yield i, event
        finally:  # an error, or the client left: the other sequences stop (their workers are told)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one request's link to its workers (the plans' runs) --------------------------------------

    def attach(self, rid: str, w: WorkerState) -> None:
        try:
            self.pool.attach(rid, w)
        except NoWorker as e:
            raise unavailable(f"request {rid}: {e}", self.cfg.retry_after_s) from None

    async def next(self, inbox: asyncio.Queue, job: Job, who: str, timeout: float, what: str) -> tuple:
        """(the request's next message, time.monotonic() it landed on the router)"""
        # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation (the client
        # left) when the message arrives at the same moment, and the request would run on
        getter = asyncio.ensure_future(inbox.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=timeout)
        finally:
            if not getter.done():
                getter.cancel()
        if not done:
            raise timed_out(f"request {job.request_id}: no {what} from {who} within {timeout:.0f}s; "
                            f"the worker may be overloaded or stuck (see GET /health)")
        return getter.result()

    def raise_for(self, msg, job: Job):
        rid = job.request_id
        if isinstance(msg, Shutdown):
            raise unavailable(f"request {rid}: aborted: {msg.reason}", self.cfg.retry_after_s, "shutting_down")
        if isinstance(msg, WorkerLost):
            raise worker_failed(f"request {rid}: worker {msg.worker_id} was lost mid-request ({msg.reason}); "
                                f"retry: the router no longer routes to it", code="worker_lost")
        if isinstance(msg, P.RequestFailed):
            text = f"request {rid}: {msg.error}"
            if msg.kind == FailureKind.INVALID:
                raise bad_request(text)
            if msg.kind == FailureKind.CAPACITY:
                raise unavailable(text, self.cfg.retry_after_s, "no_capacity")
            if msg.kind == FailureKind.TIMEOUT:
                raise timed_out(text)
            raise worker_failed(text, code=f"{msg.kind}_error")
        raise worker_failed(f"request {rid}: unexpected {type(msg).__name__} from a worker", code="protocol_error")

    def abort(self, rid: str, *workers: WorkerState) -> None:
        """Tell the workers (those still alive) to drop the request; sent in the background."""
        for w in workers:
            if self.pool.is_alive(w.id):
                self._spawn(self.pool.send(w, P.Abort(rid, "the router gave up on the request")))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- shutting down ----------------------------------------------------------------------------

    def abort_in_flight(self, reason: str) -> int:
        """Fail every request in flight now (the drain timeout passed); their workers are told to abort."""
        now = time.monotonic()
        for q in self.pool.inboxes.values():
            q.put_nowait((Shutdown(reason), now))
        return len(self.pool.inboxes)

    async def drain(self, timeout_s: float) -> tuple[int, int]:
        """Stop admitting (new requests get 503 + Retry-After), let what is in flight finish for up to
        timeout_s, then fail the rest with an error that says so. (in flight at the start, aborted)"""
        adm = self.admission
        adm.start_drain()
        pending = adm.in_flight
        log.info("draining: %d requests in flight, up to %.0fs (--drain-timeout); new requests get 503",
                    pending, timeout_s)
        if await adm.wait_idle(timeout_s):
            return pending, 0
        aborted = self.abort_in_flight(f"the server is shutting down and its drain timeout ({timeout_s:.0f}s, "
                                       f"--drain-timeout) passed before this request finished")
        log.warning("drain timeout: aborted %d requests", aborted)
        await adm.wait_idle(PREFILL_REPORT_GRACE_S)  # their errors reach the clients; the workers are told
        await asyncio.sleep(0.1)  # the aborts to the workers go out (spawned sends)
        return pending, aborted

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def fan_out(job: Job, n: int) -> list[Job]:
    """The n sequences of one request: ids `<id>-<i>`, sequence i seeded with seed + i (wrapping within
    0..2**63-1) when a seed is given, so each choice differs and the whole is reproducible; prompt
    logprobs asked of sequence 0 only (the prompt is the same: execute_all shares them)."""
    if n == 1:
        return [job]
    s = job.sampling

    def sampling(i: int) -> S.Sampling:
        out = s if s.seed is None else msgspec.structs.replace(s, seed=(s.seed + i) % (S.MAX_SEED + 1))
        return out if i == 0 or s.prompt_logprobs is None else msgspec.structs.replace(out, prompt_logprobs=None)

    return [Job(f"{job.request_id}-{i}", job.prompt_ids, sampling(i), job.policy, dataclasses.replace(job.clock))
            for i in range(n)]


class TokenStream:
    """Tokens of one request as they reach the router: stamps, inter-token latency, the last message."""

    def __init__(self, job: Job, policy: Policy, metrics: Metrics):
        self.job, self.policy, self.metrics = job, policy, metrics
        self.token_ids: list[int] = []
        self.last: P.TokenOut | None = None

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def add(self, out: P.TokenOut, landed: float) -> Token:
        """`landed`: when its message was read off the router's socket. Token 1's moment of handing
        to the response (the end of TTFT) is now: the caller yields the Token at once."""
        now = time.monotonic()
        clock = self.job.clock
        if clock.first_token is None:
            clock.token1_landed, clock.first_token = landed, now
            self.metrics.first_token(self.policy, len(self.job.prompt_ids))
        else:
            self.metrics.next_token(self.policy, now - clock.last_token)
        clock.last_token = now
        self.token_ids.append(out.token_id)
        self.last = out
        return Token(out.token_id, out.text, out.finished, out.logprobs, out.prompt_logprobs)

    def done(self, out: P.TokenOut, t: Timings) -> Done:
        return Done(out.finish_reason or "stop", t, list(self.token_ids))
