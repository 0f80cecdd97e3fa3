"""A prefill worker prefills several waiting prompts in one forward (engine.prefill_batch; the role's
batch: workers/roles/prefill.py): the same first tokens and KV as one prompt at a time, fewer forwards
within --max-batched-tokens, and each request's failure its own."""

from __future__ import annotations

import pytest
import torch

from pdserve.protocol import control as P
from pdserve.settings.worker import EngineConfig, TransferConfig
from pdserve.workers.engine.block_pool import OutOfBlocks
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import InvalidRequest, Request, SamplingParams, Status
from pdserve.workers.roles.kv_report import DECAY, KVReport
from pdserve.workers.transfer import fake
from pdserve.workers.transfer.base import PeerState
from pdserve.workers.transfer.errors import TransferError

from role_shell import Shell, pump, tokens_of

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def tiny(num_blocks: int = 64, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=num_blocks, **kw))


def ids(start: int, n: int) -> list[int]:
    """n in-vocabulary token ids; prompts from different starts share no leading block."""
    return [(start + 7 * i) % 250 + 5 for i in range(n)]


def forwards(engine: Engine, monkeypatch) -> list[list[tuple[str, int]]]:
    """Every forward the engine runs from now on, as (request id, positions computed) per request."""
    seen: list[list[tuple[str, int]]] = []
    run = engine.runner.run

    def spy(work, on_layer=None, feed=None):
        seen.append([(r.request_id, n) for r, n in work])
        return run(work, on_layer, feed)

    monkeypatch.setattr(engine.runner, "run", spy)
    return seen


def poison(engine: Engine, seed: int) -> None:
    """Seeded garbage in every block (finite: padding rows' keys are masked, not skipped), so a block a
    prefill did not write cannot pass for one it did."""
    g = torch.Generator().manual_seed(seed)
    engine.kv.pool.copy_(torch.randn(engine.kv.pool.shape, generator=g) * 50)


def kv_of(engine: Engine, blocks: list[int], n: int) -> torch.Tensor:
    """The K and V of a prompt's first n positions: [layers, 2, n, kv_heads, head_dim]."""
    pool = engine.kv.pool[:, blocks]  # [layers, blocks, 2, block_size, kv_heads, head_dim]
    layers, b, two, bs, heads, dim = pool.shape
    return pool.permute(0, 2, 1, 3, 4, 5).reshape(layers, two, b * bs, heads, dim)[:, :, :n].clone()


# float32 on the CPU: a batch's matrix products have more rows than one prompt's, and a CPU kernel may tile
# them differently (sums in another order, a few ulp apart); a wrong block or position moves values by whole units
TOL = dict(rtol=1e-4, atol=1e-4)


def test_batched_prefill_equals_one_prompt_at_a_time():
    prefix = ids(0, 32)  # two full blocks, cached on both engines before the batch
    prompts = [prefix + ids(100, 13), ids(200, 9), prefix + ids(150, 1), ids(300, 50)]
    engines = [tiny(), tiny()]
    for seed, e in enumerate(engines):
        poison(e, seed)
        e.prefill_only(Request("seed", prefix + ids(400, 5), PARAMS))
        e.release("seed")  # its two full blocks stay in the prefix cache
    batched, alone = engines
    reqs = [Request(f"b{i}", p, PARAMS) for i, p in enumerate(prompts)]
    calls = []
    results = batched.prefill_batch(reqs, on_layer=calls.append)
    assert calls == list(range(batched.layout.num_layers))  # once per layer, for the whole batch
    singles = []
    for i, p in enumerate(prompts):
        req = Request(f"a{i}", p, PARAMS)
        singles.append((req, alone.prefill_only(req)))
    assert [r.cached_tokens for r in reqs] == [32, 0, 32, 0] == [r.cached_tokens for r, _ in singles]
    for req, got, (single, want) in zip(reqs, results, singles):
        n = len(req.prompt_ids)
        assert req.status is Status.SENDING and got.first_token == want.first_token, req.request_id
        torch.testing.assert_close(got.logits.cpu(), want.logits.cpu(), **TOL)
        torch.testing.assert_close(kv_of(batched, got.block_ids, n), kv_of(alone, want.block_ids, n), **TOL)
    stamps = {(r.stamps.prefill_start, r.stamps.prefill_end) for r in reqs}  # one forward: one start, one end
    assert len(stamps) == 1 and reqs[0].stamps.prefill_end > reqs[0].stamps.prefill_start
    for e, rs in ((batched, reqs), (alone, [r for r, _ in singles])):
        for r in rs:
            e.release(r.request_id)
        assert e.blocks.num_free == e.blocks.num_blocks


