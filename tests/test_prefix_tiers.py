"""The engine with KV tiers below its pool: a prefix evicted from the pool comes back from host
memory (or disk) instead of being recomputed, the output equals a run without any cache, the cost
model can refuse a reload, and every block comes back."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.prefix_cache import extend_names
from pdserve.workers.engine.request import Request, SamplingParams, Status

pytestmark = pytest.mark.timeout(240)

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def engine(tmp_path=None, num_blocks=24, host_gb=0.001, disk=False, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=num_blocks, host_cache_gb=host_gb,
                               disk_cache_dir=str(tmp_path / "disk") if disk else None, disk_cache_gb=0.01, **kw))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def evict_everything(eng: Engine, tokens: list[int]) -> None:
    """Run other prompts through the pool until none of the prompt's blocks is left in it."""
    names = extend_names([], tokens[:len(tokens) // 16 * 16], 16, eng.prefix_root)
    for i in range(30):
        if not eng.blocks.match(names[:1]):
            break
        eng.generate([prompt(1000 + i, 16 * 5 + 3)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert eng.blocks.match(names[:1]) == [], "the pool still holds the prompt's first block"
    eng.tiers.host.flush()


def run(eng: Engine, tokens: list[int]) -> tuple[Request, list[torch.Tensor]]:
    req = Request(f"r-{random.random()}", list(tokens), PARAMS, return_logits=True)
    logits = [o.logits for o in eng.stream(req)]
    return req, logits


@pytest.mark.parametrize("chunked", [True, False])
def test_an_evicted_prefix_comes_back_from_host_memory(chunked):
    p = prompt(1, 70)
    cold = Engine(EngineConfig(model="tiny", num_blocks=24, prefix_cache=False))
    want, want_logits = run(cold, p + [11, 12])
    eng = engine(chunked_prefill=chunked, chunk_tokens=32)
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    got, got_logits = run(eng, p + [11, 12])
    assert got.cached_tokens == 64 and got.tier_tokens == {"host": 64}, (got.cached_tokens, got.tier_tokens)
    assert got.reload_s is not None and got.reload_s >= 0
    assert got.output_ids == want.output_ids
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests
    assert eng.tiers.reloaded_tokens["host"] == 64


def test_a_prefix_pushed_out_of_host_memory_comes_back_from_disk(tmp_path):
    p = prompt(2, 70)
    cold = Engine(EngineConfig(model="tiny", num_blocks=24, prefix_cache=False))
    want, _ = run(cold, p + [5])
    eng = engine(tmp_path, host_gb=8 * eng_entry_bytes() / 2**30, disk=True)
    eng.generate([p], PARAMS)
    evict_everything(eng, p)  # the host tier holds 8 blocks: p's went on to disk
    eng.tiers.host.flush()
    got, _ = run(eng, p + [5])
    assert got.tier_tokens.get("disk", 0) > 0, got.tier_tokens
    assert got.cached_tokens == 64 and got.output_ids == want.output_ids
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.close()


def eng_entry_bytes() -> int:
    probe = Engine(EngineConfig(model="tiny", num_blocks=4))
    return probe.layout.num_layers * probe.layout.block_bytes


def test_the_cost_model_can_choose_to_recompute():
    p = prompt(3, 70)
    eng = engine()
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    cost = eng.tiers.host.cost
    cost.seed_bandwidth("host", 1e-6)  # a "link" of 1 kB/s ...
    cost.observe_prefill(1000, 1e-3)  # ... against a prefill of a microsecond a token: recompute
    got, _ = run(eng, p + [7])
    assert got.cached_tokens == 0 and got.tier_tokens == {}
    cost.seed_bandwidth("host", 1e3)  # a fast link: reload
    evict_everything(eng, p)
    got, _ = run(eng, p + [8])
    assert got.tier_tokens == {"host": 64}


def test_abort_while_loading_and_preemption_give_every_block_back():
    p = prompt(4, 70)
    eng = engine()
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    req = Request("loading", p + [9], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request(req)
    eng.scheduler.schedule()  # admitted: its reload is issued
    eng.abort("loading")
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests and not eng.tiers.loads
    # a pool too small for everyone: preemption of requests with reloaded prefixes recomputes them
    reqs = eng.generate([p + [i] for i in range(4)], SamplingParams(max_tokens=30, ignore_eos=True))
    cold = Engine(EngineConfig(model="tiny", num_blocks=24, prefix_cache=False))
    want = cold.generate([p + [i] for i in range(4)], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in want]
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests


def test_prefill_worker_path_reloads_too():
    p = prompt(5, 70)
    eng = engine()
    [first] = eng.generate([p], PARAMS)
    evict_everything(eng, p)
    req = Request("pf", p + [3], PARAMS)
    result = eng.prefill_only(req)
    assert req.tier_tokens == {"host": 64} and req.cached_tokens == 64
    cold = Engine(EngineConfig(model="tiny", num_blocks=24, prefix_cache=False))
    [want] = cold.generate([p + [3]], PARAMS)
    assert result.first_token == want.output_ids[0]
    eng.release("pf")
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_pricing_a_waiting_prefill_reads_the_tiers_without_counting_a_lookup():
    """engine.prefill_tokens (a prefill worker prices its queue with it every tick) sees the prefix host
    memory would reload, and leaves the tiers' hits and misses to the prefill's own lookup."""
    p = prompt(7, 70)
    eng = engine()
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    host = eng.tiers.host
    before = host.figures()
    req = Request("pf", p + [3], PARAMS)
    for _ in range(3):
        assert eng.prefill_tokens(req) == 71 - 64  # the four full blocks come back from host memory
    assert (host.figures().hits, host.figures().misses) == (before.hits, before.misses)
    eng.prefill_only(req)
    assert req.tier_tokens == {"host": 64}
    assert (host.figures().hits, host.figures().misses) == (before.hits + 4, before.misses)
    eng.release("pf")


def host_lookups(eng: Engine) -> tuple[int, int]:
    """The host tier's hits and misses so far."""
    f = eng.tiers.host.figures()
    return f.hits, f.misses


def waiting_for_room(seed: int, room: int, **kw) -> tuple[Engine, list[int], list[int], tuple[int, int]]:
    """An engine whose host memory holds the first four blocks of a 70-token prompt (gone from the
    pool), with all but `room` of its pool's blocks held; the prompt, the held blocks, and the host
    tier's hits and misses by then."""
    p = prompt(seed, 70)
    eng = engine(**kw)
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    held = eng.blocks.allocate(eng.blocks.num_free - room)
    return eng, p, held, host_lookups(eng)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_waiting_for_room_is_one_tier_lookup_however_many_steps_it_waits(chunked):
    """The scheduler plans the head of `waiting` again on every step until the pool has room for it;
    the tiers count its lookup once, when it is admitted (four hits: its four full blocks)."""
    eng, p, held, (hits, misses) = waiting_for_room(8, 4, chunked_prefill=chunked)
    req = Request("waits", p + [3], PARAMS)  # 5 blocks
    eng.add_request(req)
    for _ in range(3):
        assert eng.scheduler.schedule() == [] and req.status is Status.WAITING
    assert host_lookups(eng) == (hits, misses)
    eng.blocks.free(held)
    eng.run_until_done([req])
    assert req.tier_tokens == {"host": 64} and len(req.output_ids) == PARAMS.max_tokens
    assert host_lookups(eng) == (hits + 4, misses)


def test_a_prefill_left_for_the_next_batch_is_one_tier_lookup():
    """prefill_batch leaves a request the pool has no room for beside those before it in the forward
    WAITING (None) for the next batch; the tiers count its lookup once, in the batch that takes it."""
    eng, p, held, (hits, misses) = waiting_for_room(9, 5)
    for i in range(2):
        short = Request(f"short-{i}", prompt(20 + i, 10), PARAMS)  # one block, no full one to look up
        late = eng.requests.get("late") or Request("late", p + [3], PARAMS)  # 5 blocks: 4 left beside short
        [done, left] = eng.prefill_batch([short, late])
        assert done is not None and not isinstance(done, Exception) and left is None
        assert late.status is Status.WAITING
        eng.release(short.request_id)
    assert host_lookups(eng) == (hits, misses)
    eng.blocks.free(held)
    [result] = eng.prefill_batch([late])
    assert not isinstance(result, Exception) and late.tier_tokens == {"host": 64}
    assert host_lookups(eng) == (hits + 4, misses)
    eng.release("late")
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_reservation_without_room_yet_is_one_tier_lookup():
    """A decode worker asks reserve() again on every tick while it answers None (no room yet); the
    tiers count the lookup once, for the reservation that takes the blocks (and reloads the prefix)."""
    eng, p, held, (hits, misses) = waiting_for_room(10, 4)
    req = Request("d", p + [3], PARAMS)
    eng.admit(req)
    for _ in range(3):
        assert eng.reserve("d", len(req.prompt_ids)) is None and req.status is Status.WAITING
    assert host_lookups(eng) == (hits, misses)
    eng.blocks.free(held)
    assert len(eng.reserve("d", len(req.prompt_ids))) == 5
    assert req.cached_tokens == 64 and req.tier_tokens == {"host": 64}
    assert host_lookups(eng) == (hits + 4, misses)
    eng.cancel("d")
    eng.release("d")
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_heartbeat_figures_reach_the_metrics():
    import msgspec

    from pdserve.server.metrics import Metrics
    from pdserve.protocol import control as P

    p = prompt(6, 70)
    eng = engine()
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    eng.generate([p + [1]], PARAMS)
    figures = eng.cache_figures()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(figures), type=P.CacheFigures)
    stats = wire.as_stats()
    assert stats["prefix_cache_hits"]["host"] == 64 and stats["prefix_cache_queries"] >= 70 + 71
    assert stats["tiers"]["host"]["offload_bytes"] > 0 and stats["tiers"]["host"]["reload_bytes"] > 0
    m = Metrics("tiny")
    m.observe_kv_tiers("c0", "colocated", stats)
    text = m.render().decode()
    assert 'pdserve_prefix_cache_hits_total{role="colocated",tier="host",worker="c0"} 64.0' in text, text
