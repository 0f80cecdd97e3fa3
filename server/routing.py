"""Routing: which workers serve a request and how they are driven, decided here once, when its plan
is made. A plan's type is its policy; nothing downstream asks which policy it was.

    Planner(cfg, pool, admission, metrics)
      .decide(requested, prompt_ids)       (policy, why): the request's, else cfg.policy; `auto`: from the
                                           workers' reports and measured costs (see decide), else colocated
                                           below cfg.auto_threshold prompt tokens; the other policy when only
                                           it is servable now. resolve(requested, prompt_tokens): the policy
      .servable(policy), .servable_now()   live workers can serve it now (/health)
      .plan(job), .plan_all(jobs)          admitted (429/503 with Retry-After at once) and on its workers

Worker choice (--routing): `kv` (the default, once workers report their block names): the lowest
predicted TTFT, priced in milliseconds from the prefix each worker holds and its measured costs, under
a load rule (server/kv_route.py); a disaggregated request's decode worker is the one holding most of its
prompt (not re-sent), its prefill worker priced the same way. `least-loaded` (`load`), a decode worker
with free blocks for the prompt first. A prefill worker pairs only with a decode worker it can send KV
to (its transport and mode). The choice and what it expected go into timings.route.

ColocatedPlan(job, worker).run(dispatcher):
    Generate -> worker W ............ Tokens ... (last one: finished + W's timeline)

DisaggregatedPlan(job, prefill, decode, fallback).run(dispatcher):
    Reserve(prompt) -> decode D ..... Reserved(block ids, D's KV receiver address)
    Prefill(prompt, D's address, D's blocks) -> prefill P
    P ............................... PrefillDone(timings, bytes)   (or RequestFailed: D's blocks cancelled)
    D ............................... Tokens: token 1 (came with the KV), then one per decode step
  with a fallback (--failover), a failure before token 1 runs the request once more on the plan the
  fallback makes then: another pair without D, else a colocated worker.

Either plan, with --migrate (server/migration.py): when the worker generating a request (D, or W) is lost
after token 1, the request continues on the plan `migrate` makes then (the same policy on other
workers, else the other policy), as a new request of its own id: the prompt and the tokens the client
has as its prompt, max_tokens (and min_tokens) less those, no prompt logprobs. Its tokens follow on
the same stream; the Done counts all of them and its timings list the move (`migrations`). The new
worker recomputes the prefix, or takes it from its prefix cache: greedy output is the undisturbed
run's (up to float32 rounding of a recomputed prefix, which may tip a near tie). A seeded sampler starts
afresh there, and penalties count only the new worker's tokens; a stop string that spans the move is
not seen.

Every wait has a deadline; a worker that fails, times out or is dropped ends the request with an
error (APIError), and whatever the other workers hold for it is aborted. Aborting D's reservation
while P may still write is safe: D frees the blocks only once its KV receiver reports that no
write can land any more (workers/roles/decode.py). P's deadline ends before D's reservation does.

A new policy: its member in protocol/enums.py Policy, and here its plan class in PLANS (a class of
its own if its workers are driven differently; its `roles` are what admission counts) and its choice
in Planner._choose. /health, the CLI's and the API's choices and the metrics' labels follow the enum.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, ClassVar, Union

import msgspec

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy, Role
from pdserve.protocol.timings import Failover
from pdserve.server.admission import Admission, Ticket, unavailable
from pdserve.settings.router import RouterConfig
from pdserve.server.dispatch import PREFILL_REPORT_GRACE_S, Dispatcher, Done, Job, Token, TokenStream
from pdserve.server.errors import APIError, timed_out
from pdserve.server.kv_route import Estimate, auto_policy, choose, not_overloaded, reporting, route_taken
from pdserve.server.metrics import Metrics
from pdserve.server.migration import migrating
from pdserve.server.pool import NoWorker, WorkerLost, WorkerPool, WorkerState
from pdserve.server.timeline import timings

log = logging.getLogger("pdserve.router")

PREFILL_DEADLINE_MARGIN_S = 1.0  # P's deadline ends at least this long before D's reservation does


# ---- worker choice --------------------------------------------------------------------------------


def load(w: WorkerState) -> tuple[int, int]:
    """Smaller is less loaded: requests the router has in flight there (exact, immediate), then the
    worker's own queue as of its last heartbeat, then more free blocks."""
    return (len(w.inflight) + w.queue_depth, -w.free_blocks)


