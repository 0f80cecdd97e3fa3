"""The router's plans: the scripts that run one request on the workers its plan names. A plan's type is
its policy (server/routing.py chose it, and the workers); nothing downstream asks which policy it was.
A plan's run gets a WorkerLink (server/link.py) from the Dispatcher that runs it; the Planner that made it
gave it where to go on when its workers fail (`fallback`, `migrate`). It sees nothing else of the router.

ColocatedPlan(job, worker).run(link):
    Generate -> worker W ............ Tokens ... (last one: finished + W's timeline)

DisaggregatedPlan(job, prefill, decode, fallback).run(link):
    Reserve(prompt) -> decode D ..... Reserved(block ids, D's KV receiver address)
    Prefill(prompt, D's address, D's blocks) -> prefill P
    P ............................... PrefillDone(timings, bytes)   (or RequestFailed: D's blocks cancelled)
    D ............................... Tokens: token 1 (came with the KV), then one per decode step
  with a fallback (--failover), a failure before token 1 runs the request once more on the plan the
  fallback makes then: another pair without D, else a colocated worker.

Either plan, with --migrate (`migrating`): when the worker generating a request (D, or W) is lost after
token 1, the request continues on the plan its `migrate` makes then (Planner._migration: the same
policy on other workers, else the other policy), as a new request of its own id (`continued`): the
prompt and the tokens the client has as its prompt, max_tokens (and min_tokens) less those, no prompt
logprobs. Its tokens follow on the same stream without a gap; the one Done counts all of them and its
timings list the moves (`migrations`). The new worker recomputes the prefix, or takes it from its prefix
cache: greedy output is the undisturbed run's (up to float32 rounding of a recomputed prefix, which may
tip a near tie). A seeded sampler starts afresh there, and penalties count only the new worker's tokens;
a stop string that spans the move is not seen (docs/design-fencing.md).

Every wait has a deadline; a worker that fails, times out or is dropped ends the request with an
error (APIError), and whatever the other workers hold for it is aborted. Aborting D's reservation
while P may still write is safe: D frees the blocks only once its KV receiver reports that no
write can land any more (workers/roles/decode.py). P's deadline ends before D's reservation does.

A new policy: its member in protocol/enums.py Policy, its plan class here in PLANS (a class of its own
if its workers are driven differently; its `roles` are what admission counts) and its choice in
server/routing.py (Planner._choose).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, ClassVar, Union

import msgspec

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy, Role
from pdserve.protocol.timings import Failover, Migration
from pdserve.server.admission import Ticket
from pdserve.server.errors import APIError, timed_out
from pdserve.server.job import Done, Job, Token
from pdserve.server.kv_route import Estimate, route_taken
from pdserve.server.link import WorkerLink
from pdserve.server.pool import WorkerLost, WorkerState
from pdserve.server.timeline import timings

log = logging.getLogger("pdserve.router")

# KV_NAMES: a plan's kv_names, {worker id: the prompt's block names as that worker names them}, from its
# KV-aware choice; the router's KV index lists them on a worker only once that worker has taken the
# request (its first token, or P's prefill report), never at the choice: a request a worker refuses, or
# one that fails before, leaves nothing behind in the index (server/kv_index.py)

PREFILL_DEADLINE_MARGIN_S = 1.0  # P's deadline ends at least this long before D's reservation does
PREFILL_REPORT_GRACE_S = 10.0  # after D finished, how long to wait for P's (already sent) report


@dataclass
class ColocatedPlan:
    """One worker prefills and decodes."""

    policy: ClassVar[Policy] = Policy.COLOCATED
    roles: ClassVar[tuple[Role, ...]] = (Role.COLOCATED,)  # what admission counts it against
    job: Job
    worker: WorkerState
    ticket: Ticket | None = None  # its admission; released when the request ends
    estimate: Estimate | None = None  # what the KV-aware choice expected (None: least loaded)
    migrate: Callable[[RequestPlan, Job], RequestPlan | None] | None = None  # --migrate (see the top)
    kv_names: dict[str, list[bytes]] = field(default_factory=dict)  # see KV_NAMES

    @property
    def lead(self) -> WorkerState:
        """The worker whose prefix cache keeps the prompt's KV (n > 1: the other sequences reuse it)."""
        return self.worker

    @property
    def route(self) -> str:
        return self.worker.id

    def run(self, link: WorkerLink) -> AsyncIterator[Token | Done]:
        return migrating(self, link, self._run(link))

    async def _run(self, link: WorkerLink) -> AsyncIterator[Token | Done]:
        job, w = self.job, self.worker
        rid = job.request_id
        inbox = link.open_inbox(rid)
        finished = False
        try:
            link.attach(rid, w)
            job.clock.dispatched = time.monotonic()
            await link.send(w, P.Generate(rid, job.prompt_ids, job.sampling))
            stream = link.stream(job, self.policy)
            while not finished:
                msg, landed = await link.next(inbox, job, w.id, link.cfg.token_timeout_s, "tokens")
                if isinstance(msg, P.TokenOut):
                    if not stream.count:  # W took it: its pool holds the prompt's KV
                        link.accepted(w, self.kv_names)
                    yield stream.add(msg, landed)
                    finished = msg.finished
                    if finished:
                        yield stream.done(msg, explained(self, timings(
                            policy=self.policy, clock=job.clock, prompt_tokens=len(job.prompt_ids),
                            completion_tokens=stream.count, worker=w.id, prefilled_by=msg.timeline,
                            decoded_by=msg.timeline)))
                else:
                    link.raise_for(msg, job)
        finally:
            if not finished:
                link.abort(rid, w)
            link.close_inbox(rid)


