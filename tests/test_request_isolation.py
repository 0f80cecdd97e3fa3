"""One request cannot fail another: an error computing one request's token (its draw, NaN logits in
its row, its text) or a forward that raises fails only the requests it belongs to; the rest of
the batch makes the same tokens as without it, and every block comes back. Hostile sampling
parameters that used to raise (seed 2**50, temperature 1e-40) now just work."""

from __future__ import annotations

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import InvalidRequest, Request, SamplingParams

NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * salt) % 300 + 5 for i in range(n)]


def batch() -> list[Request]:
    """Greedy and seeded requests of several lengths: the ones that must be unaffected."""
    return [Request("g1", prompt(9, 1), GREEDY), Request("s1", prompt(30, 2), SEEDED),
            Request("g2", prompt(17, 3), GREEDY), Request("s2", prompt(4, 4), SEEDED)]


def run(engine: Engine, reqs: list[Request]) -> list:
    """Step to the end in one batch; every output, in order."""
    for r in reqs:
        engine.add_request(r)
    outs = []
    while not all(r.finished for r in reqs):
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def expected(engine) -> dict[str, list[int]]:
    reqs = batch()
    run(engine, reqs)
    return {r.request_id: r.output_ids for r in reqs}


def assert_rest_unaffected(engine, reqs, expected) -> None:
    for r in reqs:
        assert r.finish_reason == "length" and r.output_ids == expected[r.request_id], r.request_id
    assert not engine.requests and engine.blocks.num_free == NUM_BLOCKS


def test_a_draw_that_raises_fails_that_request_alone(engine, expected, monkeypatch):
    draw = engine.sampler._draw

    def flaky(rows, reqs):  # the batch's draw raises while the bad request is in it: redone row by row
        if any(r.request_id == "bad" and len(r.output_ids) == 2 for r in reqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return draw(rows, reqs)

    monkeypatch.setattr(engine.sampler, "_draw", flaky)
    reqs = batch()
    bad = Request("bad", prompt(12, 5), SEEDED)
    outs = run(engine, reqs + [bad])
    assert bad.finish_reason == "error" and len(bad.output_ids) == 2
    assert "request bad: sampling generated token 2 failed: RuntimeError: probability tensor" in bad.error
    [failed] = [o for o in outs if o.error is not None]
    assert failed.request_id == "bad" and failed.finished and failed.finish_reason == "error"
    assert_rest_unaffected(engine, reqs, expected)


def test_nan_logits_in_one_row_fail_that_request_alone(engine, expected, monkeypatch):
    forward = engine.runner.run

    def poisoned(work, on_layer=None, feed=None):
        logits = forward(work, on_layer, feed).clone()  # an inference tensor: poison a copy
        done = [r for r, _ in work if r.num_computed == r.num_tokens]
        for i, r in enumerate(done):
            if r.request_id == "bad" and len(r.output_ids) == 3:
                logits[i, 17] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "run", poisoned)
    reqs = batch()
    bad = Request("bad", prompt(12, 5), GREEDY)  # greedy: argmax alone would pick the NaN and go on
    run(engine, reqs + [bad])
    assert bad.finish_reason == "error" and "request bad: its logits are not finite" in bad.error
    assert len(bad.output_ids) == 3
    assert_rest_unaffected(engine, reqs, expected)


def test_a_detokenization_error_fails_that_request_alone(engine, expected, monkeypatch):
    detokenize = engine.text.detokenize

    def broken(req):
        if req.request_id == "bad" and len(req.output_ids) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return detokenize(req)

    monkeypatch.setattr(engine.text, "detokenize", broken)
    reqs = batch()
    bad = Request("bad", prompt(12, 5), SEEDED)
    run(engine, reqs + [bad])
    assert bad.finish_reason == "error" and "request bad: detokenizing generated token 3" in bad.error
    assert_rest_unaffected(engine, reqs, expected)


def test_a_forward_that_raises_fails_its_step_and_the_engine_goes_on(engine, expected, monkeypatch):
    forward = engine.runner.run
    calls = {"n": 0}

    def once(work, on_layer=None, feed=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(work, on_layer, feed)

    monkeypatch.setattr(engine.runner, "run", once)
    first = [Request("f1", prompt(9, 1), GREEDY), Request("f2", prompt(30, 2), SEEDED)]
    outs = run(engine, first)
    assert all(r.finish_reason == "error" and "OutOfMemoryError" in r.error for r in first)
    assert {o.request_id for o in outs if o.error} == {"f1", "f2"}
    reqs = batch()  # the engine is fine afterwards
    run(engine, reqs)
    assert_rest_unaffected(engine, reqs, expected)


def test_hostile_sampling_parameters_just_work(engine):
    p = prompt(12, 6)
    big_seed = SamplingParams(max_tokens=6, temperature=1.0, seed=2**50, ignore_eos=True)
    tiny_temperature = SamplingParams(max_tokens=6, temperature=1e-40, seed=3, ignore_eos=True)
    a = [Request("a", p, big_seed), Request("t", p, tiny_temperature), Request("g", p, GREEDY)]
    run(engine, a)
    again = Request("a2", p, big_seed)
    run(engine, [again])
    assert [r.finish_reason for r in a] == ["length"] * 3
    assert a[0].output_ids == again.output_ids  # the big seed is still a seed
    assert a[1].output_ids == a[2].output_ids[:6]  # 1e-40 samples the top token: greedy
    with pytest.raises(InvalidRequest, match=r"`seed` must be an integer in \[0, 9223372036854775807\]"):
        engine.add_request(Request("s", p, SamplingParams(seed=2**63)))
    assert not engine.requests and engine.blocks.num_free == NUM_BLOCKS


def test_prefill_only_with_a_failing_draw_frees_its_blocks_and_raises(engine, monkeypatch):
    from pdserve.workers.engine.sampler import SamplingError

    monkeypatch.setattr(engine.sampler, "_draw", lambda rows, reqs: 1 / 0)
    req = Request("p", prompt(20), SEEDED)
    with pytest.raises(SamplingError, match="request p: sampling generated token 0 failed: ZeroDivisionError"):
        engine.prefill_only(req)
    assert req.finish_reason == "error" and not engine.requests and engine.blocks.num_free == NUM_BLOCKS
