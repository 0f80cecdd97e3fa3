"""The three worker roles driven message by message in one process: real tiny engines, real KV
transports, the router replaced by a list of what the roles sent. Checks the request life cycles
in workers/roles/*: tokens equal a colocated run, and every block comes back (done, abort,
deadline, failure)."""

from __future__ import annotations

import time

import pytest

from pdserve.protocol import control as P
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import SamplingParams
from pdserve.settings.worker import TransferConfig
from pdserve.workers.transfer.base import PeerState

from role_shell import Shell, pump, tokens_of

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS = 64


def engine(shared: bool = False) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, kv_shared=shared))


def finished(shell: Shell, rid: str) -> bool:
    return any(o.finished for o in tokens_of(shell, rid))


@pytest.fixture(scope="module")
def reference():
    eng = engine()
    prompt = eng.text.encode_prompt("The capital of France is")
    [req] = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    return prompt, req.output_ids


@pytest.fixture(scope="module")
def concurrent(reference):
    """Prompts of other lengths beside the reference's, each with its tokens from a colocated run."""
    prompts = {"r1": reference[0], "r2": [(11 * i) % 250 + 5 for i in range(37)],
               "r3": [(13 * i + 3) % 250 + 5 for i in range(70)]}
    reqs = engine().generate(list(prompts.values()), SamplingParams(max_tokens=8, ignore_eos=True))
    return {rid: (prompt, r.output_ids) for (rid, prompt), r in zip(prompts.items(), reqs)}


@pytest.mark.parametrize("transport,mode", [("ipc", "layer"), ("zmq", "bulk")])
def test_disaggregated_roles_match_colocated(concurrent, transport, mode, monkeypatch):
    """Three prompts waiting together are prefilled in one forward (layer mode: every request's KV sent
    after each layer of it); each decodes to its colocated tokens."""
    cfg = TransferConfig(transport=transport, mode=mode, deadline_s=10.0)
    d = Shell("decode", engine(shared=True), cfg)
    p = Shell("prefill", engine(), cfg)
    try:
        p.role.handle(P.Connect(d.worker_id, d.role.kv_address))  # shaken hands first: the prompts wait together
        pump([p, d], lambda: p.role.sender.reach(d.role.kv_address)[0] is PeerState.READY)
        forwards = []
        run = p.engine.runner.run
        monkeypatch.setattr(p.engine.runner, "run", lambda work, *a, **kw: forwards.append(len(work)) or run(work, *a, **kw))
        sampling = P.Sampling(max_tokens=8, ignore_eos=True)
        for rid, (prompt, _) in concurrent.items():
            d.role.handle(P.Reserve(rid, prompt, sampling, deadline_s=10.0))
        reserved = {m.request_id: m for m in d.take(P.Reserved)}
        for rid, (prompt, _) in concurrent.items():
            r = reserved[rid]
            assert len(r.dst_blocks) * 16 >= len(prompt) and r.kv_address == d.role.kv_address
            p.role.handle(P.Prefill(rid, prompt, sampling, d.worker_id, r.kv_address, r.dst_blocks, 8.0))
        pump([p, d], lambda: all(finished(d, rid) for rid in concurrent))
        assert forwards == [len(concurrent)]  # one forward for all three
        done = {m.request_id: m for m in p.take(P.PrefillDone)}
        layout = p.engine.layout
        for rid, (prompt, expected) in concurrent.items():
            outs = tokens_of(d, rid)
            assert [o.token_id for o in outs] == expected, rid
            assert outs[0].token_id == done[rid].first_token  # the first token came with the KV, emitted first
            # whole blocks
            assert done[rid].kv_bytes == len(reserved[rid].dst_blocks) * layout.block_size * layout.bytes_per_token
            pre, dec = done[rid].timeline.stamps, outs[-1].timeline.stamps  # each worker's own clock
            assert pre["prefill_end"] > pre["prefill_start"] and pre["kv_delivered"] >= pre["prefill_end"]
            assert dec["first_step_end"] > dec["first_step_start"] and dec["token1"] >= dec["kv_received"]
        # one forward: one start and one end for all
        assert len({(m.timeline.stamps["prefill_start"], m.timeline.stamps["prefill_end"]) for m in done.values()}) == 1
        assert p.engine.blocks.num_free == NUM_BLOCKS and d.engine.blocks.num_free == NUM_BLOCKS
    finally:
        p.role.close(), d.role.close(), d.engine.kv.close()


