"""The sampling surface beyond temperature/top-k/top-p: presence, frequency and repetition penalties,
min_tokens, stop_token_ids; each per request in a batch (one request's parameters never change or
fail another's), the common case (no penalties) untouched and at no extra cost."""

from __future__ import annotations

import pytest
import torch

from test_request_isolation import GREEDY, NUM_BLOCKS, assert_rest_unaffected, batch, prompt, run
from pdserve.workers.engine import sampler as sampler_module
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import InvalidRequest, Request, SamplingParams
from pdserve.workers.engine.sampler import Sampler

VOCAB = 8


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))


@pytest.fixture(scope="module")
def expected(engine) -> dict[str, list[int]]:
    reqs = batch()
    run(engine, reqs)
    return {r.request_id: r.output_ids for r in reqs}


def fake(prompt_ids, output_ids, **params) -> Request:
    return Request("f", list(prompt_ids), SamplingParams(max_tokens=16, **params), output_ids=list(output_ids))


def test_no_penalty_rows_are_not_touched_or_copied():
    s = Sampler(torch.device("cpu"), eos_token_ids=[0])
    logits = torch.randn(3, VOCAB)
    reqs = [fake([1, 2], [3]), fake([4], []), fake([5], [5, 5], min_tokens=2)]  # min_tokens reached
    out, failed = s.process(logits, reqs)
    assert out is logits and not failed  # the common case: the very same tensor, nothing built


def test_penalties_follow_openai_and_vllm_semantics():
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 3.0, 0.0, 1.5]] * 4)
    reqs = [fake([1], [2, 2, 3], frequency_penalty=0.5),  # output counts: 2 twice, 3 once
            fake([1], [2, 2, 3], presence_penalty=1.5),
            fake([1, 4], [2], repetition_penalty=2.0),  # the prompt's tokens too (1 and 4), and output's (2)
            fake([1], [2, 2, 3])]  # no penalty: unchanged
    out, _ = s.process(logits.clone(), reqs)
    want = logits.clone()
    want[0, 2] -= 0.5 * 2
    want[0, 3] -= 0.5 * 1
    want[1, 2] -= 1.5
    want[1, 3] -= 1.5
    want[2, 1] = -1.0 * 2.0  # negative logit: multiplied
    want[2, 4] = -0.5 * 2.0
    want[2, 2] = 2.0 / 2.0  # positive logit: divided
    assert torch.equal(out, want)


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    s = Sampler(torch.device("cpu"), eos_token_ids=[5])
    logits = torch.zeros(3, VOCAB)
    reqs = [fake([1], [2], min_tokens=3, stop_token_ids=[6]),
            fake([1], [2], min_tokens=3, stop_token_ids=[6], ignore_eos=True),  # EOS does not stop: not masked
            fake([1], [2, 3, 4], min_tokens=3, stop_token_ids=[6])]  # reached
    out, _ = s.process(logits, reqs)
    inf = float("-inf")
    assert out[0, 5] == inf and out[0, 6] == inf and out[0, :5].eq(0).all()
    assert out[1, 5] == 0 and out[1, 6] == inf
    assert out[2].eq(0).all()


def test_stop_token_ids_stop_and_min_tokens_hold_them_off(engine):
    p = prompt(20, 7)
    [plain] = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))
    third = plain.output_ids[2]
    [stopped] = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[third]))
    assert stopped.output_ids == plain.output_ids[:3] and stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(plain.output_ids[:3])  # the stop token's text stays (not special)
    [held] = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[third],
                                                 min_tokens=6))
    assert third not in held.output_ids[:5] and len(held.output_ids) >= 6
    assert held.output_ids[:2] == plain.output_ids[:2]  # identical until the masked step


def test_min_tokens_holds_off_eos(engine, monkeypatch):
    p = prompt(20, 8)
    [plain] = engine.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))
    eos = plain.output_ids[1]  # pretend the model's second token is its end of sequence
    monkeypatch.setattr(engine.text, "eos_token_ids", {eos})
    monkeypatch.setattr(engine.sampler, "eos_token_ids", [eos])
    [ends] = engine.generate([p], SamplingParams(max_tokens=8))
    assert ends.output_ids == plain.output_ids[:2] and ends.finish_reason == "stop"
    [held] = engine.generate([p], SamplingParams(max_tokens=8, min_tokens=5))
    assert eos not in held.output_ids[:5] and len(held.output_ids) >= 5


def test_frequency_penalty_changes_a_repeating_greedy_run(engine):
    p = prompt(6, 9)
    [plain] = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True))
    [pen] = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=2.0,
                                                presence_penalty=2.0))
    first_repeat = next(i for i, t in enumerate(plain.output_ids) if t in plain.output_ids[:i])
    assert pen.output_ids[:first_repeat] == plain.output_ids[:first_repeat]  # nothing to penalize yet
    assert pen.output_ids != plain.output_ids
    assert len(set(pen.output_ids)) > len(set(plain.output_ids))


