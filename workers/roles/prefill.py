"""Prefill role: build a request's KV, push it into a decode worker's reserved blocks, report.

Life cycle of a request (its status, in the engine: workers/engine/request.py):
    Prefill   -> engine.admit()         WAITING     in arrival order (InvalidRequest -> RequestFailed invalid;
                                                    Abort -> RequestFailed aborted)
              -> _next_batch()                      the waiting requests whose decode worker is ready, in
                                                    arrival order, while the prompt tokens their prefills
                                                    compute (a cached prefix is not) fit --max-batched-tokens
                                                    and they number at most --max-num-seqs; the first
                                                    whatever its length (a long prompt is never split);
                                                    the prompt tokens of those left waiting go to the
                                                    router in the heartbeat (kv_report.queue)
              -> engine.prefill_batch(batch, on_layer)
                                        PREFILLING  one forward for the batch, each request from its longest
                                                    prefix in our prefix cache; every request's transfer
                                                    opens at the first layer, once its source blocks exist
                                                    (its Accept comes back during the forward); layer mode:
                                                    transfer.layer_done(i) after each layer moves layer i;
                                                    the blocks the decode worker holds
                                                    already (skip_tokens) are not sent. The batch shares the
                                                    forward's stamps: prefill_start, prefill_end
              -> transfer.start_finish(first_token), then transfer.poll() on every tick
                                        SENDING     bulk mode: each request's KV moves once the forward ended
                                                    and its decode worker accepted; then it is told "kv done"
                                                    with the first token; meanwhile the loop goes on with
                                                    other requests (`sending`)
              -> engine.release()       FINISHED    (sent) our blocks go back at once
              -> PrefillDone (timeline: inbox, queue, prefill; exposed transfer = last copy complete -
                                                prefill end; all on this process's clock)
                 or RequestFailed (invalid | capacity | transfer | timeout | internal; the transfer is
                                                aborted, engine.fail() frees the blocks)

One request's failure is its own: a deadline passed, a transfer that fails, a draw that fails, or no
room in the pool fails that request alone, and the others of its batch go on (a request for which the
pool has no room beside the ones before it waits for the next batch; the first of a batch fails with
`capacity`, as alone). The forward stops early only once every request in it has failed.

Deadline: the router gives each Prefill a deadline shorter than the decode worker's reservation
(the Request's `deadline`); past it the request fails with `timeout` before (or instead of)
transferring, rather than sending KV the decode worker no longer waits for (its receiver would
refuse it anyway).

Connect (from the router, when a decode worker with our transport registers) shakes hands with its
KV receiver at once, so the first request to it does not pay the handshake in its TTFT.

Faults stay local: the loop never waits for a decode worker. A request starts its prefill only once
the handshake with its decode worker is done (sender.reach() READY); one bound for a decode worker
whose handshake is under way waits without holding up the others; one bound for a DEAD one (it
disconnected, or failed its handshake) fails at once with `transfer`. A transfer waiting for its
peer's answers sits in `sending` (the transport's state; the Request is SENDING) and is polled each
tick; an Abort from the router ends it there, and its blocks come back at once.

No queues of its own: the queue is the engine's WAITING requests, in arrival order; where each one's
KV goes rides on the Request (`send_to`). The engine holds a request's blocks for one prefill and
its transfer.

Why batches: a forward of a 7B model over a short prompt is partly bound by reading its weights (~15
GB at ~4 TB/s, ~3.6 ms a forward, against ~28 us a token of compute on an H200), so prompts prefilled
one at a time waste what a colocated worker, which runs several prompts' chunks in one step, does not.
`--max-batched-tokens 1` prefills one prompt at a time.
"""

from __future__ import annotations

import logging
import time

from pdserve.protocol import control as P
from pdserve.protocol.enums import FailureKind
from pdserve.workers.engine.block_pool import OutOfBlocks
from pdserve.workers.engine.outputs import PrefillResult
from pdserve.workers.engine.request import InvalidRequest, KVTarget, Request, Stamps, Status
from pdserve.workers.engine.sampler import SamplingError
from pdserve.workers.roles.base import Role, now, timeline
from pdserve.workers.transfer.base import PeerState, Transfer, TransferState, TransferStats
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_sender

