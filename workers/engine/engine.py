"""The engine every worker role runs: one model, one KV pool, continuous batching, and the one
record of the requests on this worker.

State: `requests` maps each request id to its Request from admission until it finishes; the
Request's `status` (request.py: the ladder) is the only record of where it stands. The
scheduler's queues order the requests it runs; the roles and the KV receiver keep no copy of it,
they look requests up here. Each call below moves a request along its ladder, or raises
IllegalTransition and changes nothing.

For the roles:
    colocated  add_request(req): WAITING in the scheduler; step() until finished (PREFILLING, RUNNING)
    prefill    admit(req): WAITING in the prefill queue; prefill_batch(reqs, on_layer) -> per request its
               first token, logits, block ids (SENDING: the blocks stay for the transfer) or what failed
               it alone, several prompts in one forward (prefill_only(req, on_layer): one); release(id)
               after it; prefill_tokens(req): what its prefill would compute now
    decode     admit(req): WAITING for room; reserve(id, n) -> block ids a transfer fills (RESERVED);
               begin_receiving(id) once the sender began (RECEIVING); adopt(req, first_token) once it
               landed (RUNNING: the batch at decode step 2, no prompt token recomputed); cancel(id) if
               aborted while a write may land (CANCELLING), release(id) once none can
    any        abort(id), fail(id, error): FINISHED, blocks freed; no-op for an id not here

Its parts: `prompts` (prompt_blocks.py: the one place a prompt's blocks are taken, for the scheduler
and the handoff alike), `scheduler`, `runner`, `sampler`, `text` (a token's text and stop checks:
text.py), `tiers` (the KV tiers below the pool, tiering.py) and `handoff` (handoff.py: the prefill
and decode calls, which Engine's calls of the same names hand over to; it is given this engine's
record of its requests, handoff.Record: admit, validate, fail, append_token).

The step (STYLE: scheduler decides, runner computes, sampler picks, engine records), one path:
    work = scheduler.schedule()            # [(request, positions to compute)]: decodes, prompt chunks
    _launch: logits = runner.run(work)     # one row per request whose prompt or token is complete
             picked = sampler.pick(logits, done)   # tokens (and logprobs) chosen on the device, copy
                                                   # to the host under way; PENDING in output_ids
    _settle: sampler.results(picked)       # read back; each token appended: detokenize, stop checks,
                                           # finish (blocks freed)
With overlap (overlap.py) the next step is launched before this one is settled; without, each is
settled right after its launch. Either way a token is recorded in one place, _settle.

One request cannot fail another: a request whose sampling or detokenization fails finishes alone
with finish_reason "error" (StepOutput.error says what) and the batch goes on. A forward that
raises fails the requests of that step (their KV is half written); the others carry on.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch

from pdserve.protocol.control import CacheFigures
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import overlap, tiering
from pdserve.workers.engine.block_pool import blocks_for
from pdserve.workers.engine.device import check_device, kv_budget_bytes, torch_dtype
from pdserve.workers.engine.graphs import capture_at_start
from pdserve.workers.engine.handoff import KVHandoff
from pdserve.workers.engine.kv_cache import KVCache, KVLayout, blocks_for_budget, dtype_name
from pdserve.workers.engine.outputs import PrefillResult, StepOutput, prompt_logprobs_complete, with_logprobs
from pdserve.workers.engine.prefix_cache import PrefixCache, root_name
from pdserve.workers.engine.prompt_blocks import PromptBlocks
from pdserve.workers.engine.request import (IllegalTransition, InvalidRequest, Request, SamplingParams, Status,
                                           stamp_end, stamp_start)
from pdserve.workers.engine.runner import ModelRunner
from pdserve.workers.engine.sampler import Sampler, SamplingError
from pdserve.workers.engine.scheduler import Scheduler
from pdserve.workers.engine.start_times import StartTimes
from pdserve.workers.engine.step_trace import StepTrace
from pdserve.workers.engine.text import ModelText

log = logging.getLogger("pdserve.engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded=None, disk_key: bytes | None = None):
        """disk_key: the deployment's key for the disk tier's entries (WorkerKeys.disk_key); None: the
        tier folder's own key."""
        self.start = StartTimes()  # where this engine's start went (start_times.py)
        check_device(config)
        self.config = config
        self.device = torch.device(config.device)
        if loaded is None:
            from pdserve.workers.engine.models import load_model

            loaded = load_model(config.model, torch_dtype(config), config.device)
            self.start.load_s = self._since(self.start.began)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = config.max_model_len or loaded.max_model_len
        t = time.monotonic()
        self.layout = self._layout(config)
        self.kv = KVCache(self.layout, self.device, shared=config.kv_shared)
        # the pool's last block is scratch space for padding rows; requests get the others
        self.blocks = PrefixCache(self.layout.num_blocks - 1, enabled=config.prefix_cache)
        self.start.kv_pool_s = self._since(t)
        # cached KV is only comparable under the same model and layout (the prefix cache's root name)
        self.prefix_root = root_name(self.model_name, self.layout.describe())
        t = time.monotonic()
        self.runner = ModelRunner(self.model, self.kv, config, self.max_model_len)
        setup = self._since(t)
        t = time.monotonic()
        tiers = tiering.build(config, self.layout, self.device, self.model_name, self.blocks, self.kv.pool, disk_key)
        self.start.tiers_s = self._since(t)
        t = time.monotonic()
        self.prompts = PromptBlocks(self.blocks, self.layout.block_size, self.prefix_root, tiers)
        self.scheduler = Scheduler(self.prompts, config)
        # the end-of-sequence ids: the text side's stop check and the sampler's min_tokens ban
        self.text = ModelText(self.tokenizer, set(loaded.eos_token_ids), self.max_model_len)
        self.sampler = Sampler(self.device, loaded.eos_token_ids)
        self.vocab_size = self.model.config.vocab_size
        self.requests: dict[str, Request] = {}  # every request on this worker, until it finishes
        # overlapped steps (overlap.py: for every request, the KV tiers' copies ordered by events): on
        # CUDA by default (on the CPU a step is done when launched: nothing to overlap)
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._inflight: overlap.Inflight | None = None
        self._lazy: list = []  # graph kinds with buckets left for idle time (warmup, EngineConfig.graphs "lazy")
        self.trace: StepTrace | None = None  # each step's line (step_trace.py), from trace_steps on
        self.handoff = KVHandoff(self, self.prompts, self.runner, self.sampler, self.scheduler, self.vocab_size)
        self.start.setup_s = setup + self._since(t)

    @property
    def tiers(self) -> tiering.Tiers | None:
        """The KV tiers below the pool (None: none); `prompts` holds them."""
        return self.prompts.tiers

    def _since(self, t: float) -> float:
        """Seconds from t to now, the device's work launched since included."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic() - t

    def _layout(self, config: EngineConfig) -> KVLayout:
        cfg = self.model.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = torch_dtype(config)
        usable = config.num_blocks or blocks_for_budget(
            kv_budget_bytes(config), cfg.num_hidden_layers, kv_heads, head_dim, dtype, config.block_size
        ) - 1
        # the pool holds one block more than requests may use: the scratch block
        return KVLayout(cfg.num_hidden_layers, kv_heads, head_dim, dtype_name(dtype), config.block_size, usable + 1)

    def warmup(self, decode: bool = True) -> float:
        """CUDA: capture the graphs ahead of traffic (graphs.capture_at_start; not the decode graphs where
        not `decode`: a prefill worker never decodes), recorded by kind in `start`; the seconds spent (0 on
        the CPU or with cuda_graphs off)."""
        with torch.inference_mode():
            spent, self._lazy = capture_at_start(self.runner, self.start, decode, self.config.graphs)
        return spent

    def trace_steps(self, worker: str, role: str) -> str | None:
        """From ready on, a line per step in EngineConfig.step_trace's folder (step_trace.py); the file's path."""
        if self.config.step_trace:
            self.trace = self.handoff.trace = StepTrace.of_engine(self, worker, role)
        return self.trace.path if self.trace is not None else None

    def flush_trace(self) -> None:
        """The step trace's lines to its file when no request is on the worker or once due (the role's loop)."""
        if self.trace is not None and (not self.requests or self.trace.due()):
            self.trace.flush()

    def graphs_pending(self) -> bool:
        """Graphs the start left for idle time (EngineConfig.graphs "lazy") remain."""
        self._lazy = [g for g in self._lazy if g.pending()]
        return bool(self._lazy)

    def idle_capture_due(self) -> bool:
        """A graph the start left may be captured now: one remains and no request is on the worker."""
        return self.graphs_pending() and not self.requests and not self.has_work()

    def capture_idle(self) -> float:
        """Capture one graph the start left (a decode graph first, then a piecewise bucket), if no request is
        on the worker; the seconds it took (0: none captured). A worker's loop calls it between turns, so a
        request that arrives waits for one capture at most."""
        if not self.idle_capture_due():
            return 0.0
        with torch.inference_mode():
            return self._lazy[0].capture_idle()

    def validate(self, req: Request) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest(f"request {req.request_id}: the prompt is empty")
        bad = [t for t in req.prompt_ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequest(f"request {req.request_id}: token ids {bad[:5]} outside the vocabulary (0..{self.vocab_size - 1})")
        req.params.validate(self.max_model_len, n)
        bad = [t for t in req.params.stop_token_ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequest(f"request {req.request_id}: stop_token_ids {bad[:5]} outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        need = blocks_for(n + req.params.max_tokens, self.layout.block_size)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(
                f"request {req.request_id}: {n} prompt tokens + max_tokens {req.params.max_tokens} need {need} "
                f"KV blocks, the pool has {self.blocks.num_blocks}; lower max_tokens or give the worker more KV memory"
            )

    # ---- the requests on this worker ----------------------------------------------------------

    def admit(self, req: Request) -> None:
        """Check a new request and register it, WAITING (what for is the caller's: see the roles)."""
        if req.request_id in self.requests:
            raise InvalidRequest(f"request id {req.request_id} is already in use")
        if req.status is not Status.WAITING:
            raise IllegalTransition(f"request {req.request_id} is {req.status.value}; admit a new Request")
        self.validate(req)
        self.requests[req.request_id] = req

    def in_state(self, *states: Status) -> list[Request]:
        """The requests in any of these states, in arrival order."""
        return [r for r in self.requests.values() if r.status in states]

    def counts(self) -> dict[Status, int]:
        """Requests per state (main thread; the roles publish it for the heartbeat thread)."""
        out = dict.fromkeys(Status, 0)
        for r in self.requests.values():
            out[r.status] += 1
        return out

    # ---- prefill and decode workers (handoff.py) ------------------------------------------------

    def prefill_only(self, req: Request, on_layer: Callable[[int], None] | None = None) -> PrefillResult:
        return self.handoff.prefill_only(req, on_layer)

    def prefill_batch(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None
                      ) -> list[PrefillResult | Exception | None]:
        return self.handoff.prefill_batch(reqs, on_layer)

    def prefill_tokens(self, req: Request) -> int:
        return self.handoff.prefill_tokens(req)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        return self.handoff.reserve(request_id, num_tokens)

    def begin_receiving(self, request_id: str) -> None:
        self.handoff.begin_receiving(request_id)

    def cancel(self, request_id: str) -> None:
        self.handoff.cancel(request_id)

    def adopt(self, req: Request, first_token: int) -> StepOutput:
        return self.handoff.adopt(req, first_token)

    # ---- colocated -----------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.admit(req)
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[StepOutput]:
        """One step; with overlap (overlap.py) it is launched and the outputs returned are those of the
        step before it, read back while this one runs; without, this step's own."""
        began = time.monotonic()
        work = self.scheduler.schedule()
        scheduled = time.monotonic()
        old, self._inflight = self._inflight, None
        outs: list[StepOutput] = []
        if old is not None and not overlap.fed(work):  # a token this step needs must be on the host first
            outs, old = self._settle(old), None
            work = [(r, n) for r, n in work if not r.finished]
        if work:
            try:
                self._inflight = self._launch(work, old, began, scheduled)
            except Exception as e:
                outs += self._settle(old) if old is not None else []
                return outs + self._fail_step([(r, n) for r, n in work if not r.finished], e)
        if old is not None:
            outs += self._settle(old)
        if not self.overlap and self._inflight is not None:
            now, self._inflight = self._inflight, None
            outs += self._settle(now)
        return outs

    def _launch(self, work: list[tuple[Request, int]], old: overlap.Inflight | None, began: float,
                scheduled: float) -> overlap.Inflight:
        """Run `work` and pick its tokens on the device; nothing waits for the device. began, scheduled:
        when the step's scheduling began and ended (its trace line)."""
        traced = self.trace.begin("step", work, began, scheduled) if self.trace is not None else None
        start = stamp_start(work)
        logits = self.runner.run(work, feed=overlap.feed(work, old))  # [len(done), vocab]; advances num_computed
        done = [r for r, _ in work if r.num_computed == r.num_tokens]
        picked = self.sampler.pick(logits, done, old) if done else None
        kept = {i: logits[i].clone() for i, r in enumerate(done) if r.return_logits}  # a graph reuses its output
        for r in done:
            r.output_ids.append(overlap.PENDING)
        if traced is not None:
            self.trace.launched(traced, self.runner.path)
        return overlap.Inflight(work, done, picked, kept, start, traced=traced)

    def _settle(self, step: overlap.Inflight) -> list[StepOutput]:
        """The outputs of a launched step: its tokens read back (waiting for them if need be), each
        recorded (the one place a step's tokens are); then the blocks it held back go free."""
        waiting = time.monotonic()
        results = self.sampler.results(step.picked, step.done) if step.done else []
        read = time.monotonic()
        if step.traced is not None and self.trace is not None:
            self.trace.settled(step.traced, read - waiting)
        stamp_end([r for r in step.done if not r.finished], step.start, read)
        outs = []
        for i, (r, (token, logprobs)) in enumerate(zip(step.done, results)):
            if r.finished:  # aborted or failed since: nothing more to say
                continue
            later = overlap.pop_pending(r) - 1  # the step after this one's token, already launched
            token = prompt_logprobs_complete(r, token)
            outs.append(with_logprobs(self._emit(r, token, step.logits.get(i)), logprobs))
            if not r.finished:
                r.output_ids.extend([overlap.PENDING] * later)
        for r, _ in step.work:
            if not r.finished:
                self.prompts.name(r)
        for blocks in step.deferred:  # the step is over: nothing writes into them any more
            self.blocks.free(blocks)
        step.deferred.clear()
        return outs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 return_logits: bool = False) -> list[Request]:
        """Run `prompts` to the end (one params for all, or one per prompt)."""
        each = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} sampling params for {len(prompts)} prompts")
        reqs = [Request(f"gen-{id(self)}-{i}-{time.monotonic_ns()}", list(p), sp, return_logits=return_logits)
                for i, (p, sp) in enumerate(zip(prompts, each))]
        for r in reqs:
            self.add_request(r)
        self.run_until_done(reqs)
        return reqs

    def run_until_done(self, reqs: list[Request]) -> None:
        while not all(r.finished for r in reqs):
            if not self.has_work():
                raise RuntimeError("requests unfinished but the scheduler is idle")
            self.step()

    def stream(self, req: Request) -> Iterator[StepOutput]:
        """Add one request and yield its outputs (other requests step along)."""
        self.add_request(req)
        while not req.finished:
            for out in self.step():
                if out.request_id == req.request_id:
                    yield out

    # ---- the end of a request ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """FINISHED ("abort"), blocks freed; no-op for an id not here. Not while CANCELLING: a late
        write could still land in its blocks (release() once the receiver lets go)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")

    def fail(self, request_id: str, error: str) -> None:
        """FINISHED ("error", with what went wrong), blocks freed; no-op for an id not here."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "error", error)

    def release(self, request_id: str) -> None:
        """The transfer is over: the blocks of a SENDING (prefill worker) or RESERVED, RECEIVING or
        CANCELLING (decode worker) request go back; no-op for an id not here."""
        req = self.requests.get(request_id)
        if req is not None:
            req.release()
            self._forget(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        overlap.pop_pending(req)  # a token of a step in flight that it will not get
        req.finish(reason, error)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        """A finished request leaves: its blocks back to the pool (their KV copied down to the host
        tier, if there is one), out of the queues and the dict."""
        if self.tiers is not None:
            self.tiers.poll(req, wait=True)  # no reload may still land in blocks that go back
            self.tiers.offload(req)
        self.scheduler.remove(req)
        if self._inflight is not None and id(req) in self._inflight.members:
            self._inflight.deferred.append(req.block_ids)  # that step may still write into them
        else:
            self.blocks.free(req.block_ids)
        req.block_ids = []
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]

    # ---- tokens --------------------------------------------------------------------------------

    def _emit(self, req: Request, token: int | SamplingError, logits: torch.Tensor | None) -> StepOutput:
        """A sampled token recorded, or the request failed alone if its token could not be made."""
        if isinstance(token, SamplingError):
            return self._failed(req, str(token))
        if req.status is Status.PREFILLING:  # its prompt is complete: token 1
            req.start_running()
            s = req.stamps
            if self.tiers is not None and s.prefill_end is not None and s.prefill_start is not None:
                self.tiers.observe_prefill(len(req.prompt_ids) - req.cached_tokens, s.prefill_end - s.prefill_start)
        return self.append_token(req, token, logits)

    def append_token(self, req: Request, token: int, logits: torch.Tensor | None = None) -> StepOutput:
        """The one place a token is recorded: appended, its text and stop checks; it may finish the request."""
        req.output_ids.append(token)
        self.prompts.name(req)  # before a stop frees them: a finished request's blocks go down to the tiers named
        try:
            delta, reason = self.text.text_and_stop(req, token)
        except Exception as e:  # this request's text, not the batch's
            return self._failed(req, f"request {req.request_id}: detokenizing generated token "
                                     f"{len(req.output_ids) - 1} (id {token}) failed: {type(e).__name__}: {e}")
        if reason is not None:
            self._finish(req, reason)
        return StepOutput(req.request_id, token, delta, reason is not None, reason,
                          None if logits is None else logits.detach().float().cpu(), request=req)

    def _failed(self, req: Request, error: str) -> StepOutput:
        self._finish(req, "error", error)
        return StepOutput(req.request_id, -1, "", True, "error", error=error, request=req)

    def _fail_step(self, work: list[tuple[Request, int]], e: Exception) -> list[StepOutput]:
        log.exception("an engine step of %d requests failed; failing those requests", len(work))
        error = f"the engine step that computed it failed: {type(e).__name__}: {e}"
        return [self._failed(r, f"request {r.request_id}: {error}") for r, _ in work]

    def stats(self) -> dict[str, int]:
        counts = {s.value: n for s, n in self.counts().items() if s is not Status.FINISHED}
        b = self.blocks
        return {"free_blocks": b.num_free, "total_blocks": b.num_blocks, "cached_blocks": b.num_cached,
                "prefix_queried_tokens": b.queried_tokens, "prefix_hit_tokens": b.hit_tokens, **counts}

    def cache_figures(self) -> CacheFigures:
        """The prefix cache and its tiers, cumulative (what a heartbeat carries)."""
        return tiering.cache_figures(self.blocks, self.tiers)

    def close(self) -> None:
        """Let go of what outlives a dropped engine: a step in flight, the tiers' threads and files in flight."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._settle(step)
        if self.tiers is not None:
            self.tiers.close()
            self.prompts.tiers = None
        if self.trace is not None:
            self.trace.close()
