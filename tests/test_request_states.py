"""A request's state ladder (workers/engine/request.py): every move from every state, then the
engine walking each role's path on a tiny model, illegal calls refused with nothing changed, and
every block back at the end."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.workers.engine.request import MOVES, IllegalTransition, Request, SamplingParams, Status


def in_state(status: Status) -> Request:
    req = Request("r1", [1, 2, 3])
    req.status = status  # a test may place it anywhere; code moves it only through the methods
    return req


@pytest.mark.parametrize("move", sorted(MOVES))
@pytest.mark.parametrize("start", list(Status), ids=lambda s: s.value)
def test_every_move_from_every_state(move, start):
    target, sources = MOVES[move]
    req = in_state(start)
    call = getattr(req, move)
    args = ("abort",) if move == "finish" else ()
    if start in sources:
        call(*args)
        assert req.status is target
    else:
        with pytest.raises(IllegalTransition) as e:
            call(*args)
        assert req.status is start  # refused: nothing moved
        text = str(e.value)
        assert "request r1" in text and start.value in text and move.replace("_", " ") in text, text


def test_each_roles_path_is_a_walk_of_legal_moves():
    paths = {
        "colocated": ["start_prefill", "start_running", "preempt", "start_prefill", "start_running", "finish"],
        "prefill": ["start_prefill", "start_sending", "release"],
        "decode": ["reserve", "start_receiving", "start_running", "finish"],
        "decode, KV landed unseen": ["reserve", "start_running", "finish"],
        "decode, aborted in flight": ["reserve", "start_receiving", "cancel", "release"],
        "decode, transfer failed": ["reserve", "start_receiving", "finish"],
    }
    for name, path in paths.items():
        req = Request("r", [1])
        for move in path:
            getattr(req, move)(*(("stop",) if move == "finish" else ()))
        assert req.finished, name
    sent = Request("p", [1])
    for move in ("start_prefill", "start_sending", "release"):
        getattr(sent, move)()
    assert sent.finish_reason == "sent"
    failed = Request("f", [1])
    failed.finish("error", "request f: its logits are not finite")
    assert (failed.finish_reason, failed.error) == ("error", "request f: its logits are not finite")


def test_cancelling_only_ends_by_release():
    req = in_state(Status.CANCELLING)
    with pytest.raises(IllegalTransition, match="cannot finish while cancelling"):
        req.finish("abort")
    req.release()
    assert req.finished and req.finish_reason == "abort"


def test_request_module_does_not_need_torch():
    code = "import sys; import pdserve.workers.engine.request; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the engine walks the ladder ------------------------------------------------------------------

NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def engine():
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine

    return Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, chunk_tokens=8))


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 200 + 10 for i in range(n)]


def assert_clean(engine) -> None:
    assert not engine.requests and engine.blocks.num_free == NUM_BLOCKS
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_colocated_walk(engine):
    req = Request("c", prompt(20), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(req)
    assert req.status is Status.WAITING and engine.requests["c"] is req
    seen = []
    while not req.finished:
        engine.step()
        seen.append(req.status)
    # 20 prompt tokens in chunks of 8: two steps part way, token 1 on the third, then two decodes
    assert seen == [Status.PREFILLING, Status.PREFILLING, Status.RUNNING, Status.RUNNING, Status.FINISHED]
    assert req.finish_reason == "length" and len(req.output_ids) == 3
    assert engine.stats()["running"] == 0
    assert_clean(engine)


def test_preempted_request_is_recomputed_to_the_same_tokens():
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = Engine(EngineConfig(model="tiny", num_blocks=16))
    alone = [roomy.generate([prompt(20)], params)[0].output_ids, roomy.generate([prompt(21)], params)[0].output_ids]
    tight = Engine(EngineConfig(model="tiny", num_blocks=4))  # 2 x 2 blocks: the third block forces a preemption
    reqs = [Request("a", prompt(20), params), Request("b", prompt(21), params)]
    for r in reqs:
        tight.add_request(r)
    states = set()
    while not all(r.finished for r in reqs):
        tight.step()
        states |= {r.status for r in reqs}
    assert Status.PREEMPTED in states
    assert [r.output_ids for r in reqs] == alone
    assert not tight.requests and tight.blocks.num_free == 4


def test_prefill_walk_and_illegal_calls(engine):
    req = Request("p", prompt(20), SamplingParams(max_tokens=4))
    result = engine.prefill_only(req)
    assert req.status is Status.SENDING and engine.requests["p"] is req
    assert engine.blocks.num_free == NUM_BLOCKS - len(result.block_ids)  # held for the transfer
    with pytest.raises(IllegalTransition, match="cannot start prefill while sending"):
        engine.prefill_only(req)
    with pytest.raises(IllegalTransition, match="cannot cancel while sending"):
        engine.cancel("p")
    assert req.status is Status.SENDING and len(req.block_ids) == len(result.block_ids)
    engine.release("p")
    assert req.finished and req.finish_reason == "sent"
    engine.release("p")  # an id no longer here: nothing to do
    with pytest.raises(IllegalTransition, match="is finished; admit a new Request"):
        engine.prefill_only(req)
    assert_clean(engine)


def test_decode_walk_and_illegal_calls(engine):
    req = Request("d", prompt(20), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.admit(req)
    assert req.status is Status.WAITING and not engine.has_work()  # waits for room, not for the scheduler
    with pytest.raises(IllegalTransition, match="cannot start running while waiting"):
        engine.adopt(req, first_token=5)
    with pytest.raises(IllegalTransition, match="cannot start receiving while waiting"):
        engine.begin_receiving("d")
    blocks = engine.reserve("d", 20)
    assert req.status is Status.RESERVED and req.block_ids == blocks and len(blocks) == 2
    with pytest.raises(IllegalTransition, match="cannot reserve while reserved"):
        engine.reserve("d", 20)
    engine.begin_receiving("d")
    assert req.status is Status.RECEIVING
    out = engine.adopt(req, first_token=5)
    assert req.status is Status.RUNNING and out.token_id == 5 and engine.has_work()
    with pytest.raises(IllegalTransition, match="cannot release while running"):
        engine.release("d")  # a running request's blocks are the scheduler's, not a transfer's
    with pytest.raises(IllegalTransition, match="cannot cancel while running"):
        engine.cancel("d")
    with pytest.raises(IllegalTransition, match="not on this worker"):
        engine.begin_receiving("nobody")
    assert req.status is Status.RUNNING and req.block_ids == blocks
    engine.run_until_done([req])
    assert req.finish_reason == "length" and len(req.output_ids) == 3
    assert_clean(engine)


def test_decode_abort_in_flight_holds_blocks_until_release(engine):
    req = Request("x", prompt(40), SamplingParams(max_tokens=3))
    engine.admit(req)
    blocks = engine.reserve("x", 40)
    engine.begin_receiving("x")
    engine.cancel("x")
    assert req.status is Status.CANCELLING
    with pytest.raises(IllegalTransition, match="cannot finish while cancelling"):
        engine.abort("x")  # a late write could still land in its blocks
    with pytest.raises(IllegalTransition, match="cannot finish while cancelling"):
        engine.fail("x", "no")
    assert engine.blocks.num_free == NUM_BLOCKS - len(blocks) and engine.requests["x"] is req
    engine.release("x")
    assert req.finished and req.finish_reason == "abort"
    assert_clean(engine)


def test_waiting_reservation_with_no_room_stays_waiting(engine):
    big = Request("big", prompt(16 * (NUM_BLOCKS - 1)), SamplingParams(max_tokens=1))
    small = Request("small", prompt(40), SamplingParams(max_tokens=1))
    engine.admit(big)
    engine.admit(small)
    assert engine.reserve("big", len(big.prompt_ids)) is not None
    assert engine.reserve("small", 40) is None and small.status is Status.WAITING and not small.block_ids
    assert [r.request_id for r in engine.in_state(Status.WAITING)] == ["small"]
    engine.abort("big")
    assert engine.reserve("small", 40) is not None and small.status is Status.RESERVED
    engine.release("small")  # the transfer will not come
    assert small.finish_reason == "abort"
    assert_clean(engine)
