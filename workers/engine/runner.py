"""The model and its tensors: builds a step's inputs, runs one forward, returns logits.

A step's tokens are flattened into one sequence of batch 1 (`input_ids: [1, T]`), with
explicit positions; the attention function (attention.py) knows from `STEP` where each
request's tokens start and which blocks hold its past.
"""

from __future__ import annotations

from typing import Callable

import torch

from workers.engine import attention
from workers.engine.kv_cache import KVCache
from workers.engine.request import Request


class ModelRunner:
    def __init__(self, model, kv: KVCache, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = kv.device
        model.config._attn_implementation = attention.register()
        for sub in model.modules():  # some models cache the implementation per sub-config
            cfg = getattr(sub, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = model.config._attn_implementation

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # row of (block, K|V, offset) in a layer viewed as [blocks * 2 * block_size, heads, dim]
        bs = self.block_size
        k = block_table[positions // bs] * (2 * bs) + positions % bs
        return k, k + bs

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward every request's uncached tokens; returns [len(reqs), vocab] float32 logits
        of each request's last token."""
        ids, k_slots, v_slots, positions, spans, last = [], [], [], [], [], []
        start = 0
        for req in reqs:
            toks = req.all_ids[req.num_computed:]
            if req.num_computed != 0:
                raise RuntimeError(f"request {req.request_id}: prefill of a partly cached prompt is not supported")
            pos = torch.arange(len(toks))
            k, v = self._slots(torch.tensor(req.block_ids), pos)
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
        logits = self._forward(torch.cat(ids), torch.cat(positions), torch.cat(k_slots), torch.cat(v_slots), last)
        for req in reqs:
            req.num_computed = req.num_tokens
        return logits

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token per request (its last generated one); returns [len(reqs), vocab] logits."""
        bs = self.block_size
        max_blocks = max(len(r.block_ids) for r in reqs)
        table = torch.zeros(len(reqs), max_blocks, dtype=torch.long)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = torch.tensor(r.block_ids)
        lens = torch.tensor([r.num_tokens for r in reqs])
        pos = lens - 1
        k = table[torch.arange(len(reqs)), pos // bs] * (2 * bs) + pos % bs
        step = attention.STEP
        step.is_prefill = False
        step.on_layer = None
        step.block_tables = table.to(self.device)
        step.mask = (torch.arange(max_blocks * bs)[None, :] < lens[:, None]).view(len(reqs), 1, 1, -1).to(self.device)
        ids = torch.tensor([r.output_ids[-1] for r in reqs])
        logits = self._forward(ids, pos, k, k + bs, list(range(len(reqs))))
        for r in reqs:
            r.num_computed = r.num_tokens
        return logits

    def _forward(self, ids, positions, k_slots, v_slots, keep: list[int]) -> torch.Tensor:
        dev = self.device
        step = attention.STEP
        step.pool = self.kv.pool
        step.k_slots = k_slots.to(dev)
        step.v_slots = v_slots.to(dev)
        try:
            out = self.model(
                input_ids=ids.to(dev).unsqueeze(0),
                position_ids=positions.to(dev).unsqueeze(0),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=dev),
            )
        finally:
            step.on_layer = None
        return out.logits[0].float()  # [len(keep), vocab]
