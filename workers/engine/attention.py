"""Attention over the paged KV cache, registered with transformers' AttentionInterface.

transformers' own model code runs unchanged; only its attention call lands here. The
runner flattens a step's tokens into one sequence of batch 1 and runs every forward (eager,
piecewise, a decode graph's capture) inside `stepping(state)`, the one place the step's
StepState is set for attention to read, and unset after, whatever happens (a graph's replay
runs no Python: what it read at capture is in the graph). A step's rows come in three kinds,
in this order:

    decode   rows [0, num_decode): one new token of a running request, over its blocks
    fresh    prefill chunks that start at position 0: causal over their own new K/V only
    prefix   prefill chunks that start later (chunked prefill, a cached prefix): causal over
             the request's blocks, the new chunk included

Per layer:
  1. write the step's new K/V into the pool at their slots (two index_copy_ calls);
  2. tell the transfer, if any, that this layer's K/V are in place (`on_layer`);
  3. attend (the `attention_mask` argument is the runner's placeholder and is ignored).
     decode rows read the pool in place: on CUDA through the Triton kernel in paged_kernel.py;
     elsewhere (CPU, tests) through the reference below, which gathers a request's blocks and
     runs SDPA over them. Prefix rows gather their request's blocks (one copy of the context,
     small beside the chunk's arithmetic) and run SDPA with a causal mask aligned to the last
     key: flash attention on CUDA. (paged_kernel's prefill reads the pool in place instead;
     `attention="triton"` picks it; on the H200 flash was faster, see bench/engine/steps.py.) Fresh rows run SDPA over the chunk's own K/V
     (flash attention on CUDA), exactly as transformers' own prefill does.

Which fused SDPA runs on CUDA is chosen once per worker process (`steady_sdpa`, called by the runner): flash, then
memory-efficient, never cuDNN's. Recent torch on sm90/sm100 with a recent cuDNN puts cuDNN attention first, and
cuDNN builds an execution graph for every new problem it meets (batch, heads, query and key lengths, strides),
cached by that key: tens of ms of host time for each new prompt length. A benchmark that repeats its lengths
never sees it; a server meets a new length nearly every prompt step. Measured on an H100 under the mixed load
(bench/results/defaults-h100-b2d1e6e): prompt steps took 47-230 ms to launch, every ms of it the launching
thread's own CPU time, with py-spy's samples inside a launch at the fresh rows' SDPA call (69%) and the plain
prefill's (8%); decode steps, which call no SDPA, launched in ~1 ms.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ATTN_NAME = "pdserve_paged"


@dataclass
class StepState:
    pool: torch.Tensor | None = None  # [layers, blocks, 2, block_size, kv_heads, head_dim]
    k_slots: torch.Tensor | None = None  # [T] int64 row in a layer viewed as [blocks*2*block_size, kv_heads, head_dim]
    v_slots: torch.Tensor | None = None  # [T]
    on_layer: Callable[[int], None] | None = None
    kernels: bool = False  # decode rows through paged_kernel (CUDA) instead of the reference path
    prefix_kernel: bool = False  # prefix rows through paged_kernel too (else gathered, then SDPA: flash on CUDA)
    # decode rows [0, num_decode)
    num_decode: int = 0
    table: torch.Tensor | None = None  # [num_decode, max_blocks] block ids
    ctx_lens: torch.Tensor | None = None  # [num_decode] keys per row, its own included
    max_ctx: int = 0  # host bound on ctx_lens (static per CUDA graph)
    ctx_host: list[int] | None = None  # ctx_lens on the host, where a step is not a graph's replay
    # fresh prefill chunks: (start, end) rows
    fresh: list[tuple[int, int]] = field(default_factory=list)
    # prefix prefill chunks: (row in prefix_table, first row, tokens, first position)
    prefix: list[tuple[int, int, int, int]] = field(default_factory=list)
    prefix_table: torch.Tensor | None = None  # [len(prefix), max_blocks]
    prefix_tiles: torch.Tensor | None = None  # [4, tiles] int32 (paged_kernel.prefill_tiles), CUDA only


class _Current:
    """The step attention reads: set by `stepping` alone (one engine per process runs one step at a time)."""
    state: StepState | None = None


CURRENT = _Current()


@contextmanager
def stepping(state: StepState) -> Iterator[StepState]:
    """`state` is the step of the forward run inside; unset after it, whatever happens (the step's
    tensors live no longer than the step: a dropped engine frees its pool)."""
    before, CURRENT.state = CURRENT.state, state
    try:
        yield state
    finally:
        CURRENT.state = before


@functools.cache
def _kernels():
    """paged_kernel, or None where Triton is missing (the reference path runs instead)."""
    try:
        from pdserve.workers.engine import paged_kernel
    except ImportError:
        return None
    return paged_kernel


def steady_sdpa(device: torch.device) -> bool:
    """On CUDA, keep cuDNN attention out of this process's SDPA calls (torch.backends.cuda.enable_cudnn_sdp,
    process-wide: a worker process runs one engine), so prompts of any length run flash (or memory-efficient)
    attention with no per-length set-up on the host (module docstring). Returns whether it changed anything."""
    if device.type != "cuda" or not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def use_kernels(device: torch.device) -> bool:
    return device.type == "cuda" and _kernels() is not None


@torch.compiler.disable  # runs eagerly inside compiled layers: host-side metadata, transfer hook, Triton
def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, out=None, **kwargs):
    # query: [1, H, T, D]; key, value: [1, KVH, T, D]  ->  returns ([1, T, H, D], None)
    # out: [T, H, D], where to write it (the cut model's attention buffer, graphs.cut_forward); else a new tensor
    step = CURRENT.state
    if step is None:
        raise RuntimeError("paged attention ran outside attention.stepping(): no step to attend over")
    layer = module.layer_idx
    pool_layer = step.pool[layer]  # [blocks, 2, block_size, KVH, D]
    num_blocks, _, block_size, kv_heads, head_dim = pool_layer.shape
    rows = pool_layer.view(num_blocks * 2 * block_size, kv_heads, head_dim)
    rows.index_copy_(0, step.k_slots, key[0].transpose(0, 1).to(rows.dtype))
    rows.index_copy_(0, step.v_slots, value[0].transpose(0, 1).to(rows.dtype))
    if step.on_layer is not None:
        step.on_layer(layer)
    scale = scaling if scaling is not None else head_dim ** -0.5

    if not step.num_decode and not step.prefix:  # a plain prefill: the transformers-equal path
        outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                               is_causal=True, scale=scale, enable_gqa=True)
                for a, b in step.fresh]
        res = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2)
        if out is None:
            return res.contiguous(), None
        out.copy_(res[0])
        return out.unsqueeze(0), None

    q = query[0].transpose(0, 1)  # [T, H, D], a view
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    kernels = _kernels() if step.kernels else None
    nd = step.num_decode
    if nd:
        if kernels is not None:
            kernels.paged_decode(q[:nd], pool_layer, step.table, step.ctx_lens, scale, step.max_ctx, out=out[:nd])
        else:
            out[:nd] = reference_decode(q[:nd], pool_layer, step.table, step.ctx_lens, scale, step.ctx_host)
    for a, b in step.fresh:
        out[a:b] = F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                  is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    if step.prefix:
        if kernels is not None and step.prefix_kernel:
            kernels.paged_prefill(q, pool_layer, step.prefix_table, step.prefix_tiles, scale, out)
        else:
            for seq, row, n, pos in step.prefix:
                out[row:row + n] = reference_prefix(q[row:row + n], pool_layer, step.prefix_table[seq], pos, scale)
    return out.unsqueeze(0), None


# ---- reference path (CPU, and the oracle the kernels are tested against) --------------------

def block_rows(pool_layer: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks `ids` ([m]), one copy of each, positions in order: [m * block_size, KVH, D]. The
    pool seen as rows, row 2b block b's K and 2b + 1 its V (contiguous: a dense source, no per-element stride
    arithmetic in index_select), each row as 8-byte words where its bytes allow (a quarter of bf16's elements
    to index): whole rows copied, bit for bit."""
    num_blocks, _, _, kv_heads, head_dim = pool_layer.shape
    rows = pool_layer.view(num_blocks * 2, -1)
    if (rows.shape[1] * rows.element_size()) % 8 == 0 and (rows.storage_offset() * rows.element_size()) % 8 == 0:
        rows = rows.view(torch.int64)  # (a view of another dtype needs whole words from its storage's start on)
    k, v = rows.index_select(0, ids * 2), rows.index_select(0, ids * 2 + 1)
    return (k.view(pool_layer.dtype).view(-1, kv_heads, head_dim),
            v.view(pool_layer.dtype).view(-1, kv_heads, head_dim))


