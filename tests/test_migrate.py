"""--migrate: a request whose generating worker is lost after token 1 continues on another worker.

On its own (server/plans.py, scripted runs): the continuation's job (prompt + the
tokens so far, the limits less those, its own id, the same clock), the stream without a gap, one Done
for the whole request with `timings.migrations`, the continuation's admission released. Live: a
pdserve with --migrate, the decode worker of a streaming disaggregated request SIGKILLed mid-
generation; the stream completes with the greedy tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import pytest

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy
from pdserve.protocol.timings import Timings
from pdserve.server.job import Done, Job, Token
from pdserve.server.errors import worker_failed
from pdserve.server.plans import continued, migrating
from test_routing import Ticket
from test_server_harness import TINY, Pdserve

pytestmark = pytest.mark.timeout(240)


@dataclass
class Worker:
    id: str


@dataclass
class Run:
    """A plan whose run is scripted: tokens, then a Done or an error."""

    job: Job
    worker: Worker
    events: list
    error: Exception | None = None
    ticket: Ticket | None = None
    migrate: object = None
    policy: Policy = Policy.DISAGGREGATED

    @property
    def route(self) -> str:
        return f"p0/{self.worker.id}"

    async def _run(self, d):
        for e in self.events:
            yield e
        if self.error is not None:
            raise self.error


def tokens(*ids: int) -> list[Token]:
    return [Token(i, f"<{i}>", False) for i in ids]


def test_continued_job_carries_the_tokens_so_far_and_what_is_left_of_the_limits():
    job = Job("cmpl-1", [1, 2, 3], P.Sampling(max_tokens=10, min_tokens=4, prompt_logprobs=2), None)
    nxt = continued(job, [7, 8, 9], 1)
    assert nxt.request_id == "cmpl-1-m1" and nxt.prompt_ids == [1, 2, 3, 7, 8, 9] and nxt.clock is job.clock
    assert (nxt.sampling.max_tokens, nxt.sampling.min_tokens, nxt.sampling.prompt_logprobs) == (7, 1, None)
    assert job.prompt_ids == [1, 2, 3]  # the request's own job is left as it was


def run_all(plan) -> list:
    async def collect() -> list:
        return [e async for e in migrating(plan, None, plan._run(None))]
    return asyncio.run(collect())


def test_a_lost_worker_after_token_1_hands_the_rest_to_the_continuation():
    job = Job("cmpl-1", [1, 2, 3], P.Sampling(max_tokens=5), None)
    lost = worker_failed("request cmpl-1: worker d0 was lost mid-request (killed)", code="worker_lost")
    asked = []
    second = Run(continued(job, [10, 11], 1), Worker("c0"),
                 tokens(12, 13) + [Token(14, "<14>", True), Done("length", Timings(policy="colocated", prompt_tokens=5,
                                                                                   completion_tokens=3), [12, 13, 14])],
                 ticket=Ticket(), policy=Policy.COLOCATED)

    def migrate(plan, nxt_job):
        asked.append((plan.worker.id, nxt_job.prompt_ids, nxt_job.sampling.max_tokens))
        return second

    first = Run(job, Worker("d0"), tokens(10, 11), lost, migrate=migrate)
    events = run_all(first)
    assert [e.token_id for e in events if isinstance(e, Token)] == [10, 11, 12, 13, 14]  # no gap, no repeat
    done = events[-1]
    assert isinstance(done, Done) and done.token_ids == [10, 11, 12, 13, 14]
    assert (done.timings.prompt_tokens, done.timings.completion_tokens) == (3, 5)  # the request's, not the continuation's
    [m] = done.timings.migrations
    assert (m.from_, m.to, m.after_tokens) == ("d0", "p0/c0", 2) and "killed" in m.error
    assert asked == [("d0", [1, 2, 3, 10, 11], 3)] and second.ticket.released


def test_no_migration_before_token_1_without_the_flag_or_for_other_errors():
    job = Job("cmpl-1", [1], P.Sampling(max_tokens=5), None)
    lost = worker_failed("request cmpl-1: worker d0 was lost mid-request", code="worker_lost")
    never = lambda plan, job: pytest.fail("migrated")  # noqa: E731
    for run in (Run(job, Worker("d0"), [], lost, migrate=never),  # nothing went out: --failover's business
                Run(job, Worker("d0"), tokens(4), lost),  # no --migrate
                Run(job, Worker("d0"), tokens(4), worker_failed("request cmpl-1: bad draw", code="internal_error"),
                    migrate=never)):
        with pytest.raises(Exception, match="request cmpl-1"):
            run_all(run)


def stream_tokens(srv: Pdserve, body: dict, on_token=None) -> tuple[list[int], dict]:
    ids, last = [], None
    for _, event in srv.stream("/v1/completions", body):
        if event == "[DONE]":
            break
        assert "error" not in event, event
        for choice in event.get("choices", []):
            ids += choice.get("token_ids") or []
        if event.get("timings"):
            last = event["timings"]
        if on_token is not None:
            on_token(len(ids))
    return ids, last


def test_killing_the_decode_worker_mid_stream_the_request_completes_with_the_same_tokens():
    with Pdserve(*TINY, "--migrate", "--no-restart", "--heartbeat-interval", "0.25", "--heartbeat-misses", "20",
                 "--token-timeout", "20") as srv:
        # the SIGKILL below is seen by the supervisor at once; the heartbeats only catch a hung worker, and three
        # misses (0.75 s) dropped an idle decode worker on a loaded 2-core CI machine before the test reached it
        body = {"model": "tiny", "prompt": "The river runs past the old mill and", "max_tokens": 160,
                "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True}
        undisturbed, _ = stream_tokens(srv, dict(body, policy="colocated"))
        pids = srv.worker_pids()
        decode = next((wid for wid in pids if wid.startswith("decode")), None)
        assert decode is not None, f"no decode worker in /health: {srv.health()}"
        stopped = []

        def stop_at(n: int) -> None:
            if n >= 20 and not stopped:  # mid-generation: freeze it, then kill it
                os.kill(pids[decode], signal.SIGSTOP)
                os.kill(pids[decode], signal.SIGKILL)
                stopped.append(n)

        got, timings = stream_tokens(srv, dict(body, policy="disaggregated"), stop_at)
        print(f"\nkilled {decode} after {stopped} tokens; timings.migrations {timings.get('migrations')}")
        assert stopped and len(undisturbed) == 160
        assert got == undisturbed
        [m] = timings["migrations"]
        assert m["from"] == decode and m["after_tokens"] >= 20 and m["after_tokens"] < 160
        assert timings["completion_tokens"] == 160
        metrics = srv.get("/metrics").text
        assert any(line.startswith("pdserve_migrations_total{") and not line.endswith(" 0.0")
                   for line in metrics.splitlines()), metrics[-2000:]
