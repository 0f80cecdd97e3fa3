"""The model and its tensors: a step's inputs (step_inputs.build), one forward under one attention
context (attention.stepping, entered by `attend`), logits.

A step is a list of (request, n): compute n positions of that request from its
`num_computed` on. One decode token (n = 1), a whole prompt, or a chunk of one (chunked
prefill) mix freely in one forward. Tokens are flattened into one sequence of batch 1
(`input_ids: [1, T]`), decode rows first, with explicit positions; the attention function
(attention.py) learns from the step's StepState which rows are which and which blocks hold each past.

Prompt logprobs (a request's `params.prompt_logprobs`): the logits of every prompt position, not
only the last, for the requests that asked, computed from the final hidden states in slices of
PROMPT_LOGPROB_ROWS positions, each reduced at once to the next prompt token's logprob and the top
k, appended to `Request.prompt_logprobs`: memory stays one slice of [rows, vocab] whatever the
prompt's length, and a step without such a request runs exactly as before.

On CUDA, steps of decodes only replay CUDA graphs (graphs.py): a decode step of a 7B model is
launch-bound (hundreds of small kernels), and replaying them costs a fraction of
launching them from Python. Steps with prompt tokens run eagerly: they are compute-bound,
and a prefill's per-layer transfer hook must run on the host.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import attention, cpu_weights, fusion, step_inputs
from pdserve.workers.engine.kv_cache import KVCache
from pdserve.workers.engine.request import Request, decode_row
from pdserve.workers.engine.sampler import logprobs_of
from pdserve.workers.engine.step_inputs import StepInputs, prompt_positions, to_device

__all__ = ["ModelRunner", "compile_decoder_layers", "prompt_positions"]

log = logging.getLogger("pdserve.engine")

PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into logits at once: [256, vocab] float32 at most


def compile_decoder_layers(model) -> None:
    """torch.compile each decoder layer ("regional" compilation: the layers share one compiled
    code, so a 28-layer model compiles about as fast as one layer). Attention stays eager (a
    graph break: it launches our kernels and calls the transfer hook), so each layer becomes
    two fused graphs, norm + projections + rotary before it and the rest after: at batch 1 a
    decode step of small element-wise kernels is launch-bound, and fusing them is most of
    what separates it from reading the weights once."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to compile; pass compile=False")
    for layer in layers:
        layer.compile(dynamic=True)


