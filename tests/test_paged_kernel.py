"""The Triton paged-attention kernels against the reference path, on the CPU through Triton's
interpreter (the same kernel source the GPU compiles; `pdserve-bench attention` checks it compiled,
in bf16, on the GPU)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from pdserve.workers.engine import attention
from pdserve.workers.engine import paged_kernel as pk

NUM_BLOCKS, BS, D = 64, 16, 16


def make_pool(kv_heads: int, lens: list[int], seed: int, dtype=torch.float32):
    """A pool with each request's blocks scattered at random, and NaN in every slot past a
    request's length (bytes a kernel must never read into a result)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(NUM_BLOCKS, 2, BS, kv_heads, D, generator=g).to(dtype)
    width = max(-(-n // BS) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    for s, n in enumerate(lens):
        nb = -(-n // BS)
        table[s, :nb] = torch.tensor(order[:nb])
        order = order[nb:]
        pool[table[s, nb - 1], :, (n - 1) % BS + 1:] = float("nan")
    return pool, table


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (14, 2)])  # G = 3 (padded to 4), 1, 7
@pytest.mark.parametrize("waves", [1, 8])  # one slice per request, and many slices merged
def test_decode_matches_reference(heads, kv_heads, waves):
    lens = [1, 5, 16, 33, 64, 100, 257]
    pool, table = make_pool(kv_heads, lens, seed=heads + waves)
    q = torch.randn(len(lens), heads, D, generator=torch.Generator().manual_seed(1))
    ctx = torch.tensor(lens)
    scale = 1 / math.sqrt(D)
    want = attention.reference_decode(q, pool, table, ctx, scale)
    got = pk.paged_decode(q, pool, table, ctx, scale, max(lens), waves=waves)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-5
    # the other launch order and key tile
    got = pk.paged_decode(q, pool, table, ctx, scale, max(lens), waves=waves, block_n=64, heads_first=False)
    assert (got - want).abs().max().item() < 1e-5


def test_more_splits_than_combine_merges_at_once():
    # 16-key slices over 257 keys: 17 partials, more than one of _combine's rounds (COMBINE_SPLITS)
    lens = [257, 3, 130]
    pool, table = make_pool(2, lens, seed=11)
    q = torch.randn(len(lens), 6, D, generator=torch.Generator().manual_seed(4))
    ctx = torch.tensor(lens)
    split_len, n = pk.decode_split(len(lens), 2, max(lens), torch.device("cpu"), waves=64, block_n=16)
    assert n > pk.COMBINE_SPLITS and split_len == 16
    want = attention.reference_decode(q, pool, table, ctx, 0.125)
    got = pk.paged_decode(q, pool, table, ctx, 0.125, max(lens), waves=64, block_n=16)
    assert (got - want).abs().max().item() < 1e-5


def test_decode_split_covers_every_key_once():
    for batch, ctx in ((1, 1024), (32, 16384), (64, 1000), (3, 17)):
        split_len, n = pk.decode_split(batch, 4, ctx, torch.device("cpu"))
        assert split_len % 128 == 0 and (n - 1) * split_len < ctx <= n * split_len


def test_a_steps_context_never_picks_a_new_compiled_variant():
    # Triton compiles a kernel once per set of compile-time values. A mixed step's decodes split their
    # keys by the step's longest context (a host number that changes every step): were the split
    # compile-time values, steps would keep compiling new variants while serving (a second or more each,
    # measured as prefill p99 2.5 s at 1.25 req/s on an H100). Only the model's shape and the launch
    # configuration may be compile-time (_combine merges a fixed number of splits at a time; the
    # variants a worker's whole bucket set compiles are counted in test_kernel_variants.py)
    shape = {"G", "GP", "BLOCK_Q", "BLOCK_N", "D", "BS", "DECODE", "INTERPRET", "HEADS_FIRST", "SP"}
    for kernel in (pk._paged_attention, pk._combine):  # a JITFunction, or the interpreter's wrapper: .fn
        params = inspect.signature(kernel.fn).parameters
        assert "num_splits" in params
        assert {n for n, p in params.items() if "constexpr" in str(p.annotation)} <= shape
    # the decode splits of very different contexts run one variant: same compile-time values
    q = torch.randn(2, 6, D)
    for lens in ([5, 257], [1, 16], [100, 64]):
        pool, table = make_pool(2, lens, seed=len(lens))
        ctx = torch.tensor(lens)
        want = attention.reference_decode(q, pool, table, ctx, 1 / math.sqrt(D))
        got = pk.paged_decode(q, pool, table, ctx, 1 / math.sqrt(D), max(lens), waves=8)
        assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (14, 2)])