def test_one_requests_failure_in_a_batch_is_its_own(monkeypatch):
    """Invalid, no room, a failed draw: that request alone; one that does not fit beside the requests
    before it stays WAITING for the next batch."""
    e = tiny(num_blocks=10)
    seen = forwards(e, monkeypatch)
    draw = e.sampler._draw

    def flaky(rows, reqs):  # the batch's draw raises while `bad` is in it: redone row by row
        if any(r.request_id == "bad" for r in reqs):
            raise RuntimeError("injected")
        return draw(rows, reqs)

    monkeypatch.setattr(e.sampler, "_draw", flaky)
    seeded = SamplingParams(max_tokens=4, temperature=0.7, seed=1)
    reqs = [Request("a", ids(0, 40), PARAMS), Request("empty", [], PARAMS), Request("bad", ids(50, 20), seeded),
            Request("b", ids(100, 40), PARAMS), Request("waits", ids(200, 40), PARAMS)]
    for r in reqs[:1] + reqs[2:]:
        e.admit(r)
    a, empty, bad, b, waits = e.prefill_batch(reqs)  # 3 + 2 + 3 blocks taken; `waits` needs 3, 2 are free
    assert isinstance(empty, InvalidRequest) and "empty" in str(empty)
    assert "sampling generated token 0 failed" in str(bad) and reqs[2].finished and not reqs[2].block_ids
    assert waits is None and reqs[4].status is Status.WAITING and not reqs[4].block_ids
    assert a.first_token >= 0 and b.first_token >= 0 and seen == [[("a", 40), ("bad", 20), ("b", 40)]]
    big = Request("big", ids(300, 100), SamplingParams(max_tokens=1))  # 7 blocks: 4 free beside a and b
    [no_room, after] = e.prefill_batch([big, reqs[4]])
    assert isinstance(no_room, OutOfBlocks) and big.finished  # the first without room fails, as alone
    assert after.first_token >= 0 and seen[-1] == [("waits", 40)]  # the next one goes on
    for rid in ("a", "b", "waits"):
        e.release(rid)
    assert e.blocks.num_free == e.blocks.num_blocks and not e.requests


def ready_pair(mode: str, prefill_engine: Engine, fault: str | None = None) -> tuple[Shell, Shell]:
    """A decode and a prefill role over zmq, their handshake done (so every prompt sent after it waits
    together for the prefill worker's next tick)."""
    cfg = TransferConfig(transport="zmq", mode=mode, deadline_s=10.0)
    d = Shell("decode", tiny(), cfg)
    p = Shell("prefill", prefill_engine, cfg)
    if fault is not None:
        p.role.sender.close()
        p.role.sender = fake.make_sender(p.engine.kv, cfg, fault)
    p.role.handle(P.Connect(d.worker_id, d.role.kv_address))
    pump([p, d], lambda: p.role.sender.reach(d.role.kv_address)[0] is PeerState.READY, 10.0)
    return p, d


def send(p: Shell, d: Shell, prompts: dict[str, list[int]], sampling: P.Sampling) -> None:
    """Reserve each prompt on the decode worker, then hand them all to the prefill worker."""
    for rid, prompt in prompts.items():
        d.role.handle(P.Reserve(rid, prompt, sampling, deadline_s=10.0))
    reserved = {m.request_id: m for m in d.take(P.Reserved)}
    for rid, prompt in prompts.items():
        r = reserved[rid]
        p.role.handle(P.Prefill(rid, prompt, sampling, d.worker_id, r.kv_address, r.dst_blocks, 8.0,
                                skip_tokens=r.cached_tokens))