@dataclass
class DisaggregatedPlan:
    """A prefill worker computes the prompt's KV into blocks a decode worker reserved; the decode
    worker generates. `fallback` (--failover): where the request runs once more if this pair fails
    before its first token (admitted; None: nowhere)."""

    policy: ClassVar[Policy] = Policy.DISAGGREGATED
    roles: ClassVar[tuple[Role, ...]] = (Role.DECODE, Role.PREFILL)
    job: Job
    prefill: WorkerState
    decode: WorkerState
    ticket: Ticket | None = None
    fallback: Callable[[DisaggregatedPlan], RequestPlan | None] | None = None
    migrate: Callable[[RequestPlan, Job], RequestPlan | None] | None = None  # --migrate (see the top)
    estimate: Estimate | None = None  # the prefill worker's, by the KV-aware choice (None: least loaded)
    kv_names: dict[str, list[bytes]] = field(default_factory=dict)  # see KV_NAMES

    @property
    def lead(self) -> WorkerState:
        return self.decode

    @property
    def worker(self) -> WorkerState:
        """The worker that generates the tokens."""
        return self.decode

    @property
    def route(self) -> str:
        return f"{self.prefill.id}/{self.decode.id}"

    def run(self, link: WorkerLink) -> AsyncIterator[Token | Done]:
        return migrating(self, link, self._failing_over(link))

    async def _failing_over(self, link: WorkerLink) -> AsyncIterator[Token | Done]:
        """The pair's run; with a fallback, a failure before any event went out (502/503/504, not the
        server's shutdown) runs the request on the fallback's plan, its timings saying so ("failover")."""
        sent = False
        try:
            async for event in self._run(link):
                sent = True
                yield event
            return
        except APIError as e:
            if self.fallback is None or sent or e.status not in (502, 503, 504) or e.code == "shutting_down":
                raise
            failed = e
        retry = self.fallback(self)
        if retry is None:
            raise failed
        log.warning("request %s: %s failed before its first token (%s); failing over to %s", self.job.request_id,
                    self.route, failed.message, retry.route)
        retry.migrate = None  # the run that moves is this one (migrating() around it)
        try:
            async for event in retry.run(link):
                if isinstance(event, Done):
                    event = replace(event, timings=replace(event.timings,
                                                           failover=Failover(self.route, retry.route, failed.message)))
                yield event
        finally:
            retry.ticket.release()

    async def _run(self, link: WorkerLink) -> AsyncIterator[Token | Done]:
        job, dec, pre, cfg = self.job, self.decode, self.prefill, link.cfg
        rid = job.request_id
        inbox = link.open_inbox(rid)
        finished = prefill_reported = decoding = False
        report: P.PrefillDone | None = None
        try:
            link.attach(rid, dec)
            link.attach(rid, pre)
            reserve_sent = time.monotonic()
            await link.send(dec, P.Reserve(rid, job.prompt_ids, job.sampling, cfg.kv_deadline_s))
            while True:
                msg, _ = await link.next(inbox, job, dec.id, cfg.kv_deadline_s + 5.0, "a KV reservation")
                if isinstance(msg, P.Reserved):
                    reserved = msg
                    break
                link.raise_for(msg, job)
            prefill_deadline = cfg.kv_deadline_s - (time.monotonic() - reserve_sent) - PREFILL_DEADLINE_MARGIN_S
            if prefill_deadline <= 0:
                raise timed_out(f"request {rid}: the KV reservation on {dec.id} took the whole deadline "
                                f"({cfg.kv_deadline_s:.0f}s); add decode workers or raise --kv-deadline")
            job.clock.dispatched = time.monotonic()
            await link.send(pre, P.Prefill(rid, job.prompt_ids, job.sampling, dec.id, reserved.kv_address,
                                           reserved.dst_blocks, prefill_deadline, reserved.cached_tokens))
            stream = link.stream(job, self.policy)
            # token 1's logprobs (and the prompt's) come with P's report: D's tokens wait for it, if asked
            held: list[tuple[P.TokenOut, float]] | None = [] if needs_prefill_report(job.sampling) else None
            while not finished:
                waiting_for = "tokens" if stream.count else "prefill and KV transfer"
                timeout = cfg.token_timeout_s if stream.count else cfg.kv_deadline_s + 5.0
                msg, landed = await link.next(inbox, job, self.route, timeout, waiting_for)
                if isinstance(msg, P.TokenOut) and not decoding:  # token 1 came with the KV: D holds it
                    decoding = True
                    link.accepted(dec, self.kv_names)
                if isinstance(msg, P.PrefillDone):
                    report, prefill_reported = msg, True
                    link.accepted(pre, self.kv_names)  # P computed the prompt: its prefix cache holds it
                    link.detach(rid, pre)  # P's part is over: losing P no longer matters
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
                elif isinstance(msg, P.RequestFailed) and msg.worker_id == pre.id:
                    prefill_reported = True
                    link.raise_for(msg, job)
                elif isinstance(msg, WorkerLost) and msg.worker_id == pre.id and prefill_reported:
                    continue
                else:
                    link.raise_for(msg, job)
            while report is None:  # D can finish (max_tokens=1) before P's report arrives
                msg, _ = await link.next(inbox, job, pre.id, PREFILL_REPORT_GRACE_S, "the prefill report")
                if isinstance(msg, P.PrefillDone):
                    report = msg
                elif not isinstance(msg, P.TokenOut):
                    link.raise_for(msg, job)
            for out, at in with_first_logprobs(held or [], report):
                yield stream.add(out, at)
            yield stream.done(stream.last, explained(self, timings(
                policy=self.policy, clock=job.clock, prompt_tokens=len(job.prompt_ids),
                completion_tokens=stream.count, worker=dec.id, prefilled_by=report.timeline,
                decoded_by=stream.last.timeline, prefill=report, prefill_worker=pre.id,
                transport=pre.info.transport, mode=pre.info.mode, kv_skipped_tokens=reserved.cached_tokens)))
        finally:
            if not finished:
                link.abort(rid, pre, dec)
            link.close_inbox(rid)


