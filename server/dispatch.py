"""Routing one request: pick its workers (policy, least loaded), drive them, stream its tokens back.

Colocated:
    Generate -> worker W ............ Tokens ... (last one: finished + W's timeline)

Disaggregated:
    Reserve(prompt) -> decode D ..... Reserved(block ids, D's KV receiver address)
    Prefill(prompt, D's address, D's blocks) -> prefill P
    P ............................... PrefillDone(timings, bytes)   (or RequestFailed: D's blocks cancelled)
    D ............................... Tokens: token 1 (came with the KV), then one per decode step

Every wait has a deadline; a worker that fails, times out or is dropped ends the request with an
error (APIError), and whatever the other workers hold for it is aborted. Aborting D's reservation
while P may still write is safe: D frees the blocks only once its KV receiver reports that no
write can land any more (workers/roles/decode.py). P's deadline ends before D's reservation does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import msgspec

from protocol import control as P
from protocol import sampling as S
from protocol.timings import Failover, Timings
from server.admission import Admission, Ticket, unavailable
from server.config import RouterConfig
from server.errors import APIError, bad_request, timed_out, worker_failed
from server.metrics import Metrics
from server.pool import NoWorker, WorkerLost, WorkerPool, WorkerState
from server.timeline import Clock, timings

log = logging.getLogger("pdserve.router")

PREFILL_DEADLINE_MARGIN_S = 1.0  # P's deadline ends at least this long before D's reservation does
PREFILL_REPORT_GRACE_S = 10.0  # after D finished, how long to wait for P's (already sent) report


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: P.Sampling
    policy: str  # "colocated" | "disaggregated" (auto already resolved)
    clock: Clock = field(default_factory=Clock.start)


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


@dataclass
class Plan:
    job: Job
    worker: WorkerState | None = None  # colocated
    prefill: WorkerState | None = None
    decode: WorkerState | None = None
    ticket: Ticket | None = None  # its admission; released when the request ends


class Shutdown:
    """Put in every in-flight request's inbox when the drain timeout passes: the request fails."""

    def __init__(self, reason: str):
        self.reason = reason


