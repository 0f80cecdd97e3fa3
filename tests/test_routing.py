"""server/routing.py on its own: the policy, the worker choice, the pairing and the failover plan, against
worker records in a stand-in pool (no sockets, no worker processes, no event loop but the one failover
run, server/plans.py's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy, Role
from pdserve.protocol.timings import Timings
from pdserve.server.admission import Admission, Refused, unavailable
from pdserve.settings.router import RouterConfig
from pdserve.server.kv_index import KVIndex
from pdserve.server.job import Done, Job
from pdserve.server.errors import APIError, worker_failed
from pdserve.server.metrics import Metrics
from pdserve.server.pool import WorkerState
from pdserve.server.plans import ColocatedPlan, DisaggregatedPlan
from pdserve.server.routing import Planner
from pdserve.server.worker_choice import load

THRESHOLD = 8


def worker(wid: str, role: Role, *, transport: str = "ipc", mode: str = "bulk", free: int = 1000,
           queue: int = 0, inflight: int = 0) -> WorkerState:
    kv = role is not Role.COLOCATED
    reg = P.Register(P.PROTOCOL_VERSION, wid, role, f"tcp://127.0.0.1:1{len(wid)}", "tiny", 64, 16, 1000, free,
                     "cpu", "float32", 1, transport if kv else None, mode if kv else None,
                     "tcp://127.0.0.1:1" if role is Role.DECODE else None)
    w = WorkerState(reg, f"inc-{wid}", None, 0.0, free, queue_depth=queue)
    w.inflight = {f"{wid}-r{i}" for i in range(inflight)}
    return w


class Pool:
    """The part of WorkerPool the planner and admission read: the live workers of a role."""

    address = "tcp://router:7100"

    def __init__(self, *workers: WorkerState):
        self.workers = {w.id: w for w in workers}
        self.kv = KVIndex()  # no worker reports its blocks here: the choice is the least loaded

    def alive(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]


def planner(*workers: WorkerState, **cfg) -> Planner:
    config = RouterConfig(model="tiny", auto_threshold=THRESHOLD, **cfg)
    pool, metrics = Pool(*workers), Metrics("tiny")
    return Planner(config, pool, Admission(config, pool, metrics), metrics)


def job(tokens: int = 4, policy: str | None = None, rid: str = "cmpl-1") -> Job:
    return Job(rid, list(range(tokens)), P.Sampling(), policy)


def test_policy_explicit_default_and_auto_at_the_threshold():
    both = (worker("c0", Role.COLOCATED), worker("d0", Role.DECODE), worker("p0", Role.PREFILL))
    r = planner(*both)
    assert r.resolve("colocated", 1000) is Policy.COLOCATED and r.resolve("disaggregated", 1) is Policy.DISAGGREGATED
    assert r.resolve(None, THRESHOLD - 1) is Policy.COLOCATED  # the router's default: auto
    assert r.resolve("auto", THRESHOLD) is Policy.DISAGGREGATED  # at the threshold: no longer short
    assert planner(*both, policy="colocated").resolve(None, 1000) is Policy.COLOCATED
    # auto takes the other policy when only it can be served now; an explicit one is kept (and fails)
    only_colocated = planner(worker("c0", Role.COLOCATED))
    assert only_colocated.resolve("auto", 1000) is Policy.COLOCATED
    assert only_colocated.resolve("disaggregated", 1000) is Policy.DISAGGREGATED
    assert planner(*both[1:]).resolve("auto", 1) is Policy.DISAGGREGATED
    assert planner(*both).servable_now() == {Policy.COLOCATED: True, Policy.DISAGGREGATED: True}
    assert planner(worker("d0", Role.DECODE)).servable_now() == {Policy.COLOCATED: False,
                                                                 Policy.DISAGGREGATED: False}


def test_the_least_loaded_worker_is_chosen():
    busy = worker("busy", Role.COLOCATED, queue=5)
    held = worker("held", Role.COLOCATED, inflight=2)  # the router's own count, exact at once
    idle = worker("idle", Role.COLOCATED, free=10)
    roomier = worker("roomier", Role.COLOCATED, free=900)  # as idle, with more free blocks
    plan = planner(busy, held, idle, roomier).plan(job())
    assert isinstance(plan, ColocatedPlan) and plan.worker is roomier and plan.policy is Policy.COLOCATED
    assert sorted([busy, held, idle, roomier], key=load) == [roomier, idle, held, busy]
    assert plan.ticket.roles == (Role.COLOCATED,)


def test_pairing_matches_transport_and_mode_and_prefers_decode_workers_with_room():
    full = worker("full", Role.DECODE, free=1)  # the least loaded, but no room for 64 tokens (4 blocks)
    roomy = worker("roomy", Role.DECODE, queue=1)
    nixl = worker("nixl", Role.DECODE, transport="nixl")  # no prefill worker speaks nixl
    layer = worker("layer", Role.DECODE, mode="layer")  # nor layer mode
    p_busy, p_idle = worker("p-busy", Role.PREFILL, queue=3), worker("p-idle", Role.PREFILL)
    r = planner(full, roomy, nixl, layer, p_busy, p_idle)
    plan = r.plan(job(64, "disaggregated"))
    assert isinstance(plan, DisaggregatedPlan) and (plan.prefill, plan.decode) == (p_idle, roomy)
    assert plan.route == "p-idle/roomy" and plan.ticket.roles == (Role.DECODE, Role.PREFILL)
    assert r.plan(job(16, "disaggregated", "cmpl-2")).decode is full  # one block: full has room for it
    assert not p_idle.can_send_kv_to(nixl) and not p_idle.can_send_kv_to(layer) and not roomy.can_send_kv_to(p_idle)


def test_no_worker_is_a_503_with_retry_after_and_its_ticket_is_given_back():
    r = planner(worker("c0", Role.COLOCATED), retry_after_s=3)
    with pytest.raises(Refused) as e:
        r.plan(job(policy="disaggregated"))
    assert (e.value.status, e.value.code, e.value.retry_after_s) == (503, "no_worker", 3)
    assert "no decode worker is registered" in e.value.message
    # workers of both roles, but none that can pair: the choice says what to start
    r = planner(worker("d0", Role.DECODE, transport="nixl"), worker("p0", Role.PREFILL))
    with pytest.raises(Refused) as e:
        r.plan(job(policy="disaggregated"))
    assert e.value.status == 503 and "no prefill worker matches" in e.value.message
    assert "d0 (nixl/bulk)" in e.value.message
    assert r.admission.in_flight == 0


def test_the_failover_plan_is_another_pair_then_colocated_then_none():
    d0, d1, p0 = worker("d0", Role.DECODE), worker("d1", Role.DECODE, queue=9), worker("p0", Role.PREFILL)
    c0 = worker("c0", Role.COLOCATED)
    assert planner(d0, p0, c0).plan(job(policy="disaggregated")).fallback is None  # off by default
    r = planner(d0, d1, p0, c0, failover=True)
    first = r.plan(job(policy="disaggregated"))
    assert first.decode is d0 and first.fallback is not None
    retry = first.fallback(first)
    assert isinstance(retry, DisaggregatedPlan) and retry.decode is d1 and retry.fallback is None  # once only
    assert retry.job.request_id == "cmpl-1-failover" and retry.job.clock is first.job.clock  # TTFT counts both
    assert r.admission.in_flight == 2  # the retry is admitted like any request
    del r.pool.workers["d1"]
    assert isinstance(first.fallback(first), ColocatedPlan)
    del r.pool.workers["c0"]
    assert first.fallback(first) is None


class Ticket:
    released = False

    def release(self) -> None:
        self.released = True


@dataclass
class Scripted:
    """A plan whose run is scripted: these events, then this error (if any)."""

    route: str
    events: list
    error: Exception | None = None
    ticket: Ticket | None = None

    async def run(self, d):
        for e in self.events:
            yield e
        if self.error is not None:
            raise self.error


class ScriptedPair(DisaggregatedPlan):
    """A disaggregated plan whose own run (the pair's) is `first`; run() and its failover are the real ones."""

    first: Scripted

    async def _run(self, d):
        async for e in self.first.run(d):
            yield e


def run_pair(first: Scripted, fallback) -> list:
    plan = ScriptedPair(job(), worker("p0", Role.PREFILL), worker("d0", Role.DECODE), fallback=fallback)
    plan.first = first

    async def collect() -> list:
        return [e async for e in plan.run(None)]
    return asyncio.run(collect())


def test_a_plan_that_fails_before_its_first_token_runs_its_fallback_and_says_so():
    done = Done("length", Timings(policy="colocated", worker="c0"), [1])
    retry = Scripted("c0", [done], ticket=Ticket())
    [out] = run_pair(Scripted("", [], worker_failed("request cmpl-1: peer unreachable", "transfer_error")),
                     lambda failed: retry)
    assert out.timings.failover.from_ == "p0/d0" and out.timings.failover.to == "c0"
    assert "peer unreachable" in out.timings.failover.error and retry.ticket.released
    with pytest.raises(APIError, match="peer unreachable"):  # nowhere to go: the first error stands
        run_pair(Scripted("", [], worker_failed("request cmpl-1: peer unreachable")), lambda failed: None)
    with pytest.raises(APIError, match="after token 1"):  # a token went out: never run twice
        run_pair(Scripted("", [done], worker_failed("request cmpl-1: after token 1")), lambda failed: retry)
    with pytest.raises(APIError, match="shutting down"):  # the drain's abort is not the pair's failure
        run_pair(Scripted("", [], unavailable("request cmpl-1: aborted: shutting down", 1, "shutting_down")),
                 lambda failed: retry)
