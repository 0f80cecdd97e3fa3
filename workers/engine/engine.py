"""The engine every worker role runs: one model, one KV pool, continuous batching.

For the roles:
    colocated  add_request() + step() until finished
    prefill    prefill_only(req, on_layer)  -> first token, logits, block ids; release() after the transfer
    decode     reserve(id, n) -> block ids for a transfer to fill; adopt(req, first_token) once it
               landed: the request joins the running batch at decode step 2, no prompt token recomputed

The step (see STYLE: scheduler decides, runner computes, engine records):
    work = scheduler.schedule()            # [(request, positions to compute)]: decodes, prompt chunks
    logits = runner.run(work)              # one row per request whose prompt or token is complete
    tokens = sampler.sample(logits, done); then append, detokenize, stop checks, free finished blocks
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from workers.engine import attention
from workers.engine.block_pool import BlockPool, OutOfBlocks, blocks_for
from workers.engine.config import EngineConfig
from workers.engine.kv_cache import KVCache, KVLayout, blocks_for_budget, dtype_name
from workers.engine.request import InvalidRequest, Request, SamplingParams, Status
from workers.engine.runner import ModelRunner
from workers.engine.sampler import Sampler
from workers.engine.scheduler import Scheduler


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    logits: torch.Tensor | None = None  # [vocab] float32 on CPU, when the request asked for it


@dataclass
class PrefillResult:
    first_token: int
    logits: torch.Tensor  # [vocab] float32, on the engine's device
    block_ids: list[int]


class Engine:
    def __init__(self, config: EngineConfig, loaded=None):
        self.config = config
        if loaded is None:
            from workers.engine.models import load_model

            loaded = load_model(config.model, config.torch_dtype, config.device)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.max_model_len = config.max_model_len or loaded.max_model_len
        self.device = torch.device(config.device)
        self.layout = self._layout(config)
        self.kv = KVCache(self.layout, self.device, shared=config.kv_shared)
        # the pool's last block is scratch space for padding rows; requests get the others
        self.blocks = BlockPool(self.layout.num_blocks - 1)
        self.scheduler = Scheduler(self.blocks, config.block_size, config.max_num_seqs, config.max_batched_tokens,
                                   config.chunked_prefill, config.chunk_tokens)
        self.runner = ModelRunner(self.model, self.kv, config.block_size, self.layout.num_blocks - 1,
                                  config.max_num_seqs, self.max_model_len, config.cuda_graphs,
                                  kernels=config.attention != "reference" and attention.use_kernels(self.device),
                                  prefix_kernel=config.attention == "triton",
                                  compile_layers=config.compile and self.device.type == "cuda",
                                  fuse_qkv=config.fuse_qkv and self.device.type == "cuda")
        self.sampler = Sampler(self.device)
        self.vocab_size = self.model.config.vocab_size
        self.requests: dict[str, Request] = {}  # waiting or running in the scheduler
        self.held: dict[str, Request] = {}  # prefilled by prefill_only, blocks kept until release()
        self.reserved: dict[str, list[int]] = {}  # reserved for an incoming transfer

    def _layout(self, config: EngineConfig) -> KVLayout:
        cfg = self.model.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = config.torch_dtype
        usable = config.num_blocks or blocks_for_budget(
            config.kv_budget_bytes(), cfg.num_hidden_layers, kv_heads, head_dim, dtype, config.block_size
        ) - 1
        # the pool holds one block more than requests may use: the scratch block
        return KVLayout(cfg.num_hidden_layers, kv_heads, head_dim, dtype_name(dtype), config.block_size, usable + 1)

    def warmup(self) -> float:
        """CUDA: capture the decode graph of every (batch, block table) bucket ahead of traffic,
        largest first so the shared memory pool is sized once; returns seconds spent (0 on CPU
        or with cuda_graphs off). About 0.2 s a graph for a 7B model on an H200."""
        graphs = self.runner.graphs
        if graphs is None:
            return 0.0
        with torch.inference_mode():
            return sum(graphs.capture(graphs.batch_buckets[::-1], blocks) for blocks in graphs.block_buckets[::-1])

    # ---- prompts -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def validate(self, req: Request) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest(f"request {req.request_id}: the prompt is empty")
        bad = [t for t in req.prompt_ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequest(f"request {req.request_id}: token ids {bad[:5]} outside the vocabulary (0..{self.vocab_size - 1})")
        req.params.validate(self.max_model_len, n)
        need = blocks_for(n + req.params.max_tokens, self.layout.block_size)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(
                f"request {req.request_id}: {n} prompt tokens + max_tokens {req.params.max_tokens} need {need} "
                f"KV blocks, the pool has {self.blocks.num_blocks}; lower max_tokens or give the worker more KV memory"
            )

    # ---- colocated -----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.held or req.request_id in self.reserved:
            raise InvalidRequest(f"request id {req.request_id} is already in use")
        self.validate(req)
        req.arrived = time.monotonic()
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        work = self.scheduler.schedule()
        if not work:
            return []
        start = time.monotonic()
        for r, _ in work:
            if not r.output_ids:
                r.prefill_start = r.prefill_start or start
            elif len(r.output_ids) == 1 and r.first_step_start is None:
                r.first_step_start = start
        done = [r for r, n in work if r.num_computed + n == r.num_tokens]
        logits = self.runner.run(work)
        tokens = self.sampler.sample(logits, done) if done else []  # reads the tokens back: the step is complete
        end = time.monotonic()
        outs = []
        for i, (r, tok) in enumerate(zip(done, tokens)):
            if not r.output_ids and r.prefill_end is None:
                r.prefill_end = end
            elif r.first_step_start == start:
                r.first_step_end = end
            outs.append(self._append(r, tok, logits[i] if r.return_logits else None))
        return outs

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 return_logits: bool = False) -> list[Request]:
        reqs = [Request(f"gen-{id(self)}-{i}-{time.monotonic_ns()}", list(p), params or SamplingParams(),
                        return_logits=return_logits) for i, p in enumerate(prompts)]
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

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")
        self.release(request_id)

    # ---- prefill role --------------------------------------------------------------------

    def prefill_only(self, req: Request, on_layer: Callable[[int], None] | None = None) -> PrefillResult:
        """Prefill one request now, sample its first token; its blocks stay until release()."""
        if req.request_id in self.held or req.request_id in self.requests:
            raise InvalidRequest(f"request id {req.request_id} is already in use")
        self.validate(req)
        need = blocks_for(len(req.prompt_ids), self.layout.block_size)
        if not self.blocks.can_allocate(need):
            raise OutOfBlocks(f"request {req.request_id}: needs {need} blocks, {self.blocks.num_free} free")
        req.block_ids = self.blocks.allocate(need)
        req.status = Status.RUNNING
        self.held[req.request_id] = req
        try:
            req.prefill_start = time.monotonic()
            logits = self.runner.prefill([req], on_layer)
            token = self.sampler.sample(logits, [req])[0]
            req.prefill_end = time.monotonic()
        except BaseException:
            self.release(req.request_id)
            raise
        req.output_ids = [token]
        return PrefillResult(first_token=token, logits=logits[0], block_ids=list(req.block_ids))

    def release(self, request_id: str) -> None:
        """Give back the blocks of a prefilled (held) or reserved request; no-op if none."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.blocks.free(req.block_ids)
            req.block_ids = []
            req.status = Status.FINISHED
        blocks = self.reserved.pop(request_id, None)
        if blocks is not None:
            self.blocks.free(blocks)

    # ---- decode role ---------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        if request_id in self.reserved or request_id in self.requests:
            raise InvalidRequest(f"request id {request_id} is already in use")
        need = blocks_for(num_tokens, self.layout.block_size)
        if not self.blocks.can_allocate(need):
            return None
        self.reserved[request_id] = self.blocks.allocate(need)
        return list(self.reserved[request_id])

    def adopt(self, req: Request, first_token: int) -> StepOutput:
        """Continue a request whose prompt KV sits in its reserved blocks; returns the output of
        its first token (which may already finish it)."""
        blocks = self.reserved.pop(req.request_id, None) or req.block_ids
        try:
            if len(blocks) * self.layout.block_size < len(req.prompt_ids):
                raise InvalidRequest(
                    f"request {req.request_id}: {len(blocks)} blocks cannot hold {len(req.prompt_ids)} prompt tokens"
                )
            self.validate(req)
        except InvalidRequest:
            self.blocks.free(blocks)  # the reservation ends here: its blocks go back
            raise
        req.block_ids = list(blocks)
        req.num_computed = len(req.prompt_ids)
        req.output_ids = []
        req.adopted = True
        self.requests[req.request_id] = req
        self.scheduler.adopt(req)
        return self._append(req, first_token, None)

    # ---- bookkeeping ---------------------------------------------------------------------

    def _append(self, req: Request, token: int, logits: torch.Tensor | None) -> StepOutput:
        req.output_ids.append(token)
        p = req.params
        reason = None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        delta = self._detokenize(req)
        if reason is None and p.stop:
            hit = min((i for i in (req.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if hit >= 0:
                before = len(req.text) - len(delta)
                req.text = req.text[:hit]
                delta = req.text[before:] if hit > before else ""
                reason = "stop"
        if reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens > self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        return StepOutput(req.request_id, token, delta, reason is not None, reason,
                          None if logits is None else logits.detach().float().cpu())

    def _detokenize(self, req: Request) -> str:
        """The text the newest token adds, decoding only a few tokens of context each time
        (a token's text can depend on its neighbours, e.g. a leading space or a split
        UTF-8 character, which shows as U+FFFD until the next token completes it)."""
        ids = req.output_ids
        decode = self.tokenizer.decode
        before = decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=True)
        after = decode(ids[req.prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        req.text += delta
        return delta

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)

    def stats(self) -> dict[str, int]:
        return {
            "free_blocks": self.blocks.num_free,
            "total_blocks": self.blocks.num_blocks,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "held": len(self.held),
            "reserved": len(self.reserved),
        }