class Dispatcher:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, metrics: Metrics):
        self.cfg, self.pool, self.metrics = cfg, pool, metrics
        self._background: set[asyncio.Task] = set()
        self.admission = Admission(cfg, pool, metrics)

    # ---- choosing ---------------------------------------------------------------------------------

    def resolve_policy(self, requested: str | None, prompt_tokens: int) -> str:
        policy = requested or self.cfg.policy
        if policy != "auto":
            return policy
        preferred = "colocated" if prompt_tokens < self.cfg.auto_threshold else "disaggregated"
        other = "disaggregated" if preferred == "colocated" else "colocated"
        if not self.servable(preferred) and self.servable(other):
            return other
        return preferred

    def servable(self, policy: str) -> bool:
        if policy == "colocated":
            return bool(self.pool.alive("colocated"))
        return any(self._prefill_for(d) for d in self.pool.alive("decode"))

    def _prefill_for(self, d: WorkerState) -> list[WorkerState]:
        return [p for p in self.pool.alive("prefill", d.info.transport) if p.info.mode == d.info.mode]

    def plan_all(self, jobs: list[Job]) -> list[Plan]:
        """Plans for the sequences of one prompt (n > 1): each admitted, all on the workers picked for
        the first (so that one worker's prefix cache holds the prompt's KV for all of them)."""
        plans = [self.plan(jobs[0])]
        try:
            for job in jobs[1:]:
                ticket = self.admission.admit(job.request_id, plans[0].ticket.roles, len(job.prompt_ids))
                plans.append(dataclasses.replace(plans[0], job=job, ticket=ticket))
        except BaseException:
            for plan in plans:
                plan.ticket.release()
            raise
        return plans

    async def execute_all(self, plans: list[Plan]) -> AsyncIterator[tuple[int, Token | Done]]:
        """(choice index, event) of every plan's run, as they come; the first error ends them all.
        A prompt of a full KV block or more: the others start once the first has its token 1, so that
        its prompt's blocks are in the workers' prefix cache and the others reuse them instead of
        computing the prompt again (their TTFT pays the first's prefill; the workers compute it once)."""
        if len(plans) == 1:
            async for event in self.execute(plans[0]):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        lead = plans[0].worker or plans[0].decode
        lead_prefilled = asyncio.Event()
        if len(plans[0].job.prompt_ids) <= lead.info.block_size:  # no full block to share
            lead_prefilled.set()

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
        try:
            running = len(tasks)
            while running:
                i, event = await queue.get()
                if event is end:
                    running -= 1
                elif isinstance(event, Exception):
                    raise event
                else:
                    yield i, event
        finally:  # an error, or the client left: the other sequences stop (their workers are told)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def plan(self, job: Job) -> Plan:
        """Admit the job (429/503 with Retry-After at once if it cannot be) and pick its workers."""
        roles = ("colocated",) if job.policy == "colocated" else ("decode", "prefill")
        ticket = self.admission.admit(job.request_id, roles, len(job.prompt_ids))
        try:
            plan = self._pick(job)
        except BaseException:
            ticket.release()
            raise
        plan.ticket = ticket
        return plan

    def _pick(self, job: Job) -> Plan:
        try:
            if job.policy == "colocated":
                return Plan(job, worker=self.pool.pick("colocated"))
            decodes = self.pool.alive("decode")
            if not decodes:
                self.pool.pick("decode")  # raises NoWorker with the message
            paired = [d for d in decodes if self._prefill_for(d)]
            if not paired:
                have = ", ".join(f"{d.id} ({d.info.transport}/{d.info.mode})" for d in decodes)
                raise NoWorker(f"no prefill worker matches a decode worker's transport and mode (decode: {have}); "
                               f"start prefill workers with the same --transport and --mode")
            need = P.blocks_for(len(job.prompt_ids), min(d.info.block_size for d in paired))
            roomy = [d for d in paired if d.free_blocks >= need]
            d = min(roomy or paired, key=WorkerState.load)
            p = min(self._prefill_for(d), key=WorkerState.load)
            return Plan(job, prefill=p, decode=d)
        except NoWorker as e:
            self.metrics.requests.labels(job.policy, "no_worker").inc()
            raise unavailable(f"request {job.request_id} ({job.policy}): {e}", self.cfg.retry_after_s) from None

    # ---- running ----------------------------------------------------------------------------------

    async def execute(self, plan: Plan) -> AsyncIterator[Token | Done]:
        job = plan.job
        self.metrics.in_flight.inc()
        outcome, finish_reason = "cancelled", None
        try:
            run = self._colocated(plan) if job.policy == "colocated" else self._disaggregated(plan)
            if job.policy == "disaggregated" and self.cfg.failover:
                run = self._with_failover(plan)
            async for event in run:
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
            self.metrics.request_ended(job.policy, outcome, finish_reason, job.sampling.max_tokens)

    async def _with_failover(self, plan: Plan) -> AsyncIterator[Token | Done]:
        """--failover: a disaggregated request whose prefill or transfer failed before its first token is
        run once more, on another decode worker (and a prefill worker that matches it) or colocated,
        under a request id of its own; its timings say so ("failover")."""
        first = None
        try:
            async for event in self._disaggregated(plan):
                first = first or event
                yield event
            return
        except APIError as e:
            if first is not None or e.status not in (502, 503, 504) or e.code == "shutting_down":
                raise
            failed = e
        retry = self._retry_plan(plan)
        if retry is None:
            raise failed
        was = f"{plan.prefill.id}/{plan.decode.id}"
        now = retry.worker.id if retry.worker else f"{retry.prefill.id}/{retry.decode.id}"
        log.warning("request %s: %s failed before its first token (%s); failing over to %s", plan.job.request_id,
                    was, failed.message, now)
        try:
            run = self._colocated(retry) if retry.worker else self._disaggregated(retry)
            async for event in run:
                if isinstance(event, Done):
                    event = replace(event, timings=replace(event.timings, failover=Failover(was, now, failed.message)))
                yield event
        finally:
            retry.ticket.release()

    def _retry_plan(self, plan: Plan) -> Plan | None:
        """Another pair without the decode worker that failed, else a colocated worker; admitted like any
        request (None: nothing to fail over to, or no room)."""
        job = replace(plan.job, request_id=f"{plan.job.request_id}-failover")
        decodes = [d for d in self.pool.alive("decode") if d.id != plan.decode.id and self._prefill_for(d)]
        try:
            if decodes:
                d = min(decodes, key=WorkerState.load)
                retry = Plan(replace(job, policy="disaggregated"), prefill=min(self._prefill_for(d),
                                                                               key=WorkerState.load), decode=d)
            elif self.pool.alive("colocated"):
                retry = Plan(replace(job, policy="colocated"), worker=self.pool.pick("colocated"))
            else:
                return None
            roles = ("colocated",) if retry.worker else ("decode", "prefill")
            retry.ticket = self.admission.admit(job.request_id, roles, len(job.prompt_ids))
        except (APIError, NoWorker):
            return None
        return retry

    async def _colocated(self, plan: Plan) -> AsyncIterator[Token | Done]:
        job, w = plan.job, plan.worker
        rid = job.request_id
        inbox = self.pool.open_inbox(rid)
        finished = False
        try:
            self._attach(rid, w)
            job.clock.dispatched = time.monotonic()
            await self.pool.send(w, P.Generate(rid, job.prompt_ids, job.sampling))
            stream = _TokenStream(job, self.metrics)
            while not finished:
                msg, landed = await self._next(inbox, job, w.id, self.cfg.token_timeout_s, "tokens")
                if isinstance(msg, P.TokenOut):
                    yield stream.add(msg, landed)
                    finished = msg.finished
                    if finished:
                        yield stream.done(msg, timings(
                            policy="colocated", clock=job.clock, prompt_tokens=len(job.prompt_ids),
                            completion_tokens=stream.count, worker=w.id, prefilled_by=msg.timeline,
                            decoded_by=msg.timeline))
                else:
                    self._raise_for(msg, job)
        finally:
            if not finished:
                self._abort_all(rid, w)
            self.pool.close_inbox(rid)

    async def _disaggregated(self, plan: Plan) -> AsyncIterator[Token | Done]:
        job, d, p = plan.job, plan.decode, plan.prefill
        rid = job.request_id
        inbox = self.pool.open_inbox(rid)
        finished = prefill_reported = False
        report: P.PrefillDone | None = None
        try:
            self._attach(rid, d)
            self._attach(rid, p)
            reserve_sent = time.monotonic()
            await self.pool.send(d, P.Reserve(rid, job.prompt_ids, job.sampling, self.cfg.kv_deadline_s))
            while True:
                msg, _ = await self._next(inbox, job, d.id, self.cfg.kv_deadline_s + 5.0, "a KV reservation")
                if isinstance(msg, P.Reserved):
                    reserved = msg
                    break
                self._raise_for(msg, job)
            prefill_deadline = self.cfg.kv_deadline_s - (time.monotonic() - reserve_sent) - PREFILL_DEADLINE_MARGIN_S
            if prefill_deadline <= 0:
                raise timed_out(f"request {rid}: the KV reservation on {d.id} took the whole deadline "
                                f"({self.cfg.kv_deadline_s:.0f}s); add decode workers or raise --kv-deadline")
            job.clock.dispatched = time.monotonic()
            await self.pool.send(p, P.Prefill(rid, job.prompt_ids, job.sampling, d.id, msg.kv_address,
                                              msg.block_ids, prefill_deadline, msg.cached_tokens))
            stream = _TokenStream(job, self.metrics)
            # token 1's logprobs (and the prompt's) come with P's report: D's tokens wait for it, if asked
            held: list[tuple[P.TokenOut, float]] | None = [] if needs_prefill_report(job.sampling) else None
            while not finished:
                waiting_for = "tokens" if stream.count else "prefill and KV transfer"
                timeout = self.cfg.token_timeout_s if stream.count else self.cfg.kv_deadline_s + 5.0
                msg, landed = await self._next(inbox, job, f"{p.id}/{d.id}", timeout, waiting_for)
                if isinstance(msg, P.PrefillDone):
                    report, prefill_reported = msg, True
                    self.pool.detach(rid, p.id)  # P's part is over: losing P no longer matters
                    for out, at in with_first_logprobs(held or [], report):
                        yield stream.add(out, at)
                    held = None
                elif isinstance(msg, P.TokenOut) and held is not None:
                    held.append((msg, landed))
                    finished = msg.finished
                elif isinstance(msg, P.TokenOut):
                    if stream.count == 0 and report is not None and needs_prefill_report(job.sampling):
                        [(msg, landed)] = with_first_logprobs([(msg, landed)], report)  # the report came first
                    yield stream.add(msg, landed)
                    finished = msg.finished
                elif isinstance(msg, P.RequestFailed) and msg.worker_id == p.id:
                    prefill_reported = True
                    self._raise_for(msg, job)
                elif isinstance(msg, WorkerLost) and msg.worker_id == p.id and prefill_reported:
                    continue
                else:
                    self._raise_for(msg, job)
            while report is None:  # D can finish (max_tokens=1) before P's report arrives
                msg, _ = await self._next(inbox, job, p.id, PREFILL_REPORT_GRACE_S, "the prefill report")
                if isinstance(msg, P.PrefillDone):
                    report = msg
                elif not isinstance(msg, P.TokenOut):
                    self._raise_for(msg, job)
            for out, at in with_first_logprobs(held or [], report):
                yield stream.add(out, at)
            yield stream.done(stream.last, timings(
                policy="disaggregated", clock=job.clock, prompt_tokens=len(job.prompt_ids),
                completion_tokens=stream.count, worker=d.id, prefilled_by=report.timeline,
                decoded_by=stream.last.timeline, prefill=report, prefill_worker=p.id,
                transport=p.info.transport, mode=p.info.mode, kv_skipped_tokens=reserved.cached_tokens))
        finally:
            if not finished:
                self._abort_all(rid, p, d)
            self.pool.close_inbox(rid)

    # ---- helpers ----------------------------------------------------------------------------------

    def _attach(self, rid: str, w: WorkerState) -> None:
        try:
            self.pool.attach(rid, w)
        except NoWorker as e:
            raise unavailable(f"request {rid}: {e}", self.cfg.retry_after_s) from None

    async def _next(self, inbox: asyncio.Queue, job: Job, who: str, timeout: float, what: str) -> tuple:
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

    def _raise_for(self, msg, job: Job):
        rid = job.request_id
        if isinstance(msg, Shutdown):
            raise unavailable(f"request {rid}: aborted: {msg.reason}", self.cfg.retry_after_s, "shutting_down")
        if isinstance(msg, WorkerLost):
            raise worker_failed(f"request {rid}: worker {msg.worker_id} was lost mid-request ({msg.reason}); "
                                f"retry: the router no longer routes to it", code="worker_lost")
        if isinstance(msg, P.RequestFailed):
            text = f"request {rid}: {msg.error}"
            if msg.kind == "invalid":
                raise bad_request(text)
            if msg.kind == "capacity":
                raise unavailable(text, self.cfg.retry_after_s, "no_capacity")
            if msg.kind == "timeout":
                raise timed_out(text)
            raise worker_failed(text, code=f"{msg.kind}_error")
        raise worker_failed(f"request {rid}: unexpected {type(msg).__name__} from a worker", code="protocol_error")

    def _send_later(self, w: WorkerState, msg) -> None:
        if self.pool.is_alive(w.id):
            self._spawn(self.pool.send(w, msg))

    def _abort_all(self, rid: str, *workers: WorkerState) -> None:
        for w in workers:
            self._send_later(w, P.Abort(rid, "the router gave up on the request"))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
    0..2**63-1) when a seed is given, so each choice differs and the whole is reproducible."""
    if n == 1:
        return [job]
    s = job.sampling
    return [Job(f"{job.request_id}-{i}", job.prompt_ids,
                s if s.seed is None else msgspec.structs.replace(s, seed=(s.seed + i) % (S.MAX_SEED + 1)),
                job.policy, dataclasses.replace(job.clock)) for i in range(n)]


def needs_prefill_report(s: P.Sampling) -> bool:
    return s.logprobs is not None or s.prompt_logprobs is not None


def with_first_logprobs(held: list[tuple[P.TokenOut, float]], report: P.PrefillDone) -> list[tuple[P.TokenOut, float]]:
    """D's tokens held for P's report, token 1 given the logprobs P computed (it sampled token 1)."""
    if not held:
        return held
    first, at = held[0]
    first = msgspec.structs.replace(first, logprobs=report.first_logprobs, prompt_logprobs=report.prompt_logprobs)
    return [(first, at)] + held[1:]


class _TokenStream:
    """Tokens of one request as they reach the router: stamps, inter-token latency, the last message."""

    def __init__(self, job: Job, metrics: Metrics):
        self.job, self.metrics = job, metrics
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
            self.metrics.first_token(self.job.policy, len(self.job.prompt_ids))
        else:
            self.metrics.next_token(self.job.policy, now - clock.last_token)
        clock.last_token = now
        self.token_ids.append(out.token_id)
        self.last = out
        return Token(out.token_id, out.text, out.finished, out.logprobs, out.prompt_logprobs)

    def done(self, out: P.TokenOut, t: dict) -> Done:
        return Done(out.finish_reason or "stop", t, list(self.token_ids))