RequestPlan = Union[ColocatedPlan, DisaggregatedPlan]
PLANS: dict[Policy, type] = {Policy.COLOCATED: ColocatedPlan, Policy.DISAGGREGATED: DisaggregatedPlan}


def explained(plan: RequestPlan, t):
    """The request's timings with its route: where it went and what the choice expected there."""
    return replace(t, route=route_taken(plan.route, plan.estimate, plan.job.auto))


def needs_prefill_report(s: P.Sampling) -> bool:
    return s.logprobs is not None or s.prompt_logprobs is not None


def with_first_logprobs(held: list[tuple[P.TokenOut, float]], report: P.PrefillDone) -> list[tuple[P.TokenOut, float]]:
    """D's tokens held for P's report, token 1 given the logprobs P computed (it sampled token 1)."""
    if not held:
        return held
    first, at = held[0]
    first = msgspec.structs.replace(first, logprobs=report.first_logprobs, prompt_logprobs=report.prompt_logprobs)
    return [(first, at)] + held[1:]


# ---- --migrate: the run goes on elsewhere when its generating worker is lost ----------------------


async def migrating(plan: RequestPlan, link: WorkerLink,
                    events: AsyncIterator[Token | Done]) -> AsyncIterator[Token | Done]:
    """`events` (the plan's run); with --migrate, when the worker generating it is lost after token 1,
    the rest comes from the plan's `migrate` continuation (again and again, while workers are left)."""
    job, sent, moves = plan.job, [], []
    current, tickets = plan, []
    try:
        while True:
            try:
                async for event in events:
                    if isinstance(event, Token):
                        sent.append(event.token_id)
                    elif moves:  # the Done of a continuation: the whole request's
                        event = Done(event.finish_reason, replace(
                            event.timings, prompt_tokens=len(job.prompt_ids), completion_tokens=len(sent),
                            migrations=list(moves)), list(sent))
                    yield event
                return
            except APIError as e:
                if plan.migrate is None or not sent or e.code != "worker_lost":
                    raise
                lost = current.worker.id
                nxt = plan.migrate(current, continued(job, sent, len(moves) + 1))
                if nxt is None:
                    raise
                log.warning("request %s: worker %s was lost after %d tokens (%s); it continues on %s",
                            job.request_id, lost, len(sent), e.message, nxt.route)
                moves.append(Migration(lost, nxt.route, len(sent), e.message))
                tickets.append(nxt.ticket)
                current, events = nxt, nxt._run(link)
    finally:
        for t in tickets:
            t.release()


def continued(job: Job, sent: list[int], move: int) -> Job:
    """The request from its (move)th continuation on: its own id (the first try's aborts cannot reach
    it), the tokens the client has appended to the prompt, their count off the token limits, the
    same clock (TTFT and the inter-token gaps go on counting)."""
    s = job.sampling
    sampling = msgspec.structs.replace(s, max_tokens=s.max_tokens - len(sent), prompt_logprobs=None,
                                       min_tokens=max(0, s.min_tokens - len(sent)))
    return replace(job, request_id=f"{job.request_id}-m{move}", prompt_ids=job.prompt_ids + sent,
                   sampling=sampling, clock=job.clock)
