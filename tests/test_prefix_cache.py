"""The prefix cache: its bookkeeping alone (torch-free), the engine reusing a cached prefix (output
equal to a run without the cache), eviction under pressure, every block back, and disaggregated
requests whose decode worker holds part of the prompt (only the rest moves, on every transport and
mode)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.protocol import control as P
from pdserve.workers.engine.block_pool import OutOfBlocks
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.prefix_cache import PrefixCache, extend_names, root_name
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.settings.worker import TransferConfig

from role_shell import Shell, pump, tokens_of

pytestmark = pytest.mark.timeout(240)

BS = 16
ROOT = root_name("test")


def names(tokens):
    return extend_names([], tokens, BS, ROOT)


# ---- bookkeeping -------------------------------------------------------------------------------


def test_names_chain_over_the_parent():
    a = names(list(range(48)))
    b = names(list(range(32)) + [7] * 16)
    c = names([99] + list(range(1, 48)))
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # same first two blocks, different third
    assert all(x != y for x, y in zip(a, c))  # one token differs in block 0: no later block matches
    assert names(list(range(47))) == a[:2]  # a partial block has no name
    assert extend_names(a[:1], list(range(16, 48)), BS, ROOT) == a  # extending continues the chain
    assert extend_names([], list(range(48)), BS, root_name("other")) != a  # another model, other names


def test_match_acquire_free_keeps_named_blocks_until_evicted():
    c = PrefixCache(8)
    blocks = c.allocate(3)
    n = names(list(range(48)))
    c.register(n, blocks)
    assert c.match(n) == blocks and c.num_free == 5
    c.free(blocks)
    assert c.num_free == 8 and c.num_cached == 3 and c.num_evictable == 3  # kept, yet counted free
    hit = c.match(n[:2] + [b"x" * 16])
    assert hit == blocks[:2]
    assert c.can_allocate(6, hit) and not c.can_allocate(7, hit)  # the hit blocks are not free once taken
    c.acquire(hit)
    assert c.num_free == 6
    more = c.allocate(6)  # 5 free + the one evictable block (the tail, blocks[2])
    assert blocks[2] in more and c.match(n) == blocks[:2] and c.evictions == 1
    with pytest.raises(OutOfBlocks):
        c.allocate(1)
    c.free(more)
    c.free(hit)
    assert c.num_free == 8 and c.num_cached == 2


def test_shared_blocks_are_refcounted_and_double_free_is_refused():
    c = PrefixCache(4)
    blocks = c.allocate(2)
    c.register(names(list(range(32))), blocks)
    c.acquire(blocks)  # a second request shares them
    c.free(blocks)
    assert c.num_free == 2 and c.num_evictable == 0  # still in use by the other
    c.free(blocks)
    assert c.num_free == 4 and c.num_evictable == 2
    with pytest.raises(ValueError, match="double free"):
        c.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        PrefixCache(4).register(names(list(range(32))), [0, 1])  # only in-use blocks can be named


def test_eviction_is_least_recently_used_and_tail_first():
    c = PrefixCache(4)
    a, b = c.allocate(2), c.allocate(2)
    na, nb = names(list(range(32))), names(list(range(500, 532)))
    c.register(na, a), c.register(nb, b)
    c.free(a)
    c.free(b)  # b freed last: most recent
    evicted = []
    c.on_evict = evicted.extend
    c.allocate(1)
    assert evicted == [a[1]]  # a's tail before its head; b untouched
    assert c.match(na) == a[:1] and c.match(nb) == b


def test_evicted_blocks_come_back_as_runs():
    """A transfer pays per run of consecutive blocks: a request's blocks freed tail-first and then
    evicted for another request must come back in order, not reversed."""
    from pdserve.workers.engine.block_pool import runs

    c = PrefixCache(16)
    a = c.allocate(16)
    c.register(names(list(range(16 * 16))), a)
    c.free(a)
    got = c.allocate(10)
    assert runs(got) == [(6, 10)], runs(got)  # the tail's ten, in order: one run


def test_a_name_held_by_another_block_stays_there():
    c = PrefixCache(4)
    x, y = c.allocate(1), c.allocate(1)
    n = names(list(range(16)))
    c.register(n, x), c.register(n, y)
    assert c.match(n) == x and c.name_of(y[0]) is None
    c.free(y)
    assert c.num_evictable == 0 and c.pool.num_free == 3  # y was unnamed: straight back


def test_disabled_cache_is_a_plain_pool():
    c = PrefixCache(4, enabled=False)
    blocks = c.allocate(2)
    c.register(names(list(range(32))), blocks)
    assert c.match(names(list(range(32)))) == [] and c.num_cached == 0
    c.free(blocks)
    assert c.pool.num_free == 4


# ---- the engine ----------------------------------------------------------------------------------


def make_engine(num_blocks=64, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=num_blocks, **kw))


def prompts(seed: int, prefix_len: int, tails: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 40000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, 40000) for _ in range(t)] for t in tails]


@pytest.mark.parametrize("chunked", [True, False])
def test_cached_prefix_gives_the_same_tokens_and_logits(chunked):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = prompts(1, 70, [5, 9])
    cold = make_engine(prefix_cache=False, chunked_prefill=chunked, chunk_tokens=32)
    [ref] = cold.generate([second], params, return_logits=True)
    ref_logits = [o for o in _logits(cold, second, params)]
    warm = make_engine(chunked_prefill=chunked, chunk_tokens=32)
    warm.generate([first], params)
    [got] = warm.generate([second], params, return_logits=True)
    assert got.cached_tokens == 64  # 4 full blocks of the shared 70-token prefix
    assert got.output_ids == ref.output_ids, (got.output_ids, ref.output_ids)
    for a, b in zip(_logits(warm, second, params), ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert warm.blocks.num_free == warm.blocks.num_blocks and not warm.requests
    assert warm.blocks.hit_tokens >= 64 + 64 and warm.blocks.queried_tokens > warm.blocks.hit_tokens


def _logits(engine: Engine, prompt: list[int], params: SamplingParams) -> list[torch.Tensor]:
    req = Request(f"l-{time.monotonic_ns()}", list(prompt), params, return_logits=True)
    return [o.logits for o in engine.stream(req)]


def test_a_repeated_prompt_reuses_all_but_its_last_block():
    eng = make_engine()
    [p] = prompts(2, 64, [0])  # exactly 4 full blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    [a] = eng.generate([p], params)
    [b] = eng.generate([p], params)
    assert a.cached_tokens == 0 and b.cached_tokens == 48  # the last token is always computed
    assert a.output_ids == b.output_ids


def test_generated_tokens_are_cached_too():
    """A follow-up turn (prompt + reply + more) reuses the reply's blocks as well."""
    eng = make_engine()
    [p] = prompts(3, 40, [0])
    [a] = eng.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))
    follow = p + a.output_ids + [5, 6, 7]
    [b] = eng.generate([follow], SamplingParams(max_tokens=2, ignore_eos=True))
    assert b.cached_tokens == (len(p) + 30 - 1) // BS * BS  # every full block but the one not yet written


