"""The engine's calls for a request handed from a prefill worker to a decode worker (the per-role API).

KVHandoff is a part of Engine (its base class), kept here so that engine.py reads as the step and
the record of the requests; it uses the engine's requests, blocks, scheduler, runner, sampler and
tiers, and moves each request along its ladder (request.py) or raises IllegalTransition.
    prefill    prefill_only(req, on_layer) -> PrefillResult   WAITING -> PREFILLING -> SENDING: first
               token, logits, block ids (they stay for the transfer); release(id) after it
    decode     reserve(id, n) -> block ids a transfer fills   WAITING -> RESERVED (None: no room now)
               begin_receiving(id)                          RESERVED -> RECEIVING (the sender began)
               adopt(req, first_token) -> StepOutput        -> RUNNING: the batch at decode step 2
               cancel(id)                                   -> CANCELLING (a write may still land)
               release(id)                                  the blocks go back once no write can land
"""

from __future__ import annotations

import time
from typing import Callable

from pdserve.workers.engine.block_pool import OutOfBlocks, blocks_for
from pdserve.workers.engine.outputs import PrefillResult, StepOutput
from pdserve.workers.engine.request import InvalidRequest, Request, Status, stamp_end
from pdserve.workers.engine.sampler import SamplingError


class KVHandoff:
    """Engine's prefill and decode calls (see the module docstring); not made on its own."""

    def prefill_only(self, req: Request, on_layer: Callable[[int], None] | None = None) -> PrefillResult:
        """Prefill one request now and sample its first token (WAITING -> PREFILLING -> SENDING); its
        blocks stay until release(). Admits it if the caller has not. On any error (OutOfBlocks, its
        SamplingError, the forward's) the request is finished and its blocks freed, then it raises."""
        if self.requests.get(req.request_id) is not req:
            self.admit(req)
        req.start_prefill()
        try:
            hit = self.scheduler.cached_prefix(req)
            lower = self.scheduler.lower_prefix(req, len(hit))
            need = blocks_for(len(req.prompt_ids), self.layout.block_size) - len(hit)
            if not self.blocks.can_allocate(need, hit):
                raise OutOfBlocks(f"request {req.request_id}: needs {need} blocks, {self.blocks.num_free} free")
            self.scheduler.take_blocks(req, hit, need)
            req.num_computed = req.cached_tokens = len(hit) * self.layout.block_size
            req.stamps.prefill_start = time.monotonic()
            self.blocks.count(len(req.prompt_ids), req.cached_tokens)
            if lower:  # reloading is cheaper than computing them (the cost model): this worker waits for it
                self.scheduler.start_reload(req, lower)
                self.tiers.poll(req, wait=True)
            computed_from = time.monotonic()
            logits = self.runner.prefill([req], on_layer)
            [(token, req.first_logprobs)] = self.sampler.results(self.sampler.pick(logits, [req]), [req])
            token = self._prompt_logprobs_done(req, token)
            if isinstance(token, SamplingError):
                raise token
            stamp_end([req], req.stamps.prefill_start, time.monotonic())
            self._name_blocks(req)
            if self.tiers is not None:
                computed = len(req.prompt_ids) - req.cached_tokens
                self.tiers.observe_prefill(computed, req.stamps.prefill_end - computed_from)
        except BaseException as e:
            self._finish(req, "error", f"{type(e).__name__}: {e}")
            raise
        req.output_ids = [token]
        req.start_sending()
        return PrefillResult(first_token=token, logits=logits[0], block_ids=list(req.block_ids))

    def release(self, request_id: str) -> None:
        """The transfer is over: the blocks of a SENDING (prefill worker) or RESERVED, RECEIVING or
        CANCELLING (decode worker) request go back; no-op for an id not here."""
        req = self.requests.get(request_id)
        if req is not None:
            req.release()
            self._forget(req)

    # ---- decode role ---------------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for num_tokens of prompt KV (WAITING -> RESERVED), for an admitted request or, for an
        id not seen yet, a bare reservation whose request comes with adopt(). An admitted request's
        leading blocks may be ones the prefix cache holds: `req.cached_tokens` says how many tokens
        they cover, and a transfer writes only the blocks after them. None: no room now (an admitted
        request stays WAITING)."""
        req = self.requests.get(request_id) or Request(request_id, [])
        hit = self.scheduler.cached_prefix(req) if req.prompt_ids and num_tokens == len(req.prompt_ids) else []
        need = blocks_for(num_tokens, self.layout.block_size) - len(hit)
        if req.status is Status.WAITING and not self.blocks.can_allocate(need, hit):
            return None
        whole = req.prompt_ids and num_tokens == len(req.prompt_ids)
        lower = self.scheduler.lower_prefix(req, len(hit)) if whole else []
        req.reserve()
        self.scheduler.take_blocks(req, hit, need)
        req.num_computed = req.cached_tokens = len(hit) * self.layout.block_size
        if req.prompt_ids:
            self.blocks.count(len(req.prompt_ids), req.cached_tokens)
        if lower:  # held in host memory (or on disk) and cheaper to reload than to receive: reloaded now
            self.scheduler.start_reload(req, lower)
            self.tiers.poll(req, wait=True)  # cached_tokens grows by what landed; the sender skips it
        self.requests[request_id] = req
        return list(req.block_ids)

    def begin_receiving(self, request_id: str) -> None:
        """The sender began writing into the request's blocks (RESERVED -> RECEIVING)."""
        self._get(request_id).start_receiving()

    def cancel(self, request_id: str) -> None:
        """Aborted while a write may still land (RESERVED or RECEIVING -> CANCELLING): its blocks stay
        until release(), once the KV receiver says no write can reach them."""
        self._get(request_id).cancel()

    def adopt(self, req: Request, first_token: int) -> StepOutput:
        """Continue a request whose prompt KV sits in its reserved blocks (RESERVED or RECEIVING ->
        RUNNING); returns the output of its first token (which may finish it, or fail it). Raises
        InvalidRequest, with the request finished and its blocks freed, if they cannot be used."""
        held = self._get(req.request_id)
        held.start_running()
        if held is not req:  # reserved by id alone: the request itself comes now
            req.take_over(held)
            self.requests[req.request_id] = req
        try:
            if held is not req:
                self.validate(req)
            if len(req.block_ids) * self.layout.block_size < len(req.prompt_ids):
                raise InvalidRequest(f"request {req.request_id}: {len(req.block_ids)} blocks cannot hold "
                                     f"{len(req.prompt_ids)} prompt tokens")
            if not 0 <= first_token < self.vocab_size:
                raise InvalidRequest(f"request {req.request_id}: first token {first_token} is outside the "
                                     f"vocabulary (0..{self.vocab_size - 1})")
        except InvalidRequest as e:
            self._finish(req, "error", str(e))  # the reservation ends here: its blocks go back
            raise
        req.num_computed = len(req.prompt_ids)
        req.output_ids = []
        req.adopted = True
        self._name_blocks(req)  # the prompt's KV is all here now
        self.scheduler.adopt(req)
        return self._append(req, first_token, None)
