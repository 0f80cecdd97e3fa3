"""--migrate: a running request whose generating worker is lost continues on another worker.

    migrating(plan, d, events)      the plan's run (`events`); when the worker generating it (a pair's
                                    decode worker, or a colocated worker) is lost after token 1, the
                                    rest comes from the continuation plan.migrate(plan, job) makes
                                    (server/routing.py, Planner._migration): again, while workers are left
    continued(job, sent, move)      the continuation's job: the tokens the client has appended to the
                                    prompt, their count off max_tokens and min_tokens, no prompt
                                    logprobs, an id of its own, the same clock

The client's stream goes on without a gap; the one Done counts every token and lists the moves in
`timings.migrations`. Exact for greedy decoding; what differs otherwise: docs/design-fencing.md.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator

import msgspec

from pdserve.protocol.timings import Migration
from pdserve.server.dispatch import Done, Job, Token
from pdserve.server.errors import APIError

if TYPE_CHECKING:
    from pdserve.server.dispatch import Dispatcher
    from pdserve.server.routing import Plan

log = logging.getLogger("pdserve.router")


async def migrating(plan: Plan, d: Dispatcher, events: AsyncIterator[Token | Done]) -> AsyncIterator[Token | Done]:
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
                current, events = nxt, nxt._run(d)
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