def test_eviction_under_pressure_serves_everything_and_frees_every_block():
    eng = make_engine(num_blocks=24)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    batches = [prompts(10 + i, 48, [3, 7, 11]) for i in range(6)]  # far more distinct prefixes than fit
    cold = make_engine(num_blocks=24, prefix_cache=False)
    for batch in batches + batches[:2]:
        got = eng.generate(batch, params)
        want = cold.generate(batch, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert eng.blocks.evictions > 0 and eng.blocks.num_free == 24 and not eng.requests
    assert eng.blocks.num_cached <= 24


def test_abort_and_failure_give_shared_blocks_back():
    eng = make_engine(num_blocks=32)
    a, b = prompts(4, 64, [4, 6])
    eng.generate([a], SamplingParams(max_tokens=2, ignore_eos=True))
    r1 = Request("r1", b, SamplingParams(max_tokens=50, ignore_eos=True))
    r2 = Request("r2", b, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request(r1), eng.add_request(r2)
    for _ in range(3):
        eng.step()
    assert r1.block_ids[:4] == r2.block_ids[:4]  # both share the cached prefix
    eng.abort("r1")
    eng.fail("r2", "test failure")
    assert eng.blocks.num_free == 32 and not eng.requests


# ---- disaggregated: the decode worker's cache ----------------------------------------------------


@pytest.mark.parametrize("transport,mode", [("ipc", "bulk"), ("ipc", "layer"), ("zmq", "bulk"), ("zmq", "layer"),
                                            ("nixl", "bulk"), ("nixl", "layer")])
def test_decode_worker_holds_the_prefix_and_only_the_rest_moves(transport, mode):
    first, second = prompts(5, 70, [5, 21])
    sampling = P.Sampling(max_tokens=6, ignore_eos=True)
    cold = make_engine(prefix_cache=False)
    [want] = cold.generate([second], sampling)
    cfg = TransferConfig(transport=transport, mode=mode, deadline_s=10.0)
    d = Shell("decode", make_engine(kv_shared=transport == "ipc"), cfg)
    p = Shell("prefill", make_engine(), cfg)
    layout = p.engine.layout
    try:
        done = {}
        for rid, prompt in (("t1", first), ("t2", second)):
            d.role.handle(P.Reserve(rid, prompt, sampling, deadline_s=10.0))
            [res] = d.take(P.Reserved)
            p.role.handle(P.Prefill(rid, prompt, sampling, d.worker_id, res.kv_address, res.dst_blocks, 8.0,
                                    res.cached_tokens))
            pump([p, d], lambda: any(o.finished for o in tokens_of(d, rid)))
            [done[rid]] = p.take(P.PrefillDone)
            done[rid] = (res, done[rid])
        (res1, pd1), (res2, pd2) = done["t1"], done["t2"]
        assert res1.cached_tokens == 0 and res2.cached_tokens == 64
        assert len(res2.dst_blocks) == 2  # (91 - 64) tokens: two blocks move, four stay put
        assert pd2.kv_bytes == 2 * BS * layout.bytes_per_token < pd1.kv_bytes
        assert pd2.timeline.cached_tokens == 64  # the prefill worker reused its own copy too
        assert [o.token_id for o in tokens_of(d, "t2")] == want.output_ids
        assert p.engine.blocks.num_free == p.engine.blocks.num_blocks
        assert d.engine.blocks.num_free == d.engine.blocks.num_blocks and not d.engine.requests
    finally:
        p.role.close(), d.role.close(), d.engine.kv.close()


def test_prefill_refuses_a_skip_that_is_not_whole_blocks():
    cfg = TransferConfig(transport="zmq", deadline_s=5.0)
    p = Shell("prefill", make_engine(), cfg)
    try:
        [prompt] = prompts(6, 40, [0])
        p.role.handle(P.Prefill("bad", prompt, P.Sampling(), "d", "tcp://127.0.0.1:1", [1], 5.0, 10))
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "invalid" and "multiple of the block size" in failed.error
        assert not p.engine.requests
    finally:
        p.role.close()