class ModelRunner:
    def __init__(self, model, kv: KVCache, config: EngineConfig, max_model_len: int):
        """What the config asks of the forward (kernels, graphs, compiled and fused layers) is taken as
        this device allows: on the CPU, no CUDA graphs, no compile, no fused projections, and the widening
        products' weights stored transposed (cpu_weights.py). The pool's last
        block is the scratch block (padding rows of a graphed batch write there)."""
        cuda = kv.device.type == "cuda"
        self.model = model
        self.kv = kv
        self.block_size = config.block_size
        self.path: str | None = None  # the forward `run` took last (step_trace.py's `path`)
        self.scratch_block = kv.layout.num_blocks - 1  # padding rows of a graphed batch write here
        self.device = kv.device
        # decode attention through paged_kernel (CUDA), else the reference path; prefix chunks too with "triton"
        self.kernels = config.attention != "reference" and attention.use_kernels(self.device)
        self.prefix_kernel = self.kernels and config.attention == "triton"
        compile_dense = config.compile and cuda
        cuda_graphs = config.cuda_graphs and cuda
        model.config._attn_implementation = attention.register()
        attention.steady_sdpa(self.device)  # prompt lengths without cuDNN's per-length graph builds
        for sub in model.modules():  # some models keep a per-sub-module config
            cfg = getattr(sub, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = model.config._attn_implementation
        # transformers returns a 4-D mask as-is, so it builds none; attention ignores it
        self.placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        if config.fuse_qkv and cuda:
            fusion.fuse_qkv(model)
        if config.fuse_gate_up and cuda:
            fusion.fuse_gate_up(model)
        if not cuda:  # small-batch products that widen, transposed (cpu_weights.py)
            cpu_weights.transpose_wide(model)
        self.build_forwards(config, max_model_len, decode_graphs=cuda_graphs, mixed_graphs=cuda_graphs,
                            compile=compile_dense)

    def build_forwards(self, config: EngineConfig, max_model_len: int, decode_graphs: bool, mixed_graphs: bool,
                       compile: bool) -> None:
        """The forwards `run` dispatches to besides the eager one: `graphs` (DecodeGraphs, steps of decodes
        only; with decode_graphs) and `mixed` (MixedGraphs, steps with prompt tokens up to a chunk and its
        decodes; replayed as graphs with mixed_graphs), their dense code torch.compiled with `compile`.

        A cuttable model's decode graphs run the piecewise path's segments (decode_graph_forward "cut"): one
        Cut, compiled once for both, and transformers' layers stay uncompiled (the eager path, taken by
        prompt logprobs and steps past the Cut's rows, runs them as they are). Otherwise ("layers", or a model
        that cannot be cut) every decoder layer is compiled for transformers' forward, which the decode graphs
        and the eager path run. Called by __init__ with what the device allows; tests call it on the CPU with
        decode_graphs and compile on (the capture itself is CUDA-only; the forwards it takes run anywhere)."""
        from pdserve.workers.engine.graphs import DecodeGraphs, MixedGraphs
        from pdserve.workers.engine.layers import Cut, cuttable

        model, max_num_seqs = self.model, config.max_num_seqs
        can_cut = cuttable(model)
        cut_decode = can_cut and config.decode_graph_forward == "cut"
        if compile and not cut_decode:
            compile_decoder_layers(model)
        # steps with prompt tokens, up to this many tokens: piecewise graphs (they hold a chunk and the decodes)
        mixed_tokens = (max(config.mixed_graph_tokens, config.step_chunk_tokens + max_num_seqs)
                        if config.mixed_graph_tokens else 0)
        self.mixed = None
        if mixed_tokens and can_cut:
            self.mixed = MixedGraphs(self, mixed_tokens, max_num_seqs, use_graphs=mixed_graphs, compile=compile,
                                     graph_tokens=config.mixed_graph_tokens)
        elif mixed_tokens:
            log.info("%s is not a Llama-style decoder: steps with prompt tokens run eagerly", type(model).__name__)
        self.graphs = None
        if decode_graphs:
            cut = None
            if cut_decode:
                cut = self.mixed.cut if self.mixed is not None else \
                    Cut(model, max(max_num_seqs, 2), max_num_seqs, self.device, compile=compile)
            self.graphs = DecodeGraphs(self, max_num_seqs, -(-max_model_len // self.block_size), cut=cut)

    @torch.inference_mode()
    def run(self, work: list[tuple[Request, int]], on_layer: Callable[[int], None] | None = None,
            feed=None) -> torch.Tensor:
        """One forward over `work`: (request, n) computes positions [num_computed, num_computed + n)
        of that request, whose blocks must already cover them. Returns [K, vocab] float32 logits
        of the last position of every request that reaches its num_tokens, in `work` order, and
        advances each num_computed by n.

        Which forward (the dispatch, in one place): decodes only -> the decode graphs; decodes and
        prompt chunks of at most `mixed.max_tokens` tokens -> the piecewise graphs; anything else
        (a long prompt, prompt logprobs asked) -> eagerly. On the CPU only the last two, with the
        piecewise path run without graphs. `feed` (overlap.feed): decode rows whose input token is
        still on the device, copied into their input on the device."""
        asks = any(prompt_positions(r, n) for r, n in work)
        if (self.graphs is not None and on_layer is None and not asks
                and all(decode_row(r, n) for r, n in work)):
            self.path = "decode-graph"
            logits = self.graphs.decode(work, feed)
        else:
            inp = step_inputs.build(work, self.block_size)
            if self.mixed is not None and not asks and self.mixed.fits(len(inp.ids), len(inp.keep)):
                self.path = "piecewise-graph" if self.mixed.graphed(len(inp.ids)) else "piecewise"
                with self.attend(inp, *self.mixed.slots(len(inp.ids)), on_layer):
                    logits = self.mixed.run(inp, feed)
            else:
                self.path = "eager"
                logits = self._run_eager(inp, on_layer, feed)
        for r, n in work:
            r.num_computed += n
        return logits

    def prefill(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Every request's remaining tokens in one forward -> [len(reqs), vocab] logits."""
        return self.run([(r, r.num_tokens - r.num_computed) for r in reqs], on_layer)

    def attend(self, inp: StepInputs, k_slots: torch.Tensor, v_slots: torch.Tensor, on_layer=None):
        """The attention context of a forward over `inp` (attention.stepping), its tables put on the
        device; the slots are the caller's ([T] on the device: `inp`'s, or a graph buffer's views)."""
        dev = self.device
        state = attention.StepState(pool=self.kv.pool, k_slots=k_slots, v_slots=v_slots, on_layer=on_layer,
                                    kernels=self.kernels, prefix_kernel=self.prefix_kernel,
                                    num_decode=len(inp.decodes), fresh=inp.fresh, prefix=inp.prefix)
        if inp.decodes:
            state.table = to_device(inp.table, dev)
            state.ctx_lens = to_device(inp.ctx_lens, dev)
            state.ctx_host = inp.ctx_lens.tolist()
            state.max_ctx = max(state.ctx_host)
        if inp.prefix_reqs:
            state.prefix_table = to_device(inp.prefix_table, dev)
            if self.prefix_kernel:
                from pdserve.workers.engine.paged_kernel import prefill_tiles

                g = self.model.config.num_attention_heads // self.kv.layout.num_kv_heads
                state.prefix_tiles = to_device(np.asarray(prefill_tiles(inp.prefix, g), dtype=np.int32), dev)
        return attention.stepping(state)

    def attend_decode(self, k_slots: torch.Tensor, v_slots: torch.Tensor, table: torch.Tensor,
                      ctx_lens: torch.Tensor, max_ctx: int):
        """The attention context of a decode graph's forward, over its static buffers (table: [B, blocks];
        the rest [B]; max_ctx: the table's keys, a static bound)."""
        return attention.stepping(attention.StepState(
            pool=self.kv.pool, k_slots=k_slots, v_slots=v_slots, kernels=self.kernels,
            prefix_kernel=self.prefix_kernel, num_decode=table.shape[0], table=table, ctx_lens=ctx_lens,
            max_ctx=max_ctx))

    def _run_eager(self, inp: StepInputs, on_layer, feed) -> torch.Tensor:
        dev = self.device
        with self.attend(inp, to_device(inp.k_slots, dev), to_device(inp.v_slots, dev), on_layer):
            ids = to_device(inp.ids, dev)
            step_inputs.apply_feed(ids, feed)
            return self.forward(ids, to_device(inp.positions, dev), to_device(inp.keep, dev), inp.asks)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                asks: list[tuple[Request, list[int], int]] = ()) -> torch.Tensor:
        """ids, positions: [T] on the device; keep: [K] rows whose logits to return -> [K, vocab] float32.
        asks: (request, rows, k): the prompt logprobs of those rows go to request.prompt_logprobs.
        Run inside the step's attention context (attend, attend_decode)."""
        hidden: list[torch.Tensor] = []  # [1, T, hidden_size]: the final norm's output, when asked
        hook = self.model.model.norm.register_forward_hook(lambda m, i, o: hidden.append(o)) if asks else None
        try:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attention_mask=self.placeholder_mask,
                use_cache=False,
                logits_to_keep=keep,
            )
        finally:
            if hook is not None:
                hook.remove()
        for r, rows, k in asks:
            try:
                self._prompt_logprobs(hidden[0][0], r, rows, k)
            except Exception:  # this request's: its list stays short, and the engine fails it alone at token 1
                log.exception("request %s: its prompt logprobs failed", r.request_id)
        return out.logits[0].float()

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, rows: list[int], k: int) -> None:
        """hidden: [T, hidden_size]; rows: this step's rows of consecutive prompt positions p, whose
        logits predict prompt token p + 1."""
        head = self.model.get_output_embeddings()
        start = len(req.prompt_logprobs) + 1  # the prompt token the first row predicts
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = rows[i:i + PROMPT_LOGPROB_ROWS]
            logits = head(hidden[torch.tensor(part, device=hidden.device)])  # [rows, vocab]
            targets = torch.tensor(req.prompt_ids[start + i:start + i + len(part)], device=hidden.device)
            req.prompt_logprobs.extend(logprobs_of(logits, targets, k))

