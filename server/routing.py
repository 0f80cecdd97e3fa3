"""Routing: which workers serve a request, decided here once, when its plan is made (how the workers
are then driven is the plan's: server/plans.py).

    Planner(cfg, pool, admission, metrics)
      .decide(requested, prompt_ids)       (policy, why): the request's, else cfg.policy; `auto`: from the
                                           workers' reports and measured costs (see decide), else colocated
                                           below cfg.auto_threshold prompt tokens; the other policy when only
                                           it is servable now. resolve(requested, prompt_tokens): the policy
      .servable(policy), .servable_now()   live workers can serve it now (/health)
      .plan(job), .plan_all(jobs)          admitted (429/503 with Retry-After at once) and on its workers
      where a plan goes on when its workers fail: --failover (before token 1: another pair without the
      decode worker, else a colocated worker) and --migrate (after token 1: the same policy on other
      workers, else the other policy); both admitted like any request

Worker choice (--routing), the rule made once from the config (server/worker_choice.py): `kv` (the
default, once workers report their block names): the lowest predicted TTFT, priced in milliseconds from
the prefix each worker holds and its measured costs, under a load rule (server/kv_route.py); a
disaggregated request's decode worker is the one holding most of its prompt (not re-sent), its prefill
worker priced the same way. `least-loaded`, a decode worker with free blocks for the prompt first. A
prefill worker pairs only with a decode worker it can send KV to (its transport and mode). The choice
and what it expected go into timings.route.

A new policy: its member in protocol/enums.py Policy, its plan class in server/plans.py PLANS, and its
choice here in Planner._choose. /health, the CLI's and the API's choices and the metrics' labels follow
the enum.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy, Role, Routing
from pdserve.server.admission import Admission, unavailable
from pdserve.server.errors import APIError
from pdserve.server.job import Job
from pdserve.server.kv_route import Estimate, auto_policy
from pdserve.server.metrics import Metrics
from pdserve.server.plans import PLANS, ColocatedPlan, DisaggregatedPlan, RequestPlan
from pdserve.server.pool import NoWorker, WorkerPool, WorkerState
from pdserve.server.worker_choice import CHOICES
from pdserve.settings.router import RouterConfig


def named(est: Estimate | None) -> dict[str, list[bytes]]:
    """{worker id: the prompt's block names there} of a KV-aware choice: what the plan has the KV index
    list once that worker takes the request (never before: a worker may refuse it)."""
    return {est.worker.id: est.names} if est is not None and est.names else {}


# ---- the planner ----------------------------------------------------------------------------------


class Planner:
    """Makes each request's plan: its policy resolved, admitted, its workers chosen (see the top)."""

    def __init__(self, cfg: RouterConfig, pool: WorkerPool, admission: Admission, metrics: Metrics):
        self.cfg, self.pool, self.admission, self.metrics = cfg, pool, admission, metrics
        self.choice = CHOICES[Routing(cfg.routing)](pool.kv)  # --routing: who takes each part of a request

    def resolve(self, requested: str | None, prompt_tokens: int) -> Policy:
        return self.decide(requested, list(range(prompt_tokens)))[0]

    def decide(self, requested: str | None, prompt_ids: list[int]) -> tuple[Policy, str | None]:
        """(policy, why: policy auto only). Auto, when the worker choice prices the workers from their
        reports: from the measured costs (server/kv_route.py auto_policy); else the prompt's length against
        --auto-threshold.
        Counted in pdserve_auto_decisions; the why goes into timings.route.auto."""
        policy = Policy(requested or self.cfg.policy)
        if policy is not Policy.AUTO:
            return policy, None
        colocated, prefills = self.pool.alive(Role.COLOCATED), self.pool.alive(Role.PREFILL)
        policy, reason, why = auto_policy(self.servable(Policy.COLOCATED), self.servable(Policy.DISAGGREGATED),
                                          colocated, prefills, self.pool.kv, prompt_ids, self.cfg.auto_threshold,
                                          self.choice.priced(colocated + prefills))
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

    def plan(self, job: Job) -> RequestPlan:
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
        self.metrics.routed.labels(Routing.LEAST_LOADED if plan.estimate is None else Routing.KV).inc()
        if self.cfg.migrate:
            plan.migrate = self._migration
        return plan

    def plan_all(self, jobs: list[Job]) -> list[RequestPlan]:
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
                fallback: Callable[[DisaggregatedPlan], RequestPlan | None] | None = None) -> RequestPlan:
        """The plan of `policy` for `job` on the workers the worker choice picks now, leaving out the
        decode worker `without`; raises NoWorker."""
        if policy == Policy.COLOCATED:
            worker, est = self.choice.worker(self._alive(Role.COLOCATED), job)
            return ColocatedPlan(job, worker, estimate=est, kv_names=named(est))
        prefill, decode, est, held = self._pair(job, without)
        return DisaggregatedPlan(job, prefill, decode, fallback=fallback, estimate=est,
                                 kv_names=named(est) | named(held))

    def _fallback(self, failed: DisaggregatedPlan) -> RequestPlan | None:
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

    def _migration(self, lost: RequestPlan, job: Job) -> RequestPlan | None:
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

    def _pair(self, job: Job, without: str | None = None) \
            -> tuple[WorkerState, WorkerState, Estimate | None, Estimate | None]:
        """(prefill, decode, the prefill's estimate, the decode's): the worker choice's decode worker, of those
        some prefill worker can send KV to (with free blocks for the prompt first); then its prefill worker,
        by the same choice."""
        prompt_tokens = len(job.prompt_ids)
        decodes = [d for d in self._alive(Role.DECODE) if d.id != without]
        paired = [d for d in decodes if self._prefills_for(d)]
        if not paired:
            have = ", ".join(f"{d.id} ({d.info.transport}/{d.info.mode})" for d in decodes)
            raise NoWorker(f"no prefill worker matches a decode worker's transport and mode (decode: {have}); "
                           f"start prefill workers with the same --transport and --mode")
        need = P.blocks_for(prompt_tokens, min(d.info.block_size for d in paired))
        decode, held = self.choice.decode(paired, need, job)
        prefill, est = self.choice.worker(self._prefills_for(decode), job)
        return prefill, decode, est, held

    def _prefills_for(self, d: WorkerState) -> list[WorkerState]:
        return [p for p in self.pool.alive(Role.PREFILL) if p.can_send_kv_to(d)]

    def _alive(self, role: Role) -> list[WorkerState]:
        workers = self.pool.alive(role)
        if not workers:
            raise NoWorker(f"no {role} worker is registered; start one (pdserve-worker --role {role} "
                           f"--router {self.pool.address}) or use another policy")
        return workers
