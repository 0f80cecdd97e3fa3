"""The model and its tensors: builds a step's inputs, runs one forward, returns logits.

A step is a list of (request, n): compute n positions of that request from its
`num_computed` on. One decode token (n = 1), a whole prompt, or a chunk of one (chunked
prefill) mix freely in one forward. Tokens are flattened into one sequence of batch 1
(`input_ids: [1, T]`), decode rows first, with explicit positions; the attention function
(attention.py) learns from `STEP` which rows are which and which blocks hold each past.

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

import torch

from workers.engine import attention, fusion
from workers.engine.kv_cache import KVCache
from workers.engine.request import Request
from workers.engine.sampler import logprobs_of

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
    def __init__(self, model, kv: KVCache, block_size: int, scratch_block: int,
                 max_num_seqs: int, max_model_len: int, cuda_graphs: bool, kernels: bool = False,
                 compile_layers: bool = False, fuse_qkv: bool = False, prefix_kernel: bool = False):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.scratch_block = scratch_block  # padding rows of a graphed batch write here
        self.device = kv.device
        self.kernels = kernels  # decode attention through paged_kernel (CUDA), else the reference path
        self.prefix_kernel = kernels and prefix_kernel  # prefix chunks through paged_kernel too
        model.config._attn_implementation = attention.register()
        for sub in model.modules():  # some models keep a per-sub-module config
            cfg = getattr(sub, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = model.config._attn_implementation
        # transformers returns a 4-D mask as-is, so it builds none; attention ignores it
        self.placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        if fuse_qkv:
            fusion.fuse_qkv(model)
        if compile_layers:
            compile_decoder_layers(model)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from workers.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs, -(-max_model_len // block_size))

    def slots(self, blocks_at: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of K and V for the given positions in a layer viewed as
        [blocks * 2 * block_size, heads, dim]; blocks_at[i] is the block holding positions[i]."""
        bs = self.block_size
        k = blocks_at * (2 * bs) + positions % bs
        return k, k + bs

    @torch.inference_mode()
    def run(self, work: list[tuple[Request, int]], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One forward over `work`: (request, n) computes positions [num_computed, num_computed + n)
        of that request, whose blocks must already cover them. Returns [K, vocab] float32 logits
        of the last position of every request that reaches its num_tokens, in `work` order, and
        advances each num_computed by n."""
        if (self.graphs is not None and on_layer is None and all(n == 1 and r.num_computed for r, n in work)
                and not any(prompt_positions(r, n) for r, n in work)):
            logits = self.graphs.decode([r for r, _ in work])
        else:
            logits = self._run_eager(work, on_layer)
        for r, n in work:
            r.num_computed += n
        return logits

    def prefill(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Every request's remaining tokens in one forward -> [len(reqs), vocab] logits."""
        return self.run([(r, r.num_tokens - r.num_computed) for r in reqs], on_layer)

    def _run_eager(self, work: list[tuple[Request, int]], on_layer) -> torch.Tensor:
        bs = self.block_size
        decodes = [(r, n) for r, n in work if n == 1 and r.num_computed]
        chunks = [(r, n) for r, n in work if not (n == 1 and r.num_computed)]
        ids, positions, blocks_at, last = [], [], [], {}
        for r, _ in decodes:
            p = r.num_computed
            last[id(r)] = len(ids)
            ids.append(r.token_at(p))
            positions.append(p)
            blocks_at.append(r.block_ids[p // bs])
        step = attention.STEP
        step.fresh, step.prefix = [], []
        prefix_reqs = []
        for r, n in chunks:
            a, row = r.num_computed, len(ids)
            ids.extend(r.tokens(a, a + n))
            positions.extend(range(a, a + n))
            blocks_at.extend(r.block_ids[p // bs] for p in range(a, a + n))
            if a == 0:
                step.fresh.append((row, row + n))
            else:
                step.prefix.append((len(prefix_reqs), row, n, a))
                prefix_reqs.append(r)
            last[id(r)] = len(ids) - 1
        dev = self.device
        pos = torch.tensor(positions)
        k, v = self.slots(torch.tensor(blocks_at), pos)
        step.k_slots, step.v_slots, step.on_layer = k.to(dev), v.to(dev), on_layer
        step.num_decode = len(decodes)
        if decodes:
            step.table = self.block_table([r for r, _ in decodes]).to(dev)
            ctx = [r.num_computed + 1 for r, _ in decodes]
            step.ctx_lens, step.max_ctx = torch.tensor(ctx, device=dev), max(ctx)
        if prefix_reqs:
            step.prefix_table = self.block_table(prefix_reqs).to(dev)
            if self.prefix_kernel:
                from workers.engine.paged_kernel import prefill_tiles

                g = self.model.config.num_attention_heads // self.kv.layout.num_kv_heads
                step.prefix_tiles = torch.tensor(prefill_tiles(step.prefix, g), dtype=torch.int32, device=dev)
        keep = [last[id(r)] for r, n in work if r.num_computed + n == r.num_tokens]
        asks = []  # (request, rows of this step whose logits predict its prompt tokens, top k)
        for r, n in work:
            wanted = prompt_positions(r, n)
            if wanted:
                first_row = last[id(r)] - n + 1  # the row of position num_computed
                asks.append((r, [first_row + p - r.num_computed for p in wanted], r.params.prompt_logprobs))
        try:
            return self.forward(torch.tensor(ids, device=dev), pos.to(dev), torch.tensor(keep, dtype=torch.long, device=dev),
                                asks)
        finally:
            step.on_layer = None

    @staticmethod
    def block_table(reqs: list[Request], width: int | None = None) -> torch.Tensor:
        """[len(reqs), width] int64 block ids, zero padded (width: the longest list)."""
        width = width or max(len(r.block_ids) for r in reqs)
        return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs], dtype=torch.long)

    def decode_inputs(self, reqs: list[Request], batch: int, max_blocks: int) -> dict[str, torch.Tensor]:
        """CPU tensors of a decode step, padded to `batch` rows and `max_blocks` columns."""
        bs = self.block_size
        n = len(reqs)
        table = torch.zeros(batch, max_blocks, dtype=torch.long)
        table[:n] = self.block_table(reqs, max_blocks)
        lens = torch.ones(batch, dtype=torch.long)
        lens[:n] = torch.tensor([r.num_computed + 1 for r in reqs])
        ids = torch.zeros(batch, dtype=torch.long)
        ids[:n] = torch.tensor([r.token_at(r.num_computed) for r in reqs])
        pos = lens - 1
        blocks_at = table[torch.arange(batch), pos // bs]
        blocks_at[n:] = self.scratch_block  # padding rows write into the scratch block
        pos[n:] = 0
        k, v = self.slots(blocks_at, pos)
        return {"ids": ids, "pos": pos, "k_slots": k, "v_slots": v, "table": table, "lens": lens}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                asks: list[tuple[Request, list[int], int]] = ()) -> torch.Tensor:
        """ids, positions: [T] on the device; keep: [K] rows whose logits to return -> [K, vocab] float32.
        asks: (request, rows, k): the prompt logprobs of those rows go to request.prompt_logprobs."""
        step = attention.STEP
        step.pool, step.kernels, step.prefix_kernel = self.kv.pool, self.kernels, self.prefix_kernel
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
        finally:  # the step's tensors live no longer than the step (a dropped engine frees its pool)
            step.pool = step.table = step.ctx_lens = step.prefix_table = step.prefix_tiles = None
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


def prompt_positions(r: Request, n: int) -> range:
    """Positions of a step of (r, n) whose logits r's prompt logprobs still need: p < prompt length - 1
    (position p predicts prompt token p + 1), from the first not yet computed. Empty unless the request
    asked, and when positions before this step were skipped (a cached prefix): the engine then finds
    the list short and fails the request rather than report a gap."""
    if r.params.prompt_logprobs is None or r.output_ids:  # token 1 exists: they were made (or came from
        return range(0)  # a prefill worker); a recompute after preemption does not redo them
    have = len(r.prompt_logprobs)  # prompt tokens 1..have are done: position `have` is the next one needed
    if r.num_computed > have:
        return range(0)
    return range(have, min(r.num_computed + n, len(r.prompt_ids) - 1))