def test_prefill_worker_batches_waiting_prompts_within_the_token_budget(monkeypatch):
    """Budget 100: a cached prefix does not count (74 tokens computing 10 ride with two of 40), a prompt
    past the budget runs alone and whole, the first of its forward."""
    p, d = ready_pair("bulk", tiny(max_batched_tokens=100))
    try:
        sampling = P.Sampling(max_tokens=2, ignore_eos=True)
        send(p, d, {"warm": ids(0, 64)}, sampling)
        pump([p, d], lambda: p.take(P.PrefillDone))  # its four full blocks stay in the prefill worker's cache
        seen = forwards(p.engine, monkeypatch)
        p.kv_report = report = KVReport(p.engine, p.worker_id)  # what prices a prefill here for the router
        prompts = {"cached": ids(0, 64) + ids(500, 10), "x": ids(100, 40), "y": ids(200, 40),
                   "long": ids(300, 150), "z": ids(400, 30)}
        send(p, d, prompts, sampling)
        done: list[P.PrefillDone] = []
        pump([p, d], lambda: done.extend(p.take(P.PrefillDone)) or len(done) == len(prompts))
        assert not p.take(P.RequestFailed)
        assert seen == [[("cached", 10), ("x", 40), ("y", 40)], [("long", 150)], [("z", 30)]]
        assert all(sum(n for _, n in f) <= 100 or len(f) == 1 for f in seen)
        first = {m.request_id: m.timeline.stamps for m in done}
        assert first["cached"]["prefill_end"] == first["y"]["prefill_end"] < first["long"]["prefill_start"]
        # its prefill speed: one observation a forward, of all the tokens it computed (decayed sums: n, tokens)
        assert report._fit[:2] == pytest.approx([1 + DECAY + DECAY ** 2, 90 * DECAY ** 2 + 150 * DECAY + 30])
        assert p.engine.blocks.num_free == p.engine.blocks.num_blocks
    finally:
        p.role.close(), d.role.close()


def test_bulk_transfers_open_during_the_forward_and_move_when_it_ends(monkeypatch):
    """Bulk mode opens each request's transfer at the forward's first layer, as layer mode does: the decode
    worker's Accept comes back while the forward runs, so the KV moves as soon as the forward ends, in the same
    tick. (Opened after the forward, the Accept was still due then, and the KV waited for the loop's next tick:
    under load, a whole next forward. On one H100 at bc07f77 the 1P:1D pair's exposed transfer averaged 29 ms
    at 5 req/s and 75 ms at 10 on the mixed workload, for copies of ~1 ms.)"""
    p, d = ready_pair("bulk", tiny())
    try:
        opened: dict = {}
        opener = p.role.sender.open

        def open_and_keep(request_id, *args):
            opened[request_id] = opener(request_id, *args)
            return opened[request_id]

        monkeypatch.setattr(p.role.sender, "open", open_and_keep)
        run = p.engine.runner.run

        def forward(work, on_layer=None, feed=None):  # a forward long enough for the Accept to come back
            out = run(work, on_layer, feed)
            for t in opened.values():
                assert t.wait_accepted(5.0)
            return out

        monkeypatch.setattr(p.engine.runner, "run", forward)
        prompts = {"a": ids(0, 21), "b": ids(60, 35)}
        send(p, d, prompts, P.Sampling(max_tokens=3, ignore_eos=True))
        p.role.tick()  # the forward, then each request's transfer started and followed once
        assert sorted(opened) == ["a", "b"]
        for t in opened.values():  # every layer handed to the transport in that tick
            assert t.layers_sent == set(range(p.engine.layout.num_layers)), t.state
        pump([p, d], lambda: all(any(o.finished for o in tokens_of(d, r)) for r in prompts))
        reference = tiny().generate(list(prompts.values()), SamplingParams(max_tokens=3, ignore_eos=True))
        assert [[o.token_id for o in tokens_of(d, r)] for r in prompts] == [r.output_ids for r in reference]
    finally:
        p.role.close(), d.role.close()


def test_a_prefill_worker_reports_the_prompt_tokens_waiting_for_its_next_forwards():
    """The router prices a prefill against the queue a heartbeat reports (KVCosts.queued_tokens). A prefill
    worker's queue is the engine's WAITING requests, never the scheduler's: after each pick, the tokens the
    requests left waiting will compute (a cached prefix not counted) are what it reports."""
    p, d = ready_pair("bulk", tiny(max_batched_tokens=100))
    try:
        sampling = P.Sampling(max_tokens=2, ignore_eos=True)
        send(p, d, {"warm": ids(0, 64)}, sampling)
        pump([p, d], lambda: p.take(P.PrefillDone))  # its four full blocks stay in the prefill worker's cache
        p.kv_report = report = KVReport(p.engine, p.worker_id)
        assert report.costs().queued_tokens == 0
        prompts = {"x": ids(100, 40), "y": ids(200, 40), "long": ids(300, 150), "cached": ids(0, 64) + ids(500, 10),
                   "z": ids(400, 30)}
        send(p, d, prompts, sampling)
        p.role.tick()  # x and y in one forward; long, cached (10 of its 74 to compute) and z left waiting
        assert [r.request_id for r in p.engine.in_state(Status.WAITING)] == ["long", "cached", "z"]
        assert report.costs().queued_tokens == 150 + 10 + 30
        p.role.tick()  # long alone (past the budget); cached and z wait
        assert report.costs().queued_tokens == 10 + 30
        p.role.tick()  # cached and z in one forward: nothing waits
        assert report.costs().queued_tokens == 0
        assert not p.engine.in_state(Status.WAITING) and not p.take(P.RequestFailed)
        pump([p, d], lambda: not p.role.sending)  # the transfers end before the roles close
    finally:
        p.role.close(), d.role.close()


