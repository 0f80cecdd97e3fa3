"""Running planned requests: what every plan's run leans on, whatever its policy.

    Dispatcher(cfg, pool, metrics)
      .admission                      tickets per role (server/admission.py); the planner admits with it
      .link                           the WorkerLink every plan's run gets (server/link.py): its workers'
                                      messages, deadlines, failures as APIErrors, aborts
      .execute(plan)                  a plan's Token/Done events; /metrics counts the request, its ticket
                                      is released however it ends
      .execute_all(plans)             (choice index, event) of the n sequences of one prompt
      .drain(timeout_s)               SIGTERM: stop admitting, let in-flight requests finish, fail the rest

Which workers serve a request is server/routing.py's; how they are driven, server/plans.py's; the
request's vocabulary (Job in, Token and Done out) is server/job.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, AsyncIterator

from pdserve.server.admission import Admission
from pdserve.server.errors import APIError
from pdserve.server.job import Done, Token
from pdserve.server.link import WorkerLink
from pdserve.server.metrics import Metrics
from pdserve.server.plans import PREFILL_REPORT_GRACE_S
from pdserve.server.pool import WorkerPool
from pdserve.settings.router import RouterConfig

if TYPE_CHECKING:
    from pdserve.server.plans import RequestPlan

log = logging.getLogger("pdserve.router")


class Dispatcher:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, metrics: Metrics):
        self.metrics = metrics
        self.admission = Admission(cfg, pool, metrics)
        self.link = WorkerLink(cfg, pool, metrics)

    # ---- running ----------------------------------------------------------------------------------

    async def execute(self, plan: RequestPlan) -> AsyncIterator[Token | Done]:
        self.metrics.in_flight.inc()
        outcome, finish_reason = "cancelled", None
        try:
            async for event in plan.run(self.link):
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

    async def execute_all(self, plans: list[RequestPlan]) -> AsyncIterator[tuple[int, Token | Done]]:
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

        async def run(i: int, plan: RequestPlan) -> None:
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

    # ---- shutting down ----------------------------------------------------------------------------

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
        aborted = self.link.shut_down(f"the server is shutting down and its drain timeout ({timeout_s:.0f}s, "
                                      f"--drain-timeout) passed before this request finished")
        log.warning("drain timeout: aborted %d requests", aborted)
        await adm.wait_idle(PREFILL_REPORT_GRACE_S)  # their errors reach the clients; the workers are told
        await asyncio.sleep(0.1)  # the aborts to the workers go out (spawned sends)
        return pending, aborted

    async def close(self) -> None:
        await self.link.close()
