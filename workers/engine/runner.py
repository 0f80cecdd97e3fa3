"""The model and its tensors: builds a step's inputs, runs one forward, returns logits.

A step's tokens are flattened into one sequence of batch 1 (`input_ids: [1, T]`), with
explicit positions; the attention function (attention.py) knows from `STEP` where each
request's tokens start and which blocks hold its past.

On CUDA, decode steps replay CUDA graphs (graphs.py): a decode step of a 7B model is
launch-bound (hundreds of small kernels), and replaying them costs a fraction of
launching them from Python. Prefill runs eagerly: it is compute-bound, and its
per-layer transfer hook must run on the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from workers.engine import attention
from workers.engine.kv_cache import KVCache
from workers.engine.request import Request


class ModelRunner:
    def __init__(self, model, kv: KVCache, block_size: int, scratch_block: int,
                 max_num_seqs: int, max_model_len: int, cuda_graphs: bool):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.scratch_block = scratch_block  # padding rows of a graphed batch write here
        self.device = kv.device
        model.config._attn_implementation = attention.register()
        for sub in model.modules():  # some models keep a per-sub-module config
            cfg = getattr(sub, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = model.config._attn_implementation
        # transformers returns a 4-D mask as-is, so it builds none; attention ignores it
        self.placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
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
    def prefill(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward every request's prompt; returns [len(reqs), vocab] float32 logits of each
        request's last token."""
        ids, k_slots, v_slots, positions, spans, last = [], [], [], [], [], []
        start = 0
        for req in reqs:
            if req.num_computed != 0:
                raise RuntimeError(f"request {req.request_id}: prefill of a partly cached prompt is not supported")
            toks = req.all_ids
            pos = torch.arange(len(toks))
            k, v = self.slots(torch.tensor(req.block_ids)[pos // self.block_size], pos)
            ids.append(torch.tensor(toks))
            positions.append(pos)
            k_slots.append(k)
            v_slots.append(v)
            spans.append((start, start + len(toks)))
            start += len(toks)
            last.append(start - 1)
        step = attention.STEP
        step.is_prefill = True
        step.spans = spans
        step.on_layer = on_layer
        step.k_slots = torch.cat(k_slots).to(self.device)
        step.v_slots = torch.cat(v_slots).to(self.device)
        try:
            logits = self.forward(torch.cat(ids).to(self.device), torch.cat(positions).to(self.device),
                                  torch.tensor(last, device=self.device))
        finally:
            step.on_layer = None
        for req in reqs:
            req.num_computed = req.num_tokens
        return logits

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token per request (its last generated one); returns [len(reqs), vocab] logits."""
        if self.graphs is not None:
            logits = self.graphs.decode(reqs)
        else:
            logits = self._decode_eager(reqs)
        for r in reqs:
            r.num_computed = r.num_tokens
        return logits

    def decode_inputs(self, reqs: list[Request], batch: int, max_blocks: int) -> dict[str, torch.Tensor]:
        """CPU tensors of a decode step, padded to `batch` rows and `max_blocks` columns."""
        bs = self.block_size
        n = len(reqs)
        table = torch.zeros(batch, max_blocks, dtype=torch.long)
        table[:n] = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in reqs])
        lens = torch.ones(batch, dtype=torch.long)
        lens[:n] = torch.tensor([r.num_tokens for r in reqs])
        ids = torch.zeros(batch, dtype=torch.long)
        ids[:n] = torch.tensor([r.output_ids[-1] for r in reqs])
        pos = lens - 1
        blocks_at = table[torch.arange(batch), pos // bs]
        blocks_at[n:] = self.scratch_block  # padding rows write into the scratch block
        pos[n:] = 0
        k, v = self.slots(blocks_at, pos)
        return {"ids": ids, "pos": pos, "k_slots": k, "v_slots": v, "table": table, "lens": lens}

    def _decode_eager(self, reqs: list[Request]) -> torch.Tensor:
        n = len(reqs)
        inp = self.decode_inputs(reqs, n, max(len(r.block_ids) for r in reqs))
        inp = {k: v.to(self.device) for k, v in inp.items()}
        self.set_decode_step(inp["k_slots"], inp["v_slots"], inp["table"], inp["lens"])
        return self.forward(inp["ids"], inp["pos"], torch.arange(n, device=self.device))

    def set_decode_step(self, k_slots, v_slots, table, lens) -> None:
        step = attention.STEP
        step.is_prefill = False
        step.on_layer = None
        step.k_slots, step.v_slots, step.block_tables = k_slots, v_slots, table
        ctx = table.shape[1] * self.block_size
        step.mask = (torch.arange(ctx, device=table.device)[None, :] < lens[:, None]).view(len(lens), 1, 1, ctx)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """ids, positions: [T] on the device; keep: [K] rows whose logits to return -> [K, vocab] float32."""
        attention.STEP.pool = self.kv.pool
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            attention_mask=self.placeholder_mask,
            use_cache=False,
            logits_to_keep=keep,
        )
        return out.logits[0].float()
