"""A request handed from a prefill worker to a decode worker: the engine's per-role calls.

KVHandoff is a part the engine owns (`engine.handoff`; Engine's calls of the same names hand over
to it). It is built from the engine's parts and is given the engine's record of its requests
through `Record` below: no other call of the engine. Each call moves a request along its ladder
(request.py) or raises IllegalTransition.
    prefill    prefill_batch(reqs, on_layer) -> [PrefillResult | Exception | None]   WAITING -> PREFILLING
               -> SENDING, several prompts in one forward, each request's outcome its own: first token,
               logits, block ids (they stay for the transfer); Engine.release(id) after it
               prefill_only(req, on_layer) -> PrefillResult   a batch of one, raising what failed it
               prefill_tokens(req) -> int                     the prompt tokens its prefill would compute now
    decode     reserve(id, n) -> block ids a transfer fills   WAITING -> RESERVED (None: no room now)
               begin_receiving(id)                          RESERVED -> RECEIVING (the sender began)
               adopt(req, first_token) -> StepOutput        -> RUNNING: the batch at decode step 2
               cancel(id)                                   -> CANCELLING (a write may still land);
                                                            Engine.release(id) once none can
Its parts: `prompts` (prompt_blocks.py: the one place a prompt's blocks are taken), `runner` and
`sampler` (a prefill's forward and its first token), `scheduler` (an adopted request joins the batch).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol

from pdserve.workers.engine.block_pool import OutOfBlocks
from pdserve.workers.engine.outputs import PrefillResult, StepOutput, prompt_logprobs_complete
from pdserve.workers.engine.request import IllegalTransition, InvalidRequest, Request, Status, stamp_end
from pdserve.workers.engine.sampler import SamplingError

if TYPE_CHECKING:
    from pdserve.workers.engine.step_trace import StepTrace
    from pdserve.workers.engine.prompt_blocks import PromptBlocks
    from pdserve.workers.engine.runner import ModelRunner
    from pdserve.workers.engine.sampler import Sampler
    from pdserve.workers.engine.scheduler import Scheduler


class Record(Protocol):
    """What the handoff is given of the engine's record of its requests (engine.py)."""
    requests: dict[str, Request]  # every request on this worker, until it finishes

    def admit(self, req: Request) -> None: ...  # checked and registered, WAITING

    def validate(self, req: Request) -> None: ...  # raises InvalidRequest

    def fail(self, request_id: str, error: str) -> None: ...  # FINISHED ("error"), blocks freed

    def append_token(self, req: Request, token: int) -> StepOutput: ...  # recorded: text, stop checks