def test_penalized_requests_do_not_change_the_rest_of_the_batch(engine, expected):
    reqs = batch()
    extra = [Request("rep", prompt(11, 5), SamplingParams(max_tokens=8, repetition_penalty=1.7, ignore_eos=True)),
             Request("freq", prompt(25, 6), SamplingParams(max_tokens=8, frequency_penalty=-2.0, presence_penalty=2.0,
                                                           temperature=0.8, seed=5, ignore_eos=True)),
             Request("min", prompt(7, 7), SamplingParams(max_tokens=8, min_tokens=8, stop_token_ids=[3, 4])),
             Request("lp", prompt(13, 8), SamplingParams(max_tokens=8, logprobs=20, prompt_logprobs=5,
                                                         ignore_eos=True))]
    run(engine, reqs + extra)
    assert [r.finish_reason for r in extra] == ["length"] * 4
    assert_rest_unaffected(engine, reqs, expected)
    alone = Request("freq2", prompt(25, 6), extra[1].params)  # and a penalized one is itself whatever shares its batch
    run(engine, [alone])
    assert alone.output_ids == extra[1].output_ids


def test_processing_that_fails_for_one_row_fails_that_request_alone(engine, expected, monkeypatch):
    bad_prompt = prompt(12, 5)
    counts = sampler_module.token_counts

    def broken(ids, vocab, device):
        if bad_prompt in ids:
            raise RuntimeError("injected")
        return counts(ids, vocab, device)

    monkeypatch.setattr(sampler_module, "token_counts", broken)
    reqs = batch()
    bad = Request("bad", bad_prompt, SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True))
    good = Request("good", prompt(9, 4), SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True))
    run(engine, reqs + [bad, good])
    assert bad.finish_reason == "error" and "request bad: applying its penalties or min_tokens failed" in bad.error
    assert good.finish_reason == "length"
    assert_rest_unaffected(engine, reqs, expected)
    monkeypatch.setattr(sampler_module, "token_counts", counts)
    again = Request("good2", prompt(9, 4), good.params)
    run(engine, [again])
    assert again.output_ids == good.output_ids


@pytest.mark.parametrize("params,words", [
    (dict(presence_penalty=2.5), "`presence_penalty` must be a number in"),
    (dict(frequency_penalty=-3.0), "`frequency_penalty` must be a number in"),
    (dict(repetition_penalty=0.0), "`repetition_penalty` must be a number in"),
    (dict(min_tokens=17), "`min_tokens`.*must not exceed `max_tokens`"),
    (dict(logprobs=21), "`logprobs` must be an integer in [0, 20]"),
    (dict(temperature=2.5), "`temperature` must be a number in"),
    (dict(stop_token_ids=[10**7]), "stop_token_ids [10000000] outside the vocabulary"),
])
def test_out_of_range_parameters_are_refused_naming_them(engine, params, words):
    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request(Request("x", prompt(5), SamplingParams(max_tokens=16, **params)))
    assert not engine.requests


def test_greedy_default_is_unchanged(engine, expected):
    reqs = batch()
    run(engine, reqs)
    assert_rest_unaffected(engine, reqs, expected)
    assert GREEDY.penalized is False


def test_logprobs_that_fail_for_one_row_fail_that_request_alone(engine, expected, monkeypatch):
    gather = sampler_module.gather_logprobs

    def broken(logits, targets, k):
        if k == 7:  # only the bad request asks for 7 (its batch's k while it is in it: redone row by row)
            raise RuntimeError("injected")
        return gather(logits, targets, k)

    monkeypatch.setattr(sampler_module, "gather_logprobs", broken)
    reqs = batch()
    bad = Request("bad", prompt(12, 5), SamplingParams(max_tokens=8, logprobs=7, ignore_eos=True))
    good = Request("good", prompt(9, 4), SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True))
    outs = run(engine, reqs + [bad, good])
    assert bad.finish_reason == "error" and "request bad: the logprobs of generated token 0 failed" in bad.error
    assert good.finish_reason == "length"
    assert all(o.logprobs is not None and len(o.logprobs.top_ids) == 2 for o in outs if o.request_id == "good")
    assert_rest_unaffected(engine, reqs, expected)


def test_prompt_logprobs_that_fail_fail_that_request_alone(engine, expected, monkeypatch):
    compute = engine.runner._prompt_logprobs

    def broken(hidden, req, rows, k):
        if req.request_id == "bad":
            raise RuntimeError("injected")
        return compute(hidden, req, rows, k)

    monkeypatch.setattr(engine.runner, "_prompt_logprobs", broken)
    reqs = batch()
    bad = Request("bad", prompt(12, 5), SamplingParams(max_tokens=8, prompt_logprobs=1, ignore_eos=True))
    good = Request("good", prompt(9, 4), SamplingParams(max_tokens=8, prompt_logprobs=1, ignore_eos=True))
    run(engine, reqs + [bad, good])
    assert bad.finish_reason == "error" and "0 of its 11 prompt logprobs were computed" in bad.error
    assert good.finish_reason == "length" and len(good.prompt_logprobs) == 8
    assert_rest_unaffected(engine, reqs, expected)
