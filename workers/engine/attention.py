"""Attention over the paged KV cache, registered with transformers' AttentionInterface.

transformers' own model code runs unchanged; only its attention call lands here. The
runner flattens a step's tokens into one sequence of batch 1 and sets `STEP` (what the
step is: slots to write, per-request spans or block tables) before the forward.

Per layer:
  1. write the step's new K/V into the pool at their slots (two index_copy_ calls);
  2. tell the transfer, if any, that this layer's K/V are in place (`on_layer`);
  3. attend (the `attention_mask` argument is the runner's placeholder and is ignored):
     prefill: each request's fresh K/V, causal (its prompt starts at position 0);
     decode: gather each request's blocks through its block table, mask past its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

ATTN_NAME = "pdserve_paged"


@dataclass
class StepState:
    is_prefill: bool = True
    pool: torch.Tensor | None = None  # [layers, blocks, 2, block_size, kv_heads, head_dim]
    k_slots: torch.Tensor | None = None  # [T] int64 row in a layer viewed as [blocks*2*block_size, kv_heads, head_dim]
    v_slots: torch.Tensor | None = None  # [T]
    spans: list[tuple[int, int]] = field(default_factory=list)  # prefill: (start, end) of each request in T
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks] int64
    mask: torch.Tensor | None = None  # decode: [B, 1, 1, max_blocks*block_size] bool, True = attend
    on_layer: Callable[[int], None] | None = None


# The runner fills this in before each forward; one engine per process runs one step at a time.
STEP = StepState()


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query: [1, H, T, D]; key, value: [1, KVH, T, D]  ->  returns ([1, T, H, D], None)
    step = STEP
    layer = module.layer_idx
    pool_layer = step.pool[layer]
    num_blocks, _, block_size, kv_heads, head_dim = pool_layer.shape
    rows = pool_layer.view(num_blocks * 2 * block_size, kv_heads, head_dim)
    rows.index_copy_(0, step.k_slots, key[0].transpose(0, 1).to(rows.dtype))
    rows.index_copy_(0, step.v_slots, value[0].transpose(0, 1).to(rows.dtype))
    if step.on_layer is not None:
        step.on_layer(layer)

    if step.is_prefill:
        outs = []
        for start, end in step.spans:
            out = F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                is_causal=True, scale=scaling, enable_gqa=True,
            )
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous(), None

    # decode: one new token per request; gather K and V through the block tables
    batch, max_blocks = step.block_tables.shape
    k = pool_layer[:, 0][step.block_tables]  # [B, MB, bs, KVH, D], contiguous
    v = pool_layer[:, 1][step.block_tables]
    k = k.view(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)  # [B, KVH, ctx, D]
    v = v.view(batch, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    # Grouped-query trick: the G query heads that share a KV head become G "query positions"
    # of that head, so no backend has to repeat K/V (query head h reads KV head h // G).
    num_heads = query.shape[1]
    q = query[0].transpose(0, 1).reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=step.mask, scale=scaling)
    return out.reshape(batch, num_heads, head_dim).unsqueeze(0), None  # [1, B, H, D]


def register() -> str:
    """Register the attention function. No mask function is registered: the runner passes a
    placeholder 4-D mask, which makes transformers skip mask building (no [T, T] mask, no
    packed-sequence detection with its host sync) on every version that has AttentionInterface."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