def tier_lookups(engine: Engine) -> tuple[int, int]:
    """The KV tiers' hits and misses so far, every tier's together."""
    figures = [t.figures() for t in engine.tiers.levels]
    return sum(f.hits for f in figures), sum(f.misses for f in figures)


def test_a_waiting_request_is_one_tier_lookup_however_many_ticks_it_waits():
    """Every tick prices the requests left waiting again (engine.prefill_tokens: the batch budget and the
    heartbeat's queued tokens); that look counts nothing, so the tiers' hits and misses count each
    prefill's lookup once. Host memory below the pool holds none of these prompts: each prefill's lookup
    is one miss (it stops at the first)."""
    p, d = ready_pair("bulk", tiny(max_batched_tokens=100, host_cache_gb=0.001))
    try:
        sampling = P.Sampling(max_tokens=2, ignore_eos=True)
        p.kv_report = report = KVReport(p.engine, p.worker_id)
        send(p, d, {"x": ids(100, 40), "y": ids(200, 40), "long": ids(300, 150), "z": ids(400, 30)}, sampling)
        p.role.tick()  # x and y in one forward; long and z wait
        assert tier_lookups(p.engine) == (0, 2) and report.costs().queued_tokens == 150 + 30
        p.role.tick()  # long alone (past the budget); z waits
        assert tier_lookups(p.engine) == (0, 3) and report.costs().queued_tokens == 30
        p.role.tick()
        assert tier_lookups(p.engine) == (0, 4) and report.costs().queued_tokens == 0
        assert not p.engine.in_state(Status.WAITING) and not p.take(P.RequestFailed)
        pump([p, d], lambda: not p.role.sending)  # the transfers end before the roles close
    finally:
        p.role.close(), d.role.close()


def test_a_failed_or_aborted_transfer_in_a_batch_fails_that_request_alone(monkeypatch):
    """Layer mode, one forward for four requests: `bad`'s transfer fails to open at its first layer (the
    forward goes on for the others), `late-1` is aborted while its KV is in flight; `ok-0` and `ok-2`
    are delivered, and decode to the tokens a colocated run makes."""
    p, d = ready_pair("layer", tiny(), fault="late")
    try:
        opener = p.role.sender.open

        def open_or_fail(request_id, *args):
            if request_id == "bad":
                raise TransferError(f"request {request_id}: injected")
            return opener(request_id, *args)

        monkeypatch.setattr(p.role.sender, "open", open_or_fail)
        seen = forwards(p.engine, monkeypatch)
        sampling = P.Sampling(max_tokens=6, ignore_eos=True)
        prompts = {"ok-0": ids(0, 21), "bad": ids(60, 35), "late-1": ids(120, 40), "ok-2": ids(180, 9)}
        send(p, d, prompts, sampling)
        p.role.tick()
        assert seen == [[(rid, len(pr)) for rid, pr in prompts.items()]]  # one forward for all four
        [failed] = p.take(P.RequestFailed)
        assert failed.request_id == "bad" and failed.kind == "transfer" and "injected" in failed.error
        assert "late-1" in p.role.sending  # its writes are held in flight
        p.role.handle(P.Abort("late-1", "client left"))
        [aborted] = p.take(P.RequestFailed)
        assert aborted.request_id == "late-1" and aborted.kind == "aborted"
        pump([p, d], lambda: all(any(o.finished for o in tokens_of(d, r)) for r in ("ok-0", "ok-2")))
        assert sorted(m.request_id for m in p.take(P.PrefillDone)) == ["ok-0", "ok-2"]
        reference = tiny().generate([prompts["ok-0"], prompts["ok-2"]], SamplingParams(max_tokens=6, ignore_eos=True))
        assert [[o.token_id for o in tokens_of(d, r)] for r in ("ok-0", "ok-2")] == [r.output_ids for r in reference]
        assert not p.engine.requests and p.engine.blocks.num_free == p.engine.blocks.num_blocks
        p.role.sender.release("late-1")
        for rid in ("bad", "late-1"):
            d.role.handle(P.Abort(rid, "the router gave up"))
    finally:
        p.role.close(), d.role.close()
