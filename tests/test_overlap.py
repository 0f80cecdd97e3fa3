"""Overlapped steps (workers/engine/overlap.py) on the CPU: the same forwards as synchronous steps,
so the same tokens by construction (each step's arithmetic is identical; only when the host reads
the tokens back moves), the same finish reasons, and no block given back while a step in flight
may still write into it."""

from __future__ import annotations

import pytest

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.overlap import PENDING
from pdserve.workers.engine.request import Request, SamplingParams, Status


def engine(overlap: bool, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=96, chunk_tokens=8, overlap=overlap, **kw))


def workload(stop_token: int | None) -> list[Request]:
    lengths = [5, 16, 23, 1, 40, 9]
    reqs = []
    for i, n in enumerate(lengths):
        params = SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True,
                                stop_token_ids=[stop_token] if stop_token is not None and i % 2 else [])
        reqs.append(Request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(n)], params))
    return reqs


def run(e: Engine, reqs: list[Request], abort_at: int | None = None) -> dict[str, tuple]:
    streamed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        e.add_request(r)
    steps = 0
    while e.has_work():
        for out in e.step():
            assert out.token_id != PENDING
            if out.token_id >= 0:
                streamed[out.request_id].append(out.token_id)
        steps += 1
        if steps == abort_at:
            e.abort("r4")
    assert e.blocks.num_free == e.blocks.num_blocks  # every block back, none twice
    return {r.request_id: (r.output_ids, r.finish_reason, streamed[r.request_id]) for r in reqs}


@pytest.mark.parametrize("chunked", [True, False])
def test_overlapped_steps_give_the_synchronous_tokens(chunked):
    plain = run(engine(False, chunked_prefill=chunked), workload(None))
    # a stop token that some requests meet part way (taken from the plain run's own output)
    stop = plain["r1"][0][2]
    want = run(engine(False, chunked_prefill=chunked), workload(stop))
    got = run(engine(True, chunked_prefill=chunked), workload(stop))
    assert got == want
    assert any(reason == "stop" for _, reason, _ in want.values())  # the stop path ran
    for ids, _, streamed in got.values():
        assert streamed == ids and PENDING not in ids


def test_an_abort_between_overlapped_steps_frees_its_blocks_after_the_step_in_flight():
    e = engine(True)
    reqs = workload(None)
    for r in reqs:
        e.add_request(r)
    while not reqs[4].output_ids or reqs[4].status is not Status.RUNNING:
        e.step()
    assert e._inflight is not None and id(reqs[4]) in e._inflight.members
    free_before = e.blocks.num_free
    held = len(reqs[4].block_ids)
    e.abort("r4")
    assert reqs[4].finished and PENDING not in reqs[4].output_ids
    assert e.blocks.num_free == free_before  # the step in flight may still write into them
    e.step()  # reads that step back
    assert e.blocks.num_free >= free_before + held - len(e.scheduler.running)  # now they are free (some re-used)
    while e.has_work():
        e.step()
    assert e.blocks.num_free == e.blocks.num_blocks


def test_overlap_stops_for_a_request_that_needs_its_logits():
    e = engine(True)
    a = Request("plain", list(range(3, 20)), SamplingParams(max_tokens=6, ignore_eos=True))
    b = Request("logprobs", list(range(5, 30)), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    got = run(e, [a, b])
    ref = run(engine(False), [Request("plain", list(range(3, 20)), SamplingParams(max_tokens=6, ignore_eos=True)),
                              Request("logprobs", list(range(5, 30)), SamplingParams(max_tokens=6, ignore_eos=True,
                                                                                     logprobs=2))])
    assert got == ref