def test_abort_in_flight_frees_blocks_only_after_the_receiver_lets_go(reference):
    prompt, _ = reference
    d = Shell("decode", engine(shared=True), TransferConfig(transport="zmq"))
    try:
        d.role.handle(P.Reserve("r2", prompt, P.Sampling(), deadline_s=10.0))
        held = NUM_BLOCKS - d.engine.blocks.num_free
        assert held > 0
        d.role.handle(P.Abort("r2", "test"))
        assert d.engine.blocks.num_free == NUM_BLOCKS - held  # not yet: a write might still land
        pump([d], lambda: d.engine.blocks.num_free == NUM_BLOCKS, 5.0)
        assert not d.engine.requests  # nothing left in any state: the request is gone, its blocks back
        assert not d.take(P.RequestFailed)  # the router asked for it: nothing to report
    finally:
        d.role.close(), d.engine.kv.close()


def test_reservation_waits_for_room_then_fails_at_its_deadline(reference):
    d = Shell("decode", engine(shared=True), TransferConfig(transport="zmq"))
    try:
        big = list(range(100, 100 + (NUM_BLOCKS - 2) * 16))
        d.role.handle(P.Reserve("big", big, P.Sampling(), deadline_s=10.0))
        assert d.take(P.Reserved)
        start = time.monotonic()
        d.role.handle(P.Reserve("small", list(range(100, 164)), P.Sampling(), deadline_s=0.3))
        assert d.role.queue_depth() == 2  # one waiting for room, one expecting its KV
        pump([d], lambda: d.sent, 5.0)
        [failed] = d.take(P.RequestFailed)
        assert failed.kind == "capacity" and "no room for 64 prompt tokens" in failed.error
        assert 0.3 <= time.monotonic() - start < 2.0
        d.role.handle(P.Abort("big", "test"))
        pump([d], lambda: d.engine.blocks.num_free == NUM_BLOCKS, 5.0)
    finally:
        d.role.close(), d.engine.kv.close()


def test_reservations_stop_at_max_num_seqs_seats(reference):
    """adopt() joins the running batch unasked, and on CUDA a decode step of more than max_num_seqs
    requests has no graph (the step fails): a decode worker seats at most max_num_seqs requests,
    reserved, receiving or running; the next waits for a seat, in arrival order, or fails at its
    deadline saying so."""
    d = Shell("decode", Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, kv_shared=True, max_num_seqs=2)),
              TransferConfig(transport="zmq"))
    try:
        prompt = list(range(100, 140))  # 3 blocks each: the pool has room for all of them
        for rid in ("a", "b", "c"):
            d.role.handle(P.Reserve(rid, prompt, P.Sampling(), deadline_s=10.0))
        assert [m.request_id for m in d.take(P.Reserved)] == ["a", "b"]
        assert d.role.queue_depth() == 3 and d.engine.blocks.num_free == NUM_BLOCKS - 6
        d.role.tick()
        assert not d.take(P.Reserved)  # room in the pool, no seat
        d.role.handle(P.Abort("a", "test"))
        pump([d], lambda: d.sent, 5.0)  # a's blocks come back once the receiver lets go; c is seated
        assert [m.request_id for m in d.take(P.Reserved)] == ["c"]
        d.role.handle(P.Reserve("late", prompt, P.Sampling(), deadline_s=0.3))
        pump([d], lambda: d.sent, 5.0)
        [failed] = d.take(P.RequestFailed)
        assert failed.request_id == "late" and failed.kind == "capacity"
        assert "2 of --max-num-seqs 2 seats taken" in failed.error and "blocks free" in failed.error
        for rid in ("b", "c"):
            d.role.handle(P.Abort(rid, "test"))
        pump([d], lambda: d.engine.blocks.num_free == NUM_BLOCKS, 5.0)
    finally:
        d.role.close(), d.engine.kv.close()


