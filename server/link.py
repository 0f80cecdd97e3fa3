"""A request's link to its workers: what a plan's run (server/plans.py) uses to drive them, and all it
sees of the router. The Dispatcher makes one and hands it to every plan it runs.

    WorkerLink(cfg, pool, metrics)
      .cfg                                the router's config (the plans read their deadlines there)
      .open_inbox(rid) / .close_inbox(rid)  the request's queue of its workers' messages
      .attach(rid, w) / .detach(rid, w)   depend on a worker (losing it puts WorkerLost in the inbox; 503
                                          if it is gone already), and stop depending on it
      .send(w, msg)                       a control message to a worker
      .accepted(w, kv_names)              w took the request: the KV index lists its prompt's block names there
      .next(inbox, job, who, timeout, what)  the request's next message within a deadline (else 504)
      .raise_for(msg, job)                a worker's failure (or the drain's Shutdown) as the APIError it means
      .abort(rid, *workers)               Abort to those of the workers still alive, sent in the background
      .stream(job, policy)                the request's TokenStream (its stamps and token metrics)
      .shut_down(reason)                  the Dispatcher's drain, past its timeout: every request in flight
                                          fails now (Shutdown in its inbox); its run aborts its workers
      .close()                            cancel the aborts still being sent (the router stops)
"""

from __future__ import annotations

import asyncio
import time

from pdserve.protocol import control as P
from pdserve.protocol.enums import FailureKind, Policy
from pdserve.server.admission import unavailable
from pdserve.server.errors import bad_request, timed_out, worker_failed
from pdserve.server.job import Job, TokenStream
from pdserve.server.metrics import Metrics
from pdserve.server.pool import NoWorker, WorkerLost, WorkerPool, WorkerState
from pdserve.settings.router import RouterConfig


class Shutdown:
    """Put in every in-flight request's inbox when the drain timeout passes: the request fails."""

    def __init__(self, reason: str):
        self.reason = reason


class WorkerLink:
    def __init__(self, cfg: RouterConfig, pool: WorkerPool, metrics: Metrics):
        self.cfg, self._pool, self._metrics = cfg, pool, metrics
        self._background: set[asyncio.Task] = set()

    def open_inbox(self, rid: str) -> asyncio.Queue:
        return self._pool.open_inbox(rid)

    def close_inbox(self, rid: str) -> None:
        self._pool.close_inbox(rid)

    def attach(self, rid: str, w: WorkerState) -> None:
        try:
            self._pool.attach(rid, w)
        except NoWorker as e:
            raise unavailable(f"request {rid}: {e}", self.cfg.retry_after_s) from None

    def detach(self, rid: str, w: WorkerState) -> None:
        self._pool.detach(rid, w.id)

    def accepted(self, w: WorkerState, kv_names: dict[str, list[bytes]]) -> None:
        self._pool.accepted(w, kv_names.get(w.id, []))

    async def send(self, w: WorkerState, msg) -> None:
        await self._pool.send(w, msg)

    def stream(self, job: Job, policy: Policy) -> TokenStream:
        return TokenStream(job, policy, self._metrics)

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
            if self._pool.is_alive(w.id):
                self._spawn(self._pool.send(w, P.Abort(rid, "the router gave up on the request")))

    def shut_down(self, reason: str) -> int:
        """Shutdown into every open inbox: each request's run raises it (503 shutting_down). How many."""
        now = time.monotonic()
        for q in self._pool.inboxes.values():
            q.put_nowait((Shutdown(reason), now))
        return len(self._pool.inboxes)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