log = logging.getLogger("pdserve.worker")

SENDING_POLL_MS = 1  # a transfer waits for its decode worker's answer: check this often
HELD_POLL_MS = 5  # a request waits for its decode worker's handshake (at most --handshake-timeout)


class PrefillDeadline(TransferError):
    pass


class PrefillRole(Role):
    QUEUED = (Status.WAITING,)
    ACTIVE = (Status.PREFILLING, Status.SENDING)

    def __init__(self, worker):
        super().__init__(worker)
        self.sender = make_sender(self.engine.kv, worker.cfg.transfer)
        self.sending: dict[str, tuple[Request, Transfer, int]] = {}  # rid -> (request, transfer, first token)
        self._held = False  # the last tick left WAITING requests for decode workers still shaking hands
        # one forward prefills several waiting prompts: up to this many prompt tokens computed (the first
        # prompt whatever its length) and this many requests (settings/worker.py, max_batched_tokens)
        self.batch_tokens = self.engine.config.max_batched_tokens
        self.batch_seqs = self.engine.config.max_num_seqs

    def on_message(self, msg, arrived: float | None) -> None:
        if isinstance(msg, P.Prefill):
            taken = now()
            received = taken if arrived is None else arrived
            req = Request(msg.request_id, list(msg.prompt_ids), msg.sampling,
                          stamps=Stamps(arrived=received, taken=taken), deadline=received + msg.deadline_s,
                          send_to=KVTarget(msg.decode_worker, msg.kv_address, list(msg.dst_blocks), msg.skip_tokens))
            try:
                bs = self.engine.layout.block_size
                if msg.skip_tokens % bs or msg.skip_tokens >= len(msg.prompt_ids):
                    raise InvalidRequest(f"request {msg.request_id}: skip_tokens {msg.skip_tokens} must be a multiple "
                                         f"of the block size {bs} below the prompt's {len(msg.prompt_ids)} tokens")
                self.engine.admit(req)
            except InvalidRequest as e:
                self.fail(msg.request_id, FailureKind.INVALID, str(e))
        elif isinstance(msg, P.Connect):  # a decode worker (re)registered: shake hands now, without waiting
            self.sender.reach(msg.kv_address, fresh=True)
        elif isinstance(msg, P.Abort):
            req = self.engine.requests.get(msg.request_id)
            if req is not None and req.status is Status.WAITING:
                self.engine.abort(msg.request_id)
                self.fail(msg.request_id, FailureKind.ABORTED, f"aborted before prefill: {msg.reason}")
            elif msg.request_id in self.sending:  # its decode worker may be gone: do not wait for it
                req, transfer, _ = self.sending.pop(msg.request_id)
                transfer.abort(msg.reason)
                self.engine.fail(msg.request_id, f"aborted during the transfer: {msg.reason}")
                self.fail(msg.request_id, FailureKind.ABORTED, f"aborted during the KV transfer: {msg.reason}")
        else:
            log.error("%s: prefill worker got %s; only Prefill, Connect and Abort go to prefill workers",
                      self.worker_id, type(msg).__name__)

    def advance(self) -> None:
        for rid in list(self.sending):
            self._follow(rid)
        batch = self._next_batch()
        if batch:
            self._run(batch)

    def _next_batch(self) -> list[Request]:
        """The WAITING requests whose decode worker is ready, in arrival order, while the prompt tokens their
        prefills compute (engine.prefill_tokens: a cached prefix is not computed) stay within
        --max-batched-tokens and they number at most --max-num-seqs; the first whatever its length. One
        past its deadline fails here (timeout), one bound for a DEAD decode worker too (transfer); one whose
        decode worker is still shaking hands waits without holding up those after it. The tokens of those
        left waiting go to the router (kv_report: what a prefill here waits behind)."""
        self._held = False
        batch: list[Request] = []
        tokens = queued = 0
        full = False
        for req in self.engine.in_state(Status.WAITING):
            if full:  # past this batch: checked when its turn comes
                queued += self.engine.prefill_tokens(req)
                continue
            if now() >= req.deadline:
                text = (f"request {req.request_id}: waited {now() - req.stamps.arrived:.1f}s in the prefill queue, "
                        f"past its deadline of {req.deadline - req.stamps.arrived:.1f}s; add prefill workers or "
                        f"raise the router's --kv-deadline")
                self.engine.fail(req.request_id, text)
                self.fail(req.request_id, FailureKind.TIMEOUT, text)
                continue
            state, why = self.sender.reach(req.send_to.address)
            if state is PeerState.DEAD:
                text = (f"KV transfer {self.worker_id} -> {req.send_to.worker_id} failed: the decode worker at "
                        f"{req.send_to.address} is unreachable ({why}); retry the request on another one")
                self.engine.fail(req.request_id, text)
                self.fail(req.request_id, FailureKind.TRANSFER, text)
                continue
            n = self.engine.prefill_tokens(req)
            if state is not PeerState.READY:
                self._held = True
                queued += n
                continue
            if batch and (tokens + n > self.batch_tokens or len(batch) >= self.batch_seqs):
                full = True
                queued += n
                continue
            batch.append(req)
            tokens += n
        report = getattr(self.worker, "kv_report", None)
        if report is not None:
            report.queue(queued)
        return batch

    def poll_timeout_ms(self, idle_ms: int) -> int:
        if self.engine.in_state(Status.WAITING) and not self._held:
            return 0
        if self.sending:
            return SENDING_POLL_MS
        return HELD_POLL_MS if self._held else idle_ms

    def close(self) -> None:
        self.sender.close()

    def _run(self, batch: list[Request]) -> None:
        """Prefill the batch in one forward; then each request goes on alone: its transfer opened (at the
        forward's first layer) and started, followed in `sending`. What fails one request (its deadline,
        its transfer, its draw, no room for it) fails it alone; the forward stops only once every request
        in it has failed."""
        transfers: dict[str, Transfer] = {}
        errors: dict[str, Exception] = {}  # a request's failure during the forward: no more layers for it

        def on_layer(layer: int) -> None:
            live = [r for r in batch if r.status is Status.PREFILLING and r.request_id not in errors]
            for req in live:
                try:
                    self._layer_done(req, layer, transfers)
                except Exception as e:
                    errors[req.request_id] = e
            if live and all(r.request_id in errors for r in live):  # nothing left to compute for
                raise errors[live[0].request_id]

        # both modes open each transfer at the forward's first layer (bulk: layer_done moves nothing), so the
        # decode worker's Accept comes back while the forward runs and the KV moves as soon as it ends; opened
        # after it, a bulk transfer's Accept was still due at the _follow below and its KV waited for the next
        # tick: under load, a whole next forward (the 1P:1D pair's exposed transfer on one H100 at bc07f77
        # averaged 29 ms at 5 req/s, 75 ms at 10, mixed workload, for ~1 ms of copies)
        results = self.engine.prefill_batch(batch, on_layer)
        prefilled = [r for r, result in zip(batch, results) if isinstance(result, PrefillResult)]
        if prefilled:  # the forward's speed, once over all its tokens (they share its time)
            self.observe_prefill(*prefilled)
        for req, result in zip(batch, results):
            if result is None:  # no room beside the others: it waits for the next batch
                continue
            rid, to = req.request_id, req.send_to
            transfer = transfers.get(rid)
            try:
                if isinstance(result, Exception) or rid in errors:
                    raise errors.get(rid, result)
                if transfer is None:
                    transfer = self._open(req, result.block_ids)
                remaining = req.deadline - now()
                if remaining <= 0:
                    raise PrefillDeadline(f"request {rid}: deadline of {req.deadline - req.stamps.arrived:.1f}s "
                                          f"passed before the transfer to {to.worker_id} could start")
                transfer.start_finish(result.first_token, remaining)
            except Exception as e:
                self._failed(req, transfer, e)
                continue
            self.sending[rid] = (req, transfer, result.first_token)
            self._follow(rid)

    def _layer_done(self, req: Request, layer: int, transfers: dict[str, Transfer]) -> None:
        """The request's KV of `layer` is in place; its transfer opens at its first layer, once its source
        blocks exist (layer mode moves each layer now, bulk mode all of them after the forward)."""
        rid = req.request_id
        if now() >= req.deadline:
            raise PrefillDeadline(f"request {rid}: deadline of {req.deadline - req.stamps.arrived:.1f}s passed "
                                  f"during prefill (layer {layer}); nothing more is sent to {req.send_to.worker_id}")
        if rid not in transfers:
            transfers[rid] = self._open(req, req.block_ids)
        transfers[rid].layer_done(layer)

    def _open(self, req: Request, src_blocks: list[int]) -> Transfer:
        """The request's transfer, from its blocks after those the decode worker holds already (skip_tokens)."""
        to = req.send_to
        skip = to.skip_tokens // self.engine.layout.block_size
        return self.sender.open(req.request_id, to.address, list(src_blocks[skip:]), list(to.dst_blocks),
                                len(req.prompt_ids) - to.skip_tokens)

    def _follow(self, rid: str) -> None:
        """One look at a transfer waiting for its decode worker: done, failed, or still waiting."""
        req, transfer, first_token = self.sending[rid]
        try:
            stats = transfer.poll()
        except Exception as e:
            del self.sending[rid]
            self._failed(req, transfer, e)
            return
        if stats is not None:
            del self.sending[rid]
            self._done(req, first_token, stats)

    def _failed(self, req: Request, transfer: Transfer | None, e: Exception) -> None:
        rid = req.request_id
        if transfer is not None and transfer.state is not TransferState.DONE:
            transfer.abort(f"{type(e).__name__}: {e}")
        text = _failure_text(e, self.worker_id, req.send_to.worker_id)
        self.engine.fail(rid, text)  # no-op where prefill_only already finished it
        self.fail(rid, _failure_kind(e), text)

    def _done(self, req: Request, first_token: int, stats: TransferStats) -> None:
        rid = req.request_id
        self.engine.release(rid)
        s = req.stamps  # the last copy complete, on this worker's clock (and not before the prefill's end)
        s.kv_delivered = max(s.prefill_end, monotonic(stats.finished_at))
        self.worker.send(P.PrefillDone(
            worker_id=self.worker_id, request_id=rid, first_token=first_token, timeline=timeline(req),
            transfer_ms=(stats.finished_at - stats.started_at) * 1e3,
            kv_bytes=stats.num_bytes, copies=stats.copies, first_logprobs=req.first_logprobs,
            prompt_logprobs=None if req.params.prompt_logprobs is None else req.prompt_logprobs,
        ))


def monotonic(wall: float) -> float:
    """A time.time() stamp (the transport's) on this process's time.monotonic() clock."""
    return wall - (time.time() - time.monotonic())


def _failure_kind(e: Exception) -> FailureKind:
    if isinstance(e, PrefillDeadline):
        return FailureKind.TIMEOUT
    if isinstance(e, InvalidRequest):
        return FailureKind.INVALID
    if isinstance(e, OutOfBlocks):
        return FailureKind.CAPACITY
    if isinstance(e, TransferError):
        return FailureKind.TRANSFER
    if isinstance(e, SamplingError):  # this request's logits or draw; the worker is fine
        return FailureKind.INTERNAL
    log.exception("prefill failed unexpectedly")
    return FailureKind.INTERNAL


def _failure_text(e: Exception, worker_id: str, decode_worker: str) -> str:
    if isinstance(e, (InvalidRequest, PrefillDeadline, SamplingError)):
        return str(e)
    if isinstance(e, TransferError):
        return f"KV transfer {worker_id} -> {decode_worker} failed: {e}"
    return f"prefill on {worker_id} failed: {type(e).__name__}: {e}"