def test_prefill_past_its_deadline_or_to_nobody_fails_and_frees_blocks(reference):
    prompt, _ = reference
    p = Shell("prefill", engine(), TransferConfig(transport="zmq", deadline_s=0.5))
    try:
        started = time.monotonic()
        p.role.handle(P.Connect("d", "tcp://127.0.0.1:1"))  # nobody there: the handshake starts, nothing waits
        assert not p.sent and time.monotonic() - started < 0.1
        p.role.handle(P.Prefill("late", prompt, P.Sampling(), "d", "tcp://127.0.0.1:1", [0, 1], deadline_s=0.0))
        p.role.tick()
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "timeout" and "deadline" in failed.error
        p.role.handle(P.Prefill("lost", prompt, P.Sampling(), "d", "tcp://127.0.0.1:1", [0, 1], deadline_s=5.0))
        started = time.monotonic()
        p.role.tick()  # the handshake is under way: the request waits, the loop does not
        assert time.monotonic() - started < 0.1 and not p.sent
        pump([p], lambda: p.sent, 3.0)  # the handshake's deadline (0.5 s) ends it: the peer is dead
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "transfer" and failed.request_id == "lost" and "unreachable" in failed.error
        p.role.handle(P.Prefill("next", prompt, P.Sampling(), "d", "tcp://127.0.0.1:1", [0, 1], deadline_s=5.0))
        p.role.tick()  # known dead: fails at once, no second wait
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "transfer" and failed.request_id == "next"
        assert p.engine.blocks.num_free == NUM_BLOCKS
        p.role.handle(P.Prefill("gone", prompt, P.Sampling(), "d", "tcp://127.0.0.1:1", [0, 1], deadline_s=5.0))
        p.role.handle(P.Abort("gone", "client left"))
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "aborted" and not p.engine.requests
    finally:
        p.role.close()


def test_colocated_role_rejects_bad_requests_and_reports_its_timeline(reference):
    prompt, expected = reference
    c = Shell("colocated", engine())
    c.role.handle(P.Generate("bad", list(range(100, 100 + 3000)), P.Sampling()))
    [failed] = c.take(P.RequestFailed)
    assert failed.kind == "invalid" and "context" in failed.error
    c.role.handle(P.Generate("ok", prompt, P.Sampling(max_tokens=8, ignore_eos=True)))
    c.role.handle(P.Generate("dropped", prompt, P.Sampling(max_tokens=8)))
    c.role.handle(P.Abort("dropped", "client left"))
    pump([c], lambda: finished(c, "ok"))
    outs = tokens_of(c, "ok")
    assert [o.token_id for o in outs] == expected
    t = outs[-1].timeline.stamps
    assert t["prefill_start"] >= t["taken"] >= t["arrived"] and t["prefill_end"] > t["prefill_start"]
    assert t["first_step_end"] > t["first_step_start"] and t["token1_sent"] >= t["token1"] == t["prefill_end"]
    assert not tokens_of(c, "dropped") and c.engine.blocks.num_free == NUM_BLOCKS


def test_one_requests_failed_draw_is_reported_alone_and_the_batch_goes_on(reference, monkeypatch):
    prompt, expected = reference
    c = Shell("colocated", engine())
    draw = c.engine.sampler._draw

    def flaky(rows, reqs):  # the batch's draw raises while the bad request is in it: redone row by row
        if any(r.request_id == "bad" and len(r.output_ids) == 1 for r in reqs):
            raise RuntimeError("injected")
        return draw(rows, reqs)

    monkeypatch.setattr(c.engine.sampler, "_draw", flaky)
    c.role.handle(P.Generate("ok", prompt, P.Sampling(max_tokens=8, ignore_eos=True)))
    c.role.handle(P.Generate("bad", prompt, P.Sampling(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)))
    pump([c], lambda: finished(c, "ok"))
    [failed] = c.take(P.RequestFailed)
    assert failed.request_id == "bad" and failed.kind == "internal"
    assert "request bad: sampling generated token 1 failed: RuntimeError: injected" in failed.error
    assert len(tokens_of(c, "bad")) == 1  # token 1 went out before its second draw failed
    assert [o.token_id for o in tokens_of(c, "ok")] == expected
    assert not c.engine.requests and c.engine.blocks.num_free == NUM_BLOCKS
    assert c.role.queue_depth() == 0 and c.role.running() == 0


def test_prefill_whose_draw_fails_reports_it_and_frees_blocks(reference, monkeypatch):
    prompt, _ = reference
    p = Shell("prefill", engine(), TransferConfig(transport="zmq", deadline_s=0.5))
    d = Shell("decode", engine(), TransferConfig(transport="zmq"))  # a live peer: the prefill starts
    try:
        monkeypatch.setattr(p.engine.sampler, "_draw", lambda rows, reqs: 1 / 0)
        # one destination block for its one block of prompt: the transfer opens at the forward's first layer
        p.role.handle(P.Prefill("bad", prompt, P.Sampling(temperature=0.5), "d", d.role.kv_address, [0], 5.0))
        assert p.role.queue_depth() == 1
        pump([p], lambda: p.sent, 5.0)
        [failed] = p.take(P.RequestFailed)
        assert failed.kind == "internal" and "request bad: sampling generated token 0 failed" in failed.error
        assert not p.engine.requests and p.engine.blocks.num_free == NUM_BLOCKS and p.role.queue_depth() == 0
    finally:
        p.role.close()
        d.role.close(), d.engine.kv.close()