def test_prefix_prefill_matches_reference(heads, kv_heads):
    lens = [40, 300, 77]
    pool, table = make_pool(kv_heads, lens, seed=3)
    # chunks: (row in table, first row in T, tokens, first position); positions end at each length
    chunks = [(0, 0, 10, 30), (1, 10, 100, 200), (2, 110, 1, 76)]
    T = 111
    q = torch.randn(T, heads, D, generator=torch.Generator().manual_seed(2))
    scale = 1 / math.sqrt(D)
    tiles = torch.tensor(pk.prefill_tiles(chunks, heads // kv_heads), dtype=torch.int32)
    got = torch.full((T, heads, D), float("nan"))
    pk.paged_prefill(q, pool, table, tiles, scale, got)
    for seq, row, n, pos in chunks:
        want = attention.reference_prefix(q[row:row + n], pool, table[seq], pos, scale)
        assert (got[row:row + n] - want).abs().max().item() < 1e-5, (seq, row, n, pos)


def test_decode_in_half_precision():
    lens = [20, 130]
    pool, table = make_pool(2, lens, seed=5, dtype=torch.float16)
    q = torch.randn(2, 8, D).to(torch.float16)
    ctx = torch.tensor(lens)
    want = attention.reference_decode(q.float(), pool.float(), table, ctx, 0.25)
    got = pk.paged_decode(q, pool, table, ctx, 0.25, max(lens), waves=8)
    assert got.dtype == torch.float16 and (got.float() - want).abs().max().item() < 2e-3


@pytest.mark.parametrize("n", [1, 16, 37, 160])  # within a block, whole blocks, part of the last, many
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_lays_out_a_requests_positions_in_order_in_one_copy_each(n, dtype):
    """reference_prefix's gather: position i's K and V come from slot i % BS of block table[i // BS], bitwise
    (rows copied as 8-byte words), nothing past n (NaN in the pool there), and each of K and V is one dense
    [n, KVH, D] copy (what SDPA reads, transposed), not a view of the pool."""
    pool, table = make_pool(3, [n, 200], seed=n, dtype=dtype)
    k, v = attention.gather(pool, table[0], n)
    assert k.shape == v.shape == (3, n, D)
    want_k = torch.stack([pool[table[0, i // BS], 0, i % BS] for i in range(n)]).transpose(0, 1)
    want_v = torch.stack([pool[table[0, i // BS], 1, i % BS] for i in range(n)]).transpose(0, 1)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # no NaN: the slots past n were not taken
    for t in (k, v):
        assert t.transpose(0, 1).is_contiguous() and t.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()


def test_block_rows_copies_rows_whose_bytes_are_no_whole_words():
    """A block's row of 1 x 1 x 3 half-precision values is 6 bytes: no 8-byte view, the rows are copied in
    their own dtype, the same K and V."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(5, 2, 1, 1, 3, generator=g).to(torch.float16)
    ids = torch.tensor([3, 0, 4])
    k, v = attention.block_rows(pool, ids)
    assert k.dtype == v.dtype == torch.float16
    assert torch.equal(k, pool[ids, 0].reshape(-1, 1, 3)) and torch.equal(v, pool[ids, 1].reshape(-1, 1, 3))
    # whole words a row, but a layer of the pool that starts 2 bytes into a word (a view at an odd offset)
    flat = torch.randn(1 + 5 * 2 * 4, generator=g).to(torch.float16)
    layer = flat[1:].view(5, 2, 1, 1, 4)
    k, v = attention.block_rows(layer, ids)
    assert torch.equal(k, layer[ids, 0].reshape(-1, 1, 4)) and torch.equal(v, layer[ids, 1].reshape(-1, 1, 4))
