"""Admission control at the router: a request is admitted at once or refused at once, never queued
without bound.

    Admission(cfg, pool, metrics)
      .admit(request_id, roles, prompt_tokens) -> Ticket   raises APIError 429 / 503 (with Retry-After)
      .draining / .start_drain()                           after it: every new request gets 503
      .in_flight                                           admitted requests not yet released
      .wait_idle(timeout_s) -> bool                        True once nothing is in flight

Per role (colocated; prefill and decode for a disaggregated request) two bounds: requests in flight
and prompt tokens in flight (what the role's workers must prefill or hold). Their defaults come
from the KV capacity the role's live workers registered (num_blocks * block_size tokens):

    requests  cfg.max_inflight_requests or the role's total KV blocks (a running request holds at
              least one block, so more could never run at once)
    tokens    cfg.max_inflight_tokens or 2x the role's KV tokens (one pool's worth running, one waiting)

Over a bound: 429 with Retry-After, before any worker sees the request. No live worker for a role
the request needs: 503 with Retry-After. A Ticket is released exactly once, whichever of the
request's ends (its workers' last message, its response, a disconnect) comes first: a stream's
events are taken from its workers at their pace (workers_pace), not at its client's, so a client
that stops reading holds no admission once its workers are done, and is dropped after
--send-timeout (AdmittedStream).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.router")

TOKENS_PER_KV_TOKEN = 2  # default token bound: this many pools' worth of prompt tokens in flight per role


class Refused(APIError):
    """An APIError whose response carries Retry-After (seconds)."""

    def __init__(self, status: int, message: str, type: str, code: str, retry_after_s: int):
        super().__init__(status, message, type, None, code)
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={"Retry-After": str(self.retry_after_s)})


def unavailable(message: str, retry_after_s: int, code: str = "no_worker") -> Refused:
    return Refused(503, message, "service_unavailable", code, retry_after_s)


class Ticket:
    def __init__(self, admission: "Admission", request_id: str, roles: tuple[str, ...], tokens: int):
        self._admission, self.request_id, self.roles, self.tokens = admission, request_id, roles, tokens
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self)


class Admission:
    def __init__(self, cfg, pool, metrics):
        self.cfg, self.pool, self.metrics = cfg, pool, metrics
        self.requests: dict[str, int] = {}  # role -> admitted requests in flight
        self.tokens: dict[str, int] = {}  # role -> their prompt tokens
        self.tickets: set[Ticket] = set()
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self.tickets)

    def limits(self, role: str) -> tuple[int, int]:
        """(requests, prompt tokens) the role may have in flight, from its live workers' KV capacity."""
        workers = self.pool.alive(role)
        blocks = sum(w.info.num_blocks for w in workers)
        kv_tokens = sum(w.info.num_blocks * w.info.block_size for w in workers)
        return (self.cfg.max_inflight_requests or blocks, self.cfg.max_inflight_tokens or TOKENS_PER_KV_TOKEN * kv_tokens)

    def admit(self, request_id: str, roles: tuple[str, ...], prompt_tokens: int) -> Ticket:
        retry = self.cfg.retry_after_s
        if self.draining:
            self._reject("draining")
            raise unavailable(f"request {request_id}: the server is shutting down and takes no new requests; "
                              f"retry against another replica or after it restarts", retry, "shutting_down")
        for role in roles:
            if not self.pool.alive(role):
                self._reject("no_worker", role)
                raise unavailable(f"request {request_id}: no {role} worker is registered; start one (pdserve-worker "
                                  f"--role {role} --router {self.pool.address}) or use another policy", retry)
        for role in roles:
            max_requests, max_tokens = self.limits(role)
            n, t = self.requests.get(role, 0), self.tokens.get(role, 0)
            if n + 1 > max_requests:
                self._reject("requests", role)
                raise Refused(429, f"request {request_id}: the {role} workers have {n} requests in flight, the most "
                              f"this server admits (--max-inflight-requests {max_requests}); retry after "
                              f"{retry}s", "rate_limit_exceeded", "overloaded", retry)
            if t + prompt_tokens > max_tokens and t > 0:  # one request alone is always admitted
                self._reject("tokens", role)
                raise Refused(429, f"request {request_id}: its {prompt_tokens} prompt tokens would bring the {role} "
                              f"workers' prompt tokens in flight to {t + prompt_tokens}, over this server's bound "
                              f"of {max_tokens} (--max-inflight-tokens); retry after {retry}s",
                              "rate_limit_exceeded", "overloaded", retry)
        ticket = Ticket(self, request_id, roles, prompt_tokens)
        for role in roles:
            self.requests[role] = self.requests.get(role, 0) + 1
            self.tokens[role] = self.tokens.get(role, 0) + prompt_tokens
            self._gauge(role)
        self.tickets.add(ticket)
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        for role in ticket.roles:
            self.requests[role] -= 1
            self.tokens[role] -= ticket.tokens
            self._gauge(role)
        if not self.tickets:
            self._idle.set()

    def _gauge(self, role: str) -> None:
        self.metrics.admitted.labels(role).set(self.requests.get(role, 0))
        self.metrics.admitted_tokens.labels(role).set(self.tokens.get(role, 0))

    def _reject(self, reason: str, role: str = "") -> None:
        self.metrics.rejected.labels(role, reason).inc()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return not self.tickets


class Tickets:
    """The admission tickets of one response's sequences (n > 1), released together."""

    def __init__(self, tickets: list[Ticket]):
        self.tickets = tickets
        self.request_id = tickets[0].request_id.rsplit("-", 1)[0] if len(tickets) > 1 else tickets[0].request_id

    def release(self) -> None:
        for t in self.tickets:
            t.release()


class SendTimeout(Exception):
    """The client stopped reading: a response chunk could not be sent within the send timeout."""


class AdmittedStream(StreamingResponse):
    """A StreamingResponse that releases its request's admission ticket however the response ends,
    even if its body generator never started (the client left first), and gives up on a client that
    has not taken a chunk for send_timeout_s (its connection is closed)."""

    def __init__(self, content, ticket: Ticket | Tickets, send_timeout_s: float, **kw):
        super().__init__(content, **kw)
        self.ticket = ticket
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope, receive, send):
        async def send_within(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                raise SendTimeout() from None

        try:
            await super().__call__(scope, receive, send_within)
        except SendTimeout:
            log.warning("request %s: its client took no data for %.0fs (--send-timeout); dropped",
                        self.ticket.request_id, self.send_timeout_s)
            await self.body_iterator.aclose()
        finally:
            self.ticket.release()


async def workers_pace(events: AsyncIterator) -> AsyncIterator:
    """`events`, taken from the workers as fast as they come, whatever the pace of whoever iterates
    this: they wait here (at most one request's tokens) while a slow client reads, and the request's
    workers and admission are done with it when they are. Closing this stops `events`."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for item in events:
                queue.put_nowait((item, None))
            queue.put_nowait((end, None))
        except Exception as e:  # the consumer raises it, in order
            queue.put_nowait((end, e))
        finally:
            await events.aclose()

    task = asyncio.ensure_future(pump())
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
