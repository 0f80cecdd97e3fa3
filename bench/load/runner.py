"""Sending the planned requests and timing every token.

    send_one          one streamed request (/v1/completions, or /v1/chat/completions with SendOptions.chat)
                      -> RequestRecord (TTFT, every gap, E2E, timings, cached tokens, the reply's text)
    run_open_loop     each request at its planned time, whether or not earlier ones have answered
                      (with max_concurrency: at most that many in flight, later ones wait their turn,
                      as vllm bench serve's --max-concurrency)
                      (with an EarlyStop: no more sends, and the requests in flight dropped, once the run can
                      no longer meet its SLO target: bench/load/early_stop.py)
    run_closed_loop   a fixed number of requests in flight; the next goes when one finishes
    warmup_until_steady  unrecorded batches (sent at once) until two in a row agree on median TTFT
                      (bounded); any failure stops the run

A failed request (server error, timeout, broken stream) becomes a record with success=False and the
error's message; anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from pdserve.bench.load.capacity import is_steady
from pdserve.bench.load.early_stop import CHECK_EVERY_S, EarlyStop
from pdserve.bench.load.metrics import RequestRecord
from pdserve.bench.load.workload import Sample
from pdserve.client import AsyncClient, ClientError


@dataclass(frozen=True)
class SendOptions:
    ignore_eos: bool = True  # generate exactly max_tokens, so output lengths are the planned ones
    stream_usage: bool = False  # ask for usage in the stream (stream_options.include_usage)
    extra_body: dict | None = None
    chat: bool = False  # /v1/chat/completions (a prompt goes as one user message) instead of /v1/completions


@dataclass(frozen=True)
class Planned:
    index: int
    sample: Sample
    policy: str | None
    send_at_s: float | None = None  # open loop: seconds after the run start
    messages: list[dict] | None = None  # chat: the whole conversation so far (else the prompt as one message)
    conversation: int | None = None  # multi-turn: which conversation and turn, from 1 (bench/load/multiturn.py)
    turn: int | None = None


class WarmupFailed(RuntimeError):
    pass


def _body_extra(opts: SendOptions) -> dict:
    extra = dict(opts.extra_body or {})
    if opts.stream_usage:
        extra["stream_options"] = {"include_usage": True}
    return extra


async def send_one(client: AsyncClient, p: Planned, t0: float, opts: SendOptions,
                   watch: EarlyStop | None = None) -> RequestRecord:
    rec = RequestRecord(index=p.index, policy=p.policy, prompt_len=p.sample.prompt_len,
                        expected_output_len=p.sample.output_len, planned_prompt_len=p.sample.prompt_len,
                        kind=p.sample.kind, conversation=p.conversation, turn=p.turn,
                        scheduled_s=p.send_at_s if p.send_at_s is not None else time.perf_counter() - t0)
    start = time.perf_counter()
    rec.start_s = start - t0
    if watch is not None:
        watch.started(p.index, start, p.sample.output_len)
    last = None
    events = 0
    try:
        options = {"policy": p.policy, "max_tokens": p.sample.output_len,
                   "ignore_eos": True if opts.ignore_eos else None, "extra": _body_extra(opts)}
        opened = client.stream_chat(p.messages or [{"role": "user", "content": p.sample.prompt}], **options) \
            if opts.chat else client.stream_complete(p.sample.prompt, **options)
        async with opened as stream:
            async for delta in stream:
                if not delta.is_token:
                    continue
                events += 1
                if last is None:
                    rec.ttft_s = delta.arrival - start
                    if watch is not None:
                        watch.first_token(p.index, delta.arrival)
                else:
                    rec.itls_s.append(delta.arrival - last)
                last = delta.arrival
        rec.e2e_s = time.perf_counter() - start
        result = stream.result
    except ClientError as e:
        rec.e2e_s = time.perf_counter() - start
        rec.error = str(e)
        rec.request_id = e.request_id
        return rec
    rec.request_id = result.id
    rec.reply = result.text
    rec.timings = result.timings.to_dict() if result.timings is not None else None
    usage = result.usage
    if usage is not None and usage.prompt_tokens is not None:
        rec.prompt_len = usage.prompt_tokens
    elif result.timings is not None and result.timings.prompt_tokens is not None:
        rec.prompt_len = result.timings.prompt_tokens
    if usage is not None and usage.cached_tokens is not None:
        rec.cached_tokens = usage.cached_tokens
    elif result.timings is not None and result.timings.cached_tokens is not None:
        rec.cached_tokens = result.timings.cached_tokens
    if usage is not None and usage.completion_tokens is not None:
        rec.output_len = usage.completion_tokens
    elif result.timings is not None and result.timings.completion_tokens is not None:
        rec.output_len = result.timings.completion_tokens
    else:
        rec.output_len = events
    if events == 0:
        rec.error = f"the stream carried no tokens (finish_reason={result.finish_reason})"
    elif result.finish_reason is None:
        rec.error = "the stream ended without a finish_reason (the server stopped mid-answer?)"
    else:
        rec.success = True
    return rec


async def run_open_loop(client: AsyncClient, planned: list[Planned], opts: SendOptions,
                        on_done: Callable[[RequestRecord], None] = lambda r: None,
                        max_concurrency: int | None = None,
                        watch: EarlyStop | None = None) -> tuple[list[RequestRecord], float]:
    """Returns the records (in plan order) and the run's duration in seconds. A request held back by
    max_concurrency keeps its planned send time (scheduled_s), so the wait shows as lateness. With
    `watch`, the run stops once watch.certain_fail(): nothing more is sent (those requests get no record)
    and the requests in flight are dropped (each a failed record saying so); watch records when."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    stopped = asyncio.Event()

    async def go(p: Planned) -> RequestRecord:
        async with gate:
            rec = await send_one(client, p, t0, opts, watch)
        if watch is not None:
            watch.ended(rec)
        on_done(rec)
        return rec

    async def monitor(sent: list) -> None:
        while True:
            now = time.perf_counter()
            if watch.certain_fail(now):
                watch.stop(now, t0, len(sent))
                stopped.set()
                return
            await asyncio.sleep(CHECK_EVERY_S)

    t0 = time.perf_counter()
    sent: list[tuple[Planned, asyncio.Task]] = []
    watcher = asyncio.create_task(monitor(sent)) if watch is not None else None
    try:
        for p in sorted(planned, key=lambda p: p.send_at_s):
            delay = t0 + p.send_at_s - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopped.wait(), delay)
            if stopped.is_set():
                break
            sent.append((p, asyncio.create_task(go(p))))
        tasks = [t for _, t in sent]
        if watcher is not None and tasks:
            halt = asyncio.ensure_future(stopped.wait())
            pending = set(tasks)
            while pending and not stopped.is_set():
                _, pending = await asyncio.wait(pending | {halt}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(halt)
            halt.cancel()
            for t in pending:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=watch is not None)
    finally:
        if watcher is not None:
            watcher.cancel()
    records = []
    for (p, _), result in zip(sent, results):
        if isinstance(result, asyncio.CancelledError):  # dropped when the run stopped early
            records.append(RequestRecord(index=p.index, policy=p.policy, prompt_len=p.sample.prompt_len,
                                         expected_output_len=p.sample.output_len,
                                         planned_prompt_len=p.sample.prompt_len, kind=p.sample.kind,
                                         scheduled_s=p.send_at_s, start_s=p.send_at_s,
                                         error="dropped: the probe stopped once it could not meet its SLO target"))
        elif isinstance(result, BaseException):
            raise result
        else:
            records.append(result)
    duration = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.index), duration