class KVHandoff:
    def __init__(self, record: Record, prompts: PromptBlocks, runner: ModelRunner, sampler: Sampler,
                 scheduler: Scheduler, vocab_size: int):
        self.record = record
        self.requests = record.requests
        self.prompts = prompts
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.trace: StepTrace | None = None  # the engine's step trace (Engine.trace_steps), when on

    def _held(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise IllegalTransition(f"request {request_id} is not on this worker (never admitted, or finished)")
        return req

    def prefill_tokens(self, req: Request) -> int:
        """The prompt tokens a prefill of the request would compute now: those after the longest prefix
        our pool holds or the KV tiers would reload (what a prefill worker's batch budget counts). A look
        (plan counts nothing): a prefill worker asks it of every waiting request on every tick, and the
        tiers' hits and misses count the prefill's lookup once, when prefill_batch takes its blocks."""
        claim = self.prompts.plan(req)
        return req.num_tokens - (claim.blocks + len(claim.lower)) * self.prompts.block_size

    def prefill_only(self, req: Request, on_layer: Callable[[int], None] | None = None) -> PrefillResult:
        """Prefill one request now and sample its first token (prefill_batch of one); raises what failed
        it (the request finished, its blocks freed), or IllegalTransition (nothing changed)."""
        [result] = self.prefill_batch([req], on_layer)
        if isinstance(result, BaseException):
            raise result
        return result

    def prefill_batch(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None
                      ) -> list[PrefillResult | Exception | None]:
        """Prefill several requests in one forward, each its whole prompt from its longest cached prefix
        (the runner's mixed step: one row segment per request), and sample each one's first token (WAITING
        -> PREFILLING -> SENDING); their blocks stay until release(). Admits those the caller has not.
        on_layer(l): after layer l of the forward, for all of them at once.

        One entry per request, in order, and one request's outcome is its own:
          PrefillResult   SENDING
          Exception       what failed it alone, the request finished and its blocks freed: InvalidRequest
                          (admission), OutOfBlocks (the pool cannot hold it, no request before it in the
                          forward), its SamplingError; or the forward's own error, the same for every
                          request in it (their KV is half written). IllegalTransition: not its state to
                          prefill from, nothing changed
          None            not run: the pool has no room for it beside the requests before it in this
                          forward (their blocks come back after their transfers), so it and those after
                          it are left as they were (WAITING) for the next batch
        Every request in the forward gets its stamps from the batch: prefill_start when the batch began
        (before its blocks were taken: a reload from the tiers counts in its prefill), prefill_end (and
        token1) when the forward and the draw of the first tokens ended."""
        out: list[PrefillResult | Exception | None] = [None] * len(reqs)
        start = time.monotonic()
        batch: list[int] = []  # indices into reqs of the requests in the forward
        for i, req in enumerate(reqs):
            try:
                if self.requests.get(req.request_id) is not req:
                    self.record.admit(req)
                claim = self.prompts.plan(req)
                if not self.prompts.fits(claim) and batch:
                    break  # it and the requests after it wait for the next batch
                req.start_prefill()
            except (InvalidRequest, IllegalTransition) as e:
                out[i] = e
                continue
            try:
                if not self.prompts.fits(claim):
                    raise OutOfBlocks(f"request {req.request_id}: needs {claim.need} blocks, "
                                      f"{self.prompts.blocks.num_free} free")
                req.stamps.prefill_start = start
                # a reload is cheaper than computing those blocks (the cost model): this worker waits for it
                self.prompts.take(req, claim, wait=True)
            except BaseException as e:
                self.record.fail(req.request_id, f"{type(e).__name__}: {e}")
                if not isinstance(e, Exception):
                    raise
                out[i] = e
                continue
            batch.append(i)
        if not batch:
            return out
        members = [reqs[i] for i in batch]
        computed_from = time.monotonic()
        trace = self.trace
        try:
            traced = trace.begin("prefill", [(r, r.num_tokens - r.num_computed) for r in members], start,
                                 computed_from) if trace is not None else None
            logits = self.runner.prefill(members, on_layer)  # [len(members), vocab]
            picked = self.sampler.pick(logits, members)
            if trace is not None:
                trace.launched(traced, self.runner.path)
            waiting = time.monotonic()
            drawn = self.sampler.results(picked, members)
            if trace is not None:
                trace.settled(traced, time.monotonic() - waiting)
        except BaseException as e:
            for req in members:
                self.record.fail(req.request_id, f"{type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
            for i in batch:
                out[i] = e
            return out
        end = time.monotonic()
        for k, (i, req, (token, logprobs)) in enumerate(zip(batch, members, drawn)):
            token = prompt_logprobs_complete(req, token)
            if isinstance(token, SamplingError):
                self.record.fail(req.request_id, f"{type(token).__name__}: {token}")
                out[i] = token
                continue
            req.first_logprobs = logprobs
            stamp_end([req], start, end)
            self.prompts.name(req)
            req.output_ids = [token]
            req.start_sending()
            out[i] = PrefillResult(first_token=token, logits=logits[k], block_ids=list(req.block_ids))
        if self.prompts.tiers is not None:  # the forward's speed, over every token it computed
            computed = sum(len(r.prompt_ids) - r.cached_tokens for r in members)
            self.prompts.tiers.observe_prefill(computed, end - computed_from)
        return out

    # ---- decode role ---------------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for num_tokens of prompt KV (WAITING -> RESERVED), for an admitted request or, for an
        id not seen yet, a bare reservation whose request comes with adopt(). An admitted request's
        leading blocks may be ones the prefix cache holds: `req.cached_tokens` says how many tokens
        they cover, and a transfer writes only the blocks after them. None: no room now (an admitted
        request stays WAITING)."""
        req = self.requests.get(request_id) or Request(request_id, [])
        claim = self.prompts.plan(req, num_tokens)
        if req.status is Status.WAITING and not self.prompts.fits(claim):
            return None
        req.reserve()
        # blocks held in host memory (or on disk) and cheaper to reload than to receive: reloaded now
        # (cached_tokens grows by what landed; the sender skips it)
        self.prompts.take(req, claim, wait=True)
        self.requests[request_id] = req
        return list(req.block_ids)

    def begin_receiving(self, request_id: str) -> None:
        """The sender began writing into the request's blocks (RESERVED -> RECEIVING)."""
        self._held(request_id).start_receiving()

    def cancel(self, request_id: str) -> None:
        """Aborted while a write may still land (RESERVED or RECEIVING -> CANCELLING): its blocks stay
        until release(), once the KV receiver says no write can reach them."""
        self._held(request_id).cancel()

    def adopt(self, req: Request, first_token: int) -> StepOutput:
        """Continue a request whose prompt KV sits in its reserved blocks (RESERVED or RECEIVING ->
        RUNNING); returns the output of its first token (which may finish it, or fail it). Raises
        InvalidRequest, with the request finished and its blocks freed, if they cannot be used."""
        held = self._held(req.request_id)
        held.start_running()
        if held is not req:  # reserved by id alone: the request itself comes now
            req.take_over(held)
            self.requests[req.request_id] = req
        try:
            if held is not req:
                self.record.validate(req)
            if len(req.block_ids) * self.prompts.block_size < len(req.prompt_ids):
                raise InvalidRequest(f"request {req.request_id}: {len(req.block_ids)} blocks cannot hold "
                                     f"{len(req.prompt_ids)} prompt tokens")
            if not 0 <= first_token < self.vocab_size:
                raise InvalidRequest(f"request {req.request_id}: first token {first_token} is outside the "
                                     f"vocabulary (0..{self.vocab_size - 1})")
        except InvalidRequest as e:
            self.record.fail(req.request_id, str(e))  # the reservation ends here: its blocks go back
            raise
        req.num_computed = len(req.prompt_ids)
        req.output_ids = []
        req.adopted = True
        self.prompts.name(req)  # the prompt's KV is all here now
        self.scheduler.adopt(req)
        return self.record.append_token(req, first_token)