def gather(pool_layer: torch.Tensor, table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first n positions of the blocks in `table` ([max_blocks]) -> [KVH, n, D] each: views of
    block_rows' copies, as SDPA reads them (transposed, last dim dense)."""
    k, v = block_rows(pool_layer, table[: -(-n // pool_layer.shape[2])])
    return k[:n].transpose(0, 1), v[:n].transpose(0, 1)


def reference_decode(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, ctx_lens: torch.Tensor,
                     scale: float, lengths: list[int] | None = None) -> torch.Tensor:
    """q: [B, H, D]; every request's blocks gathered, padded to the longest, masked -> [B, H, D].
    lengths: ctx_lens on the host, when known (not in a graph): the gather stops at the longest
    context instead of the table's width, and a batch whose contexts are all that long (batch 1)
    needs no mask."""
    batch, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = pool_layer.shape
    n = max(lengths) if lengths else table.shape[1] * block_size  # keys read per request
    nb = -(-n // block_size)
    k, v = (x.view(batch, nb * block_size, kv_heads, head_dim)[:, :n]
            for x in block_rows(pool_layer, table[:, :nb].reshape(-1)))
    mask = None
    if lengths is None or min(lengths) < n:
        mask = torch.arange(n, device=q.device)[None, :] < ctx_lens[:, None]  # [B, n]
        keep = mask.view(batch, n, 1, 1)
        k = torch.where(keep, k, 0)  # bytes past a request's length may be anything, NaN too, and
        v = torch.where(keep, v, 0)  # SDPA adds its mask to the scores (NaN + -inf is NaN)
        mask = mask.view(batch, 1, 1, n)
    # the G query heads that share a KV head become G "query positions" of that head
    qg = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                         attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def reference_prefix(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, pos: int,
                     scale: float) -> torch.Tensor:
    """q: [n, H, D], query tokens at positions pos..pos+n-1 of one request, causal over its blocks -> [n, H, D]."""
    n = q.shape[0]
    k, v = gather(pool_layer, table, pos + n)  # [KVH, pos + n, D]
    # causal aligned to the last key: query i sees keys [0, pos + i]; SDPA runs this as flash
    # attention on CUDA (GQA included), a materialised mask elsewhere
    mask = causal_lower_right(n, pos + n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0).to(q.dtype),
                                         v.unsqueeze(0).to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def register() -> str:
    """Register the attention function. No mask function is registered: the runner passes a
    placeholder 4-D mask, which makes transformers skip mask building (no [T, T] mask, no
    packed-sequence detection with its host sync) on every version that has AttentionInterface."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