async def run_closed_loop(client: AsyncClient, planned: list[Planned], concurrency: int, opts: SendOptions,
                          on_done: Callable[[RequestRecord], None] = lambda r: None
                          ) -> tuple[list[RequestRecord], float]:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    todo = list(planned)
    todo.reverse()  # pop() from the end hands them out in plan order
    records: list[RequestRecord] = []

    async def worker():
        while todo:
            rec = await send_one(client, todo.pop(), t0, opts)
            records.append(rec)
            on_done(rec)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(planned)))))
    duration = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.index), duration


@dataclass
class WarmupReport:
    policy: str | None
    batch_size: int
    tolerance: float  # relative: |median TTFT of batch k - of batch k-1| <= tolerance * the earlier
    max_batches: int
    median_ttft_ms: list[float] = field(default_factory=list)  # one per batch run
    steady: bool = False  # False: max_batches ran without two agreeing (measured anyway, and said so)

    @property
    def batches(self) -> int:
        return len(self.median_ttft_ms)

    def to_dict(self) -> dict:
        return {**asdict(self), "batches": self.batches}


async def warmup_until_steady(client: AsyncClient, batch: Callable[[int], list[Sample]], policy: str | None,
                              opts: SendOptions, *, max_batches: int, tolerance: float) -> WarmupReport:
    """`batch(k)` gives warm-up batch k (the same lengths each time, fresh text, so no server cache can
    make a later batch look steady). Every request of a batch goes at once."""
    report = WarmupReport(policy, 0, tolerance, max_batches)
    for k in range(max_batches):
        samples = batch(k)
        report.batch_size = len(samples)
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(send_one(client, Planned(-1 - i, s, policy), t0, opts)
                                      for i, s in enumerate(samples)))
        for rec, sample in zip(recs, samples):
            if not rec.success:
                raise WarmupFailed(f"warmup request ({policy or 'no policy'}, {sample.prompt_len} prompt tokens) "
                                   f"failed: {rec.error}; fix the server or the arguments before measuring")
        report.median_ttft_ms.append(float(np.median([r.ttft_s * 1e3 for r in recs])))
        if is_steady(report.median_ttft_ms, tolerance):
            report.steady = True
            break
    return report