def least_loaded(workers: list[WorkerState], need_blocks: int = 0) -> WorkerState:
    """The least loaded of `workers` (not empty), of those with need_blocks free if any has them."""
    roomy = [w for w in workers if w.free_blocks >= need_blocks]
    return min(roomy or workers, key=load)


# ---- plans ----------------------------------------------------------------------------------------


@dataclass
class ColocatedPlan:
    """One worker prefills and decodes."""

    policy: ClassVar[Policy] = Policy.COLOCATED
    roles: ClassVar[tuple[Role, ...]] = (Role.COLOCATED,)  # what admission counts it against
    job: Job
    worker: WorkerState
    ticket: Ticket | None = None  # its admission; released when the request ends
    estimate: Estimate | None = None  # what the KV-aware choice expected (None: least loaded)

    @property
    def lead(self) -> WorkerState:
        """The worker whose prefix cache keeps the prompt's KV (n > 1: the other sequences reuse it)."""
        return self.worker

    @property
    def route(self) -> str:
        return self.worker.id

    migrate: Callable[[Plan, str], Plan | None] | None = None  # --migrate (see the top)

    def run(self, d: Dispatcher) -> AsyncIterator[Token | Done]:
        return migrating(self, d, self._run(d))

    async def _run(self, d: Dispatcher) -> AsyncIterator[Token | Done]:
        job, w = self.job, self.worker
        rid = job.request_id
        inbox = d.pool.open_inbox(rid)
        finished = False
        try:
            d.attach(rid, w)
            job.clock.dispatched = time.monotonic()
            await d.pool.send(w, P.Generate(rid, job.prompt_ids, job.sampling))
            stream = TokenStream(job, self.policy, d.metrics)
            while not finished:
                msg, landed = await d.next(inbox, job, w.id, d.cfg.token_timeout_s, "tokens")
                if isinstance(msg, P.TokenOut):
                    yield stream.add(msg, landed)
                    finished = msg.finished
                    if finished:
                        yield stream.done(msg, explained(self, timings(
                            policy=self.policy, clock=job.clock, prompt_tokens=len(job.prompt_ids),
                            completion_tokens=stream.count, worker=w.id, prefilled_by=msg.timeline,
                            decoded_by=msg.timeline)))
                else:
                    d.raise_for(msg, job)
        finally:
            if not finished:
                d.abort(rid, w)
            d.pool.close_inbox(rid)


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
    fallback: Callable[[DisaggregatedPlan], Plan | None] | None = None
    migrate: Callable[[Plan, str], Plan | None] | None = None  # --migrate (see the top)
    estimate: Estimate | None = None  # the prefill worker's, by the KV-aware choice (None: least loaded)

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

    def run(self, d: Dispatcher) -> AsyncIterator[Token | Done]:
        return migrating(self, d, self._failing_over(d))

    async def _failing_over(self, d: Dispatcher) -> AsyncIterator[Token | Done]:
        """The pair's run; with a fallback, a failure before any event went out (502/503/504, not the
        server's shutdown) runs the request on the fallback's plan, its timings saying so ("failover")."""
        sent = False
        try:
            async for event in self._run(d):
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
            async for event in retry.run(d):
                if isinstance(event, Done):
                    event = replace(event, timings=replace(event.timings,
                                                           failover=Failover(self.route, retry.route, failed.message)))
                yield event
        finally:
            retry.ticket.release()

    async def _run(self, d: Dispatcher) -> AsyncIterator[Token | Done]:
        job, dec, pre, cfg = self.job, self.decode, self.prefill, d.cfg
        rid = job.request_id
        inbox = d.pool.open_inbox(rid)
        finished = prefill_reported = False
        report: P.PrefillDone | None = None
        try:
            d.attach(rid, dec)
            d.attach(rid, pre)
            reserve_sent = time.monotonic()
            await d.pool.send(dec, P.Reserve(rid, job.prompt_ids, job.sampling, cfg.kv_deadline_s))
            while True:
                msg, _ = await d.next(inbox, job, dec.id, cfg.kv_deadline_s + 5.0, "a KV reservation")
                if isinstance(msg, P.Reserved):
                    reserved = msg
                    break
                d.raise_for(msg, job)
            prefill_deadline = cfg.kv_deadline_s - (time.monotonic() - reserve_sent) - PREFILL_DEADLINE_MARGIN_S
            if prefill_deadline <= 0:
                raise timed_out(f"request {rid}: the KV reservation on {dec.id} took the whole deadline "
                                f"({cfg.kv_deadline_s:.0f}s); add decode workers or raise --kv-deadline")
            job.clock.dispatched = time.monotonic()
            await d.pool.send(pre, P.Prefill(rid, job.prompt_ids, job.sampling, dec.id, reserved.kv_address,
                                             reserved.block_ids, prefill_deadline, reserved.cached_tokens))
            stream = TokenStream(job, self.policy, d.metrics)
            # token 1's logprobs (and the prompt's) come with P's report: D's tokens wait for it, if asked
            held: list[tuple[P.TokenOut, float]] | None = [] if needs_prefill_report(job.sampling) else None
            while not finished:
                waiting_for = "tokens" if stream.count else "prefill and KV transfer"
                timeout = cfg.token_timeout_s if stream.count else cfg.kv_deadline_s + 5.0
                msg, landed = await d.next(inbox, job, self.route, timeout, waiting_for)
                if isinstance(msg, P.PrefillDone):
                    report, prefill_reported = msg, True
                    d.pool.detach(rid, pre.id)  # P's part is over: losing P no longer matters
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
                    d.raise_for(msg, job)
                elif isinstance(msg, WorkerLost) and msg.worker_id == pre.id and prefill_reported:
                    continue
                else:
                    d.raise_for(msg, job)
            while report is None:  # D can finish (max_tokens=1) before P's report arrives
                msg, _ = await d.next(inbox, job, pre.id, PREFILL_REPORT_GRACE_S, "the prefill report")
                if isinstance(msg, P.PrefillDone):
                    report = msg
                elif not isinstance(msg, P.TokenOut):
                    d.raise_for(msg, job)
            for out, at in with_first_logprobs(held or [], report):
                yield stream.add(out, at)
            yield stream.done(stream.last, explained(self, timings(
                policy=self.policy, clock=job.clock, prompt_tokens=len(job.prompt_ids),
                completion_tokens=stream.count, worker=dec.id, prefilled_by=report.timeline,
                decoded_by=stream.last.timeline, prefill=report, prefill_worker=pre.id,
                transport=pre.info.transport, mode=pre.info.mode, kv_skipped_tokens=reserved.cached_tokens)))
        finally:
            if not finished:
                d.abort(rid, pre, dec)
            d.pool.close_inbox(rid)


