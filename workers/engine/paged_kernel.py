"""Paged attention in Triton: queries attend over the KV pool in place, through block tables.

One kernel serves decode (one query token per request) and prefill over a cached prefix
(a chunk of query tokens whose keys are the request's whole context so far). No context
is copied: each program reads its keys and values straight from the pool's blocks.

Work split (flash-decoding): program (tile, kv_head, split)
    tile     up to BLOCK_Q query tokens of one request (decode: exactly one)
    kv_head  the G query heads that share this KV head are rows of one tile, so K and V are
             read once for all of them (rows = BLOCK_Q tokens x GP heads, GP = G padded to 2^k)
    split    a slice of split_len keys; with num_splits > 1 each program writes its partial
             (unnormalised output, running max, running sum) and `_combine` merges the slices

A request of context c runs ceil(c / split_len) splits that do work; the rest return at once,
so a step costs the sum of its contexts, not batch x longest. Softmax runs in base 2
(scale folded with log2(e)). Keys past a request's length are masked and their values never
read: blocks hold whatever bytes were there before (possibly NaN), and must not leak in.

Layouts:
    q      [T, H, D]           (any strides on T and H; D contiguous)
    pool   one layer [num_blocks, 2, block_size, KVH, D]  (0 = K, 1 = V)
    table  [S, max_blocks]     block ids of request s
    out    [T, H, D]
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG = tl.constexpr(-1.0e30)  # "minus infinity" that stays finite: max/exp2 of two of these is 0, not NaN
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)


@triton.jit
def _keys(q, qpos, m_i, l_i, acc, n0, end, table, kv_ptr, stride_blk, stride_kv, stride_tok, head_off, scale, d,
          BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """One step of online softmax over keys [n0, n0 + BLOCK_N) (those below `end`)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    blk = tl.load(table + n // BS, mask=n_ok, other=0).to(tl.int64)
    off = blk * stride_blk + (n % BS) * stride_tok + head_off
    k = tl.load(kv_ptr + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # [M, BLOCK_N], log2 domain
    keep = n_ok[None, :] & (n[None, :] <= qpos[:, None])
    s = tl.where(keep, s, NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(keep, tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_ptr + stride_kv + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Run-time ints that differ from launch to launch (batch, split count, a mixed step's table width) are
# not specialised: Triton would otherwise compile a variant for each of "== 1", "% 16 == 0" and neither.
@triton.jit(do_not_specialize=["stride_table", "num_rows", "num_splits"])
def _paged_attention(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_blk, stride_kv, stride_tok, stride_head,
    table_ptr, stride_table,
    ctx_ptr,  # decode: [S] context lengths (the new token included)
    tile_seq_ptr, tile_row_ptr, tile_len_ptr, tile_pos_ptr,  # prefill tiles: [tiles] int32
    out_ptr, stride_ot, stride_oh,
    part_o_ptr, part_m_ptr, part_l_ptr,  # [num_splits, T, H, D], [num_splits, T, H] fp32
    num_rows, num_heads, scale,
    split_len, num_splits,  # run-time values: a step's context must not pick a new compiled variant
    G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr,
    DECODE: tl.constexpr, INTERPRET: tl.constexpr, HEADS_FIRST: tl.constexpr = False,
):
    if HEADS_FIRST:  # the KV heads of one block run side by side (they share its DRAM rows)
        kvh = tl.program_id(0)
        tile = tl.program_id(1)
    else:
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tile
        row0 = tile
        qlen = 1
        pos0 = tl.load(ctx_ptr + tile).to(tl.int32) - 1
    else:
        seq = tl.load(tile_seq_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        qlen = tl.load(tile_len_ptr + tile)
        pos0 = tl.load(tile_pos_ptr + tile)
    ctx_end = pos0 + qlen  # keys [0, ctx_end) exist; row i sees keys [0, pos0 + i]

    M: tl.constexpr = BLOCK_Q * GP
    r = tl.arange(0, M)
    qi = r // GP
    g = r % GP
    row_ok = (qi < qlen) & (g < G)
    head = kvh * G + g
    d = tl.arange(0, D)
    rows = row0 + qi
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    qpos = pos0 + qi

    start = split * split_len
    end = tl.minimum(start + split_len, ctx_end)
    m_i = tl.full([M], NEG, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    if INTERPRET:  # the CPU interpreter cannot range() over loaded values; the GPU pipelines a for loop
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _keys(q, qpos, m_i, l_i, acc, n0, end, table, kv_ptr, stride_blk, stride_kv,
                                  stride_tok, kvh * stride_head, scale, d, BLOCK_N, BS)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _keys(q, qpos, m_i, l_i, acc, n0, end, table, kv_ptr, stride_blk, stride_kv,
                                  stride_tok, kvh * stride_head, scale, d, BLOCK_N, BS)

    if num_splits == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        at = (split * num_rows + rows).to(tl.int64) * num_heads + head  # [M]
        tl.store(part_o_ptr + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m_ptr + at, m_i, mask=row_ok)
        tl.store(part_l_ptr + at, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _combine(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ot, stride_oh, num_rows, num_heads,
             num_splits, D: tl.constexpr, SP: tl.constexpr):
    """Merge the num_splits partials of row t, head h, SP splits at a time (one compiled variant for
    any split count): the largest running max first, then the partials weighted by exp2(m - max)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    top = tl.full([SP], NEG, tl.float32)
    for s0 in range(0, num_splits, SP):
        s_ok = s0 + s < num_splits
        at = ((s0 + s) * num_rows + t).to(tl.int64) * num_heads + h
        top = tl.maximum(top, tl.load(part_m_ptr + at, mask=s_ok, other=NEG))
    top_m = tl.max(top, 0)
    d = tl.arange(0, D)
    o_acc = tl.zeros([SP, D], tl.float32)
    l_acc = tl.zeros([SP], tl.float32)
    for s0 in range(0, num_splits, SP):
        s_ok = s0 + s < num_splits
        at = ((s0 + s) * num_rows + t).to(tl.int64) * num_heads + h
        m = tl.load(part_m_ptr + at, mask=s_ok, other=NEG)
        l = tl.load(part_l_ptr + at, mask=s_ok, other=0.0)
        w = tl.where(s_ok, tl.exp2(m - top_m), 0.0)
        o = tl.load(part_o_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        o_acc += o * w[:, None]
        l_acc += l * w
    out = tl.sum(o_acc, 0) / tl.sum(l_acc, 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# ---- launch -----------------------------------------------------------------------------

# Keys per inner iteration (several 16-token blocks). Decode's defaults (128 keys, 8 waves of
# programs, 2 stages, KV heads side by side) came from a sweep on the H200, interleaved, at
# batch 32 x 16k, 8 x 16k and 64 x 4k (bench/engine/paged_attention.py --sweep): 3.42 / 1.44 / 2.34 TB/s,
# within 3% of the best config at each shape. Prefill tiles keep 64.
BLOCK_N = 64
PREFILL_ROWS = 64  # rows (query tokens x padded heads) per prefill tile
COMBINE_SPLITS = 16  # partials `_combine` merges at a time (a compile-time size; any split count loops over it)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_split(batch: int, kv_heads: int, max_ctx: int, device: torch.device, waves: int = 8,
                 block_n: int = 128) -> tuple[int, int]:
    """(split_len, num_splits) for a decode of `batch` requests of at most `max_ctx` keys: enough
    programs to fill the GPU `waves` times over, each slice a multiple of BLOCK_N keys."""
    want = max(1, math.ceil(waves * _sms(device) / (batch * kv_heads)))
    split_len = max(block_n, math.ceil(math.ceil(max_ctx / want) / block_n) * block_n)
    return split_len, math.ceil(max_ctx / split_len)


def _kv_strides(pool_layer: torch.Tensor) -> tuple[int, int, int, int]:
    if pool_layer.stride(-1) != 1:
        raise ValueError("the KV pool's head dim must be contiguous")
    return pool_layer.stride(0), pool_layer.stride(1), pool_layer.stride(2), pool_layer.stride(3)


def _gqa(q: torch.Tensor, pool_layer: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = pool_layer.shape[3]
    if q.stride(-1) != 1 or head_dim != pool_layer.shape[4] or num_heads % kv_heads:
        raise ValueError(f"query [T, {num_heads}, {head_dim}] does not fit KV [{kv_heads} heads, {pool_layer.shape[4]}]")
    return num_heads // kv_heads, kv_heads, head_dim


def paged_decode(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, ctx_lens: torch.Tensor,
                 scale: float, max_ctx: int, out: torch.Tensor | None = None, waves: int = 8,
                 block_n: int = 128, num_warps: int = 4, num_stages: int = 2,
                 heads_first: bool = True) -> torch.Tensor:
    """q: [B, H, D], one token per request; table: [B, max_blocks]; ctx_lens: [B] keys per request
    (its new token included, already written to the pool); max_ctx >= every ctx_lens (a host
    number, so the launch shape is static and CUDA graphs can capture it) -> [B, H, D]."""
    batch = q.shape[0]
    G, kv_heads, head_dim = _gqa(q, pool_layer)
    GP = _pow2(G)
    block_q = max(1, 16 // GP)  # tl.dot needs at least 16 rows; extra rows are masked
    split_len, num_splits = decode_split(batch, kv_heads, max_ctx, q.device, waves, block_n)
    out = torch.empty_like(q) if out is None else out
    num_heads = q.shape[1]
    if num_splits > 1:
        part_o = torch.empty(num_splits, batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_splits, batch, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # never read; fp32 like the partials, so one split or many run the same compiled variant
        part_o = part_m = part_l = torch.empty(1, dtype=torch.float32, device=q.device)
    grid = (kv_heads, batch, num_splits) if heads_first else (batch, kv_heads, num_splits)
    _paged_attention[grid](
        q, q.stride(0), q.stride(1),
        pool_layer, *_kv_strides(pool_layer),
        table, table.stride(0),
        ctx_lens, ctx_lens, ctx_lens, ctx_lens, ctx_lens,
        out, out.stride(0), out.stride(1),
        part_o, part_m, part_l,
        batch, num_heads, scale * LOG2E,
        G=G, GP=GP, BLOCK_Q=block_q, BLOCK_N=block_n, D=head_dim, BS=pool_layer.shape[2],
        split_len=split_len, num_splits=num_splits, DECODE=True, INTERPRET=INTERPRET, HEADS_FIRST=heads_first,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine[(batch, num_heads)](part_o, part_m, part_l, out, out.stride(0), out.stride(1), batch, num_heads,
                                     num_splits, D=head_dim, SP=COMBINE_SPLITS, num_warps=1)
    return out


def prefill_tiles(chunks: list[tuple[int, int, int, int]], G: int) -> tuple[list[int], ...]:
    """Tiles of query tokens for `paged_prefill`. chunks: (seq, first row in T, query tokens,
    position of the first query token) -> four lists (seq, row, tokens, position), one entry a tile."""
    block_q = max(1, PREFILL_ROWS // _pow2(G))
    seqs, rows, lens, poss = [], [], [], []
    for seq, row, n, pos in chunks:
        for i in range(0, n, block_q):
            seqs.append(seq), rows.append(row + i), lens.append(min(block_q, n - i)), poss.append(pos + i)
    return seqs, rows, lens, poss


def paged_prefill(q: torch.Tensor, pool_layer: torch.Tensor, table: torch.Tensor, tiles: torch.Tensor,
                  scale: float, out: torch.Tensor, num_warps: int = 4, num_stages: int = 2) -> None:
    """Chunks of query tokens over their requests' whole context (cached prefix + the chunk,
    already in the pool), causal. q, out: [T, H, D] (rows not in a tile are left alone);
    tiles: [4, tiles] int32 from prefill_tiles()."""
    G, kv_heads, head_dim = _gqa(q, pool_layer)
    GP = _pow2(G)
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return
    _paged_attention[(num_tiles, kv_heads, 1)](
        q, q.stride(0), q.stride(1),
        pool_layer, *_kv_strides(pool_layer),
        table, table.stride(0),
        tiles[3], tiles[0], tiles[1], tiles[2], tiles[3],
        out, out.stride(0), out.stride(1),
        out, out, out,
        q.shape[0], q.shape[1], scale * LOG2E,
        G=G, GP=GP, BLOCK_Q=max(1, PREFILL_ROWS // GP), BLOCK_N=BLOCK_N, D=head_dim, BS=pool_layer.shape[2],
        split_len=1 << 30, num_splits=1, DECODE=False, INTERPRET=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
