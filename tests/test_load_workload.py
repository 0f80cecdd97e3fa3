"""Load generator inputs: length distributions, prompt text, datasets, arrivals, policy interleaving."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.vllm_compat import resolve
from pdserve.bench.load.session import LoadPoint, make_samples, plan, warmup_batch
from pdserve.bench.load.workload import (LengthDist, PromptBuilder, WorkloadError, arrival_times, assign_policies,
                                    load_tokenizer, long_count, mooncake_samples, sharegpt_samples, synthetic_samples)


def test_length_specs():
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128 and str(LengthDist.parse("fixed:64")) == "fixed:64"
    u = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    n = np.array([LengthDist.parse("normal:500:50").sample(rng) for _ in range(5000)])
    assert abs(n.mean() - 500) < 5 and abs(n.std() - 50) < 4
    assert min(LengthDist.parse("normal:2:10").sample(rng) for _ in range(200)) == 1  # clamped
    for bad in ("", "uniform:20:10", "normal:5", "poisson:4", "fixed:0", "abc"):
        with pytest.raises(WorkloadError):
            LengthDist.parse(bad)


def test_synthetic_mix_and_copies():
    b = PromptBuilder()
    samples = synthetic_samples(400, LengthDist.parse("uniform:10:50"), LengthDist.parse("8"), b, seed=3,
                                long_fraction=0.25, long_input_len=LengthDist.parse("uniform:900:1000"), copies=2)
    assert len(samples) == 800
    for a, c in zip(samples[::2], samples[1::2]):  # a pair: same lengths, different text
        assert (a.prompt_len, a.output_len, a.kind) == (c.prompt_len, c.output_len, c.kind)
        assert a.prompt != c.prompt
    for s in samples:
        assert len(s.prompt.split()) == s.prompt_len and s.output_len == 8
        assert (900 <= s.prompt_len <= 1000) == (s.kind == "long")
    assert sum(s.kind == "long" for s in samples[::2]) == 100  # exactly the stated 25%
    again = synthetic_samples(400, LengthDist.parse("uniform:10:50"), LengthDist.parse("8"), b, seed=3,
                              text_seed=99, long_fraction=0.25, long_input_len=LengthDist.parse("uniform:900:1000"),
                              copies=2)
    assert [s.prompt_len for s in again] == [s.prompt_len for s in samples]  # lengths from seed, text from text_seed
    assert again[0].prompt != samples[0].prompt


def test_long_fraction_is_exact_for_small_runs():
    b = PromptBuilder()
    short, long_ = LengthDist.parse("uniform:10:50"), LengthDist.parse("uniform:900:1000")
    # 24 prompts at 25%, seed 0: a coin per prompt gave 3 long ones (12.5%); the stated share is 6
    samples = synthetic_samples(24, short, LengthDist.parse("4"), b, seed=0, long_fraction=0.25, long_input_len=long_)
    assert sum(s.kind == "long" for s in samples) == 6
    for n, fraction, want in ((10, 0.25, 3), (7, 0.5, 4), (5, 0.0, 0), (8, 1.0, 8), (30, 0.1, 3)):
        assert long_count(n, fraction) == want
        for seed in range(5):
            kinds = [s.kind for s in synthetic_samples(n, short, LengthDist.parse("4"), b, seed=seed,
                                                       long_fraction=fraction, long_input_len=long_)]
            assert kinds.count("long") == want
    # the long prompts sit at seeded positions, not always the first ones
    positions = {tuple(i for i, s in enumerate(synthetic_samples(12, short, LengthDist.parse("4"), b, seed=seed,
                                                                 long_fraction=0.25, long_input_len=long_))
                       if s.kind == "long") for seed in range(6)}
    assert len(positions) > 1


def test_prompt_lengths_are_exact_with_the_model_tokenizer():
    tok = load_tokenizer("tiny")
    b = PromptBuilder(tok)
    assert b.exact and len(b.vocab) >= 20
    for s in synthetic_samples(5, LengthDist.parse("uniform:1:3000"), LengthDist.parse("4"), b, seed=1):
        assert len(tok.encode(s.prompt, add_special_tokens=False)) == s.prompt_len
    with pytest.raises(WorkloadError, match="unknown tokenizer"):
        load_tokenizer("no-such-model")


def test_arrivals_poisson_and_gamma_statistics():
    t = arrival_times(20000, rate=10.0, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_times(20000, rate=10.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)  # same mean rate
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.06)  # gamma: CV 1/sqrt(shape)
    smooth = np.diff(arrival_times(20000, rate=10.0, burstiness=4.0, seed=1))
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)
    assert np.array_equal(arrival_times(50, 3.0, seed=7), arrival_times(50, 3.0, seed=7))
    assert not np.array_equal(arrival_times(50, 3.0, seed=7), arrival_times(50, 3.0, seed=8))
    assert np.all(arrival_times(5, float("inf")) == 0)
    with pytest.raises(WorkloadError):
        arrival_times(5, 0.0)


def test_policies_interleave_i_mod_n():
    assert assign_policies(5, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    assert assign_policies(4, ["x", "y", "z"]) == ["x", "y", "z", "x"]
    assert assign_policies(2, None) == [None, None]


def _args(**over):
    p = argparse.ArgumentParser()
    generator.add_arguments(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    resolve(args, environ={})  # the defaults the vLLM spellings leave open
    return args


def test_plan_pairs_prompts_across_policies_on_one_schedule():
    args = _args(policies=["colocated", "disaggregated"], num_prompts=50, input_len="uniform:5:500", seed=4)
    samples = make_samples(args, PromptBuilder(), copies=2, text_seed=1)
    planned = plan(samples, args.policies, LoadPoint("rate", 5.0), args)
    assert [p.index for p in planned] == list(range(100))
    assert [p.policy for p in planned] == ["colocated", "disaggregated"] * 50
    colo = [p.sample.prompt_len for p in planned if p.policy == "colocated"]
    disagg = [p.sample.prompt_len for p in planned if p.policy == "disaggregated"]
    assert colo == disagg  # the same lengths for both policies
    times = [p.send_at_s for p in planned]
    assert times == sorted(times) and np.allclose(times, arrival_times(100, 5.0, 1.0, seed=4))
    # every rate draws from the same seed: the schedule at 10/s is the one at 5/s in half the time
    faster = [p.send_at_s for p in plan(samples, args.policies, LoadPoint("rate", 10.0), args)]
    assert np.allclose(np.array(faster) * 2, times)


def test_warmup_batch_spans_the_lengths():
    args = _args(num_prompts=40, input_len="uniform:10:50", long_fraction=0.25, long_input_len="uniform:900:1000")
    samples = make_samples(args, PromptBuilder(), copies=1, text_seed=1)
    batch = warmup_batch(samples, 4)
    lens = sorted(s.prompt_len for s in samples)
    assert [s.prompt_len for s in batch] == [lens[0], lens[13], lens[26], lens[39]]
    assert batch[-1].kind == "long" and batch[0].kind == "short"
    assert len(warmup_batch(samples[:2], 4)) == 2


def test_load_points_validation():
    assert [p.label for p in generator.load_points(_args())] == ["rate inf"]
    assert [p.label for p in generator.load_points(_args(request_rates=[1.0, 2.5]))] == ["rate 1/s", "rate 2.5/s"]
    assert [p.label for p in generator.load_points(_args(concurrency=[4.0]))] == ["concurrency 4"]
    assert [p.kind for p in generator.load_points(_args(dataset="mooncake"))] == ["trace"]
    for bad in (dict(concurrency=[2.0], request_rate=1.0), dict(concurrency=[1.5]), dict(request_rates=[0.0]),
                dict(dataset="mooncake", request_rate=2.0)):
        with pytest.raises(ValueError):
            generator.load_points(_args(**bad))


# ---- ShareGPT and Mooncake files -----------------------------------------------------------


def _conv(human, gpt):
    return {"id": human[:5], "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_loader(tmp_path):
    path = tmp_path / "sharegpt.json"
    data = [_conv(f"question number {i} " * 10, "an answer of some length " * 8) for i in range(6)]
    data += [{"id": "short", "conversations": [{"from": "human", "value": "only one turn"}]},
             _conv("   ", "reply to nothing at all"), _conv("hi there", "ok"), {"no": "conversations"}]
    path.write_text(json.dumps(data))
    b = PromptBuilder()
    samples = sharegpt_samples(path, 6, b, seed=0)
    assert len(samples) == 6 and {s.prompt for s in samples} == {d["conversations"][0]["value"] for d in data[:6]}
    s = samples[0]
    assert s.prompt_len == round(len(s.prompt) / 4) and s.output_len == round(len("an answer of some length " * 8) / 4)
    paired = sharegpt_samples(path, 3, b, seed=0, output_len=16, copies=2)
    assert len(paired) == 6 and paired[0] == paired[1] and all(p.output_len == 16 for p in paired)
    with pytest.raises(WorkloadError, match="only 6 usable"):
        sharegpt_samples(path, 7, b, seed=0)
    with pytest.raises(WorkloadError, match="only 0 usable"):
        sharegpt_samples(path, 1, b, seed=0, max_len=10)
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(WorkloadError, match="not JSON"):
        sharegpt_samples(tmp_path / "bad.json", 1, b, seed=0)
    with pytest.raises(WorkloadError, match="cannot read"):
        sharegpt_samples(tmp_path / "missing.json", 1, b, seed=0)


def test_mooncake_loader_replays_timestamps_and_shared_prefixes(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 20, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 25, "output_length": 7, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 3000, "input_length": 30, "output_length": 0, "hash_ids": []},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    b = PromptBuilder()
    samples = mooncake_samples(path, b, block_size=8, speedup=2.0)
    assert [s.arrival_s for s in samples] == [0.0, 0.25, 1.0]
    assert [s.prompt_len for s in samples] == [20, 25, 30]
    assert [len(s.prompt.split()) for s in samples] == [20, 25, 30]
    assert [s.output_len for s in samples] == [5, 7, 1]
    w0, w1 = samples[0].prompt.split(), samples[1].prompt.split()
    assert w0[:16] == w1[:16]  # hash ids 1, 2 shared: the same 16 words
    assert w0[16:20] != w1[16:20]  # block 3 vs block 4
    assert len(mooncake_samples(path, b, n=2)) == 2
    # another run's (or invocation's) text seed: the same sharing, other words, so no earlier run's cache serves it
    other = mooncake_samples(path, b, block_size=8, speedup=2.0, seed=1)
    assert other[0].prompt.split()[:16] == other[1].prompt.split()[:16] and other[0].prompt != samples[0].prompt
    (tmp_path / "bad.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 3}) + "\n")
    with pytest.raises(WorkloadError, match="output_length"):
        mooncake_samples(tmp_path / "bad.jsonl", b)