Plan = Union[ColocatedPlan, DisaggregatedPlan]
PLANS: dict[Policy, type] = {Policy.COLOCATED: ColocatedPlan, Policy.DISAGGREGATED: DisaggregatedPlan}


def explained(plan: Plan, t):
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


# ---- the planner ----------------------------------------------------------------------------------


class Planner:
    """Makes each request's plan: its policy resolved, admitted, its workers chosen (see the top)."""

    def __init__(self, cfg: RouterConfig, pool: WorkerPool, admission: Admission, metrics: Metrics):
        self.cfg, self.pool, self.admission, self.metrics = cfg, pool, admission, metrics

    def resolve(self, requested: str | None, prompt_tokens: int) -> Policy:
        return self.decide(requested, list(range(prompt_tokens)))[0]

    def decide(self, requested: str | None, prompt_ids: list[int]) -> tuple[Policy, str | None]:
        """(policy, why: policy auto only). Auto, when the workers report: from the measured costs
        (server/kv_route.py auto_policy); without reports: the prompt's length against --auto-threshold.
        Counted in pdserve_auto_decisions; the why goes into timings.route.auto."""
        policy = Policy(requested or self.cfg.policy)
        if policy is not Policy.AUTO:
            return policy, None
        colocated, prefills = self.pool.alive(Role.COLOCATED), self.pool.alive(Role.PREFILL)
        policy, reason, why = auto_policy(self.servable(Policy.COLOCATED), self.servable(Policy.DISAGGREGATED),
                                          colocated, prefills, self.pool.kv, prompt_ids, self.cfg.auto_threshold,
                                          self.cfg.routing == "kv")
        return self._decided(policy, reason, why)

    def _decided(self, policy: Policy, reason: str, why: str) -> tuple[Policy, str]:
        self.metrics.auto_decisions.labels(policy, reason).inc()
        return policy, f"{policy}: {why}"

    def servable(self, policy: Policy) -> bool:
        if policy == Policy.COLOCATED:
            return bool(self.pool.alive(Role.COLOCATED))
        return any(self._prefills_for(d) for d in self.pool.alive(Role.DECODE))

    def servable_now(self) -> dict[Policy, bool]:
        return {policy: self.servable(policy) for policy in PLANS}

    def plan(self, job: Job) -> Plan:
        """Admit the job (429/503 with Retry-After at once if it cannot be) and choose its workers."""
        policy, why = self.decide(job.policy, job.prompt_ids)
        if why is not None:
            job = replace(job, auto=why)
        ticket = self.admission.admit(job.request_id, PLANS[policy].roles, len(job.prompt_ids))
        try:
            plan = self._choose(policy, job, fallback=self._fallback if self.cfg.failover else None)
        except NoWorker as e:
            ticket.release()
            self.metrics.requests.labels(policy, "no_worker").inc()
            raise unavailable(f"request {job.request_id} ({policy}): {e}", self.cfg.retry_after_s) from None
        except BaseException:
            ticket.release()
            raise
        plan.ticket = ticket
        self.metrics.routed.labels("least-loaded" if plan.estimate is None else "kv").inc()
        if self.cfg.migrate:
            plan.migrate = self._migration
        return plan

    def plan_all(self, jobs: list[Job]) -> list[Plan]:
        """Plans for the sequences of one prompt (n > 1): each admitted, all on the workers chosen for
        the first (so that one worker's prefix cache holds the prompt's KV for all of them)."""
        plans = [self.plan(jobs[0])]
        try:
            for job in jobs[1:]:
                ticket = self.admission.admit(job.request_id, plans[0].roles, len(job.prompt_ids))
                plans.append(replace(plans[0], job=job, ticket=ticket))
        except BaseException:
            for plan in plans:
                plan.ticket.release()
            raise
        return plans

    def _choose(self, policy: Policy, job: Job, without: str | None = None,
                fallback: Callable[[DisaggregatedPlan], Plan | None] | None = None) -> Plan:
        """The plan of `policy` for `job` on the workers the choice rule picks now, leaving out the
        decode worker `without`; raises NoWorker."""
        if policy == Policy.COLOCATED:
            workers = self._alive(Role.COLOCATED)
            est = self._kv_choice(workers, job)
            return ColocatedPlan(job, est.worker if est else least_loaded(workers), estimate=est)
        prefill, decode, est = self._pair(job, without)
        return DisaggregatedPlan(job, prefill, decode, fallback=fallback, estimate=est)

    def _kv_choice(self, workers: list[WorkerState], job: Job) -> Estimate | None:
        """The KV-aware choice among `workers` (None: --routing least-loaded, or none reports yet); the
        tokens it expects to compute there count as ahead of the next request until its first token."""
        if self.cfg.routing != "kv" or not reporting(workers, self.pool.kv):
            return None
        est = choose(workers, self.pool.kv, job.prompt_ids)
        est.worker.pending[job.request_id] = est.uncached_tokens
        self.pool.kv.expect(est.worker.id, est.names)  # its next turn may come before its report does
        est.worker.chosen += 1
        return est

    def _fallback(self, failed: DisaggregatedPlan) -> Plan | None:
        """Where a disaggregated request that failed before its first token runs once more: another pair
        without the decode worker that failed, else a colocated worker; under a request id of its own
        (the first try's aborts cannot reach it), admitted like any request. None: nowhere to go, or
        no room there."""
        job = replace(failed.job, request_id=f"{failed.job.request_id}-failover")
        for policy, without in ((Policy.DISAGGREGATED, failed.decode.id), (Policy.COLOCATED, None)):
            try:
                retry = self._choose(policy, job, without)
            except NoWorker:
                continue
            try:
                retry.ticket = self.admission.admit(job.request_id, retry.roles, len(job.prompt_ids))
            except APIError:
                return None
            self.metrics.failovers.labels(retry.policy).inc()
            return retry
        return None

    def _migration(self, lost: Plan, job: Job) -> Plan | None:
        """Where a request continues once its generating worker is lost (see the top): the same policy on
        other workers, else the other one; admitted like any request. None: nowhere, or no room."""
        order = (lost.policy, Policy.COLOCATED if lost.policy == Policy.DISAGGREGATED else Policy.DISAGGREGATED)
        for policy in order:
            try:
                nxt = self._choose(policy, job, lost.worker.id)
            except NoWorker:
                continue
            if nxt.worker.id == lost.worker.id:
                continue
            try:
                nxt.ticket = self.admission.admit(job.request_id, nxt.roles, len(job.prompt_ids))
            except APIError:
                return None
            self.metrics.migrations.labels(nxt.policy).inc()
            return nxt
        return None

    def _pair(self, job: Job, without: str | None = None) -> tuple[WorkerState, WorkerState, Estimate | None]:
        """(prefill, decode, estimate): of the decode workers some prefill worker can send KV to and with
        free blocks for the prompt (any, if none has them), the one that holds most of the prompt (kv;
        within the load rule) else the least loaded; then its prefill worker by the same choice."""
        prompt_tokens = len(job.prompt_ids)
        decodes = [d for d in self._alive(Role.DECODE) if d.id != without]
        paired = [d for d in decodes if self._prefills_for(d)]
        if not paired:
            have = ", ".join(f"{d.id} ({d.info.transport}/{d.info.mode})" for d in decodes)
            raise NoWorker(f"no prefill worker matches a decode worker's transport and mode (decode: {have}); "
                           f"start prefill workers with the same --transport and --mode")
        need = P.blocks_for(prompt_tokens, min(d.info.block_size for d in paired))
        decode = least_loaded(paired, need)
        if self.cfg.routing == "kv" and reporting(paired, self.pool.kv):
            held = {d.id: choose([d], self.pool.kv, job.prompt_ids)
                    for d in not_overloaded([d for d in paired if d.free_blocks >= need] or paired)}
            decode = max((self.pool.workers[i] for i in held), key=lambda d: (
                sum(held[d.id].cached.values()), -load(d)[0], d.free_blocks))
            self.pool.kv.expect(decode.id, held[decode.id].names)  # it will hold the prompt's KV
        prefills = self._prefills_for(decode)
        est = self._kv_choice(prefills, job)
        return (est.worker if est else least_loaded(prefills)), decode, est

    def _prefills_for(self, d: WorkerState) -> list[WorkerState]:
        return [p for p in self.pool.alive(Role.PREFILL) if p.can_send_kv_to(d)]

    def _alive(self, role: Role) -> list[WorkerState]:
        workers = self.pool.alive(role)
        if not workers:
            raise NoWorker(f"no {role} worker is registered; start one (pdserve-worker --role {role} "
                           f"--router {self.pool.address}) or use another policy")
        return workers
