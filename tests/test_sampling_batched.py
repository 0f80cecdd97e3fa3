"""The batched sampler (sampler.py, sampling_device.py) against the per-request sampler it replaced,
kept here as the oracle (`old_processed`, `old_probs`, `old_draw`: its code, one request at a time):
for seeded requests the processed logits, the distribution drawn from and the token drawn are the
very same bits, whatever shares the batch; the logprobs are the same values."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.workers.engine.sampler import Sampler, logprobs_of
from pdserve.workers.engine.sampling_device import DrawParams, probabilities

VOCAB = 49152  # the tiny model's: long enough that a row's sum is split across threads on the CPU
EOS = [2]


# ---- the oracle: the per-request sampler before the batched one --------------------------------------

def old_counts(ids: list[int], dev: torch.device) -> torch.Tensor:
    out = torch.zeros(VOCAB + 1, device=dev)
    if ids:
        out.scatter_add_(0, torch.tensor(ids, device=dev), torch.ones(len(ids), device=dev))
    return out[:VOCAB]


def old_processed(row: torch.Tensor, r: Request) -> torch.Tensor:
    p, row, dev = r.params, row.clone(), row.device
    if p.logit_bias:
        row = row.index_put((torch.tensor(list(p.logit_bias), device=dev),),
                            torch.tensor(list(p.logit_bias.values()), device=dev), accumulate=True)
    if p.allowed_token_ids:
        keep = torch.zeros(VOCAB, dtype=torch.bool, device=dev)
        keep[torch.tensor(p.allowed_token_ids, device=dev)] = True
        row = row.masked_fill(~keep, float("-inf"))
    for w in p.bad_words_ids:
        if len(w) == 1 or r.output_ids[-(len(w) - 1):] == w[:-1]:
            row[w[-1]] = float("-inf")
    if len(r.output_ids) < p.min_tokens:
        row[torch.tensor(list(p.stop_token_ids) + ([] if p.ignore_eos else EOS), device=dev)] = float("-inf")
    if p.penalized:
        sub, counts = row[None], old_counts(r.output_ids, dev)[None]
        rep = torch.tensor([p.repetition_penalty], device=dev)[:, None]
        if (rep != 1.0).any():
            seen = ((old_counts(r.prompt_ids, dev)[None] > 0) | (counts > 0)) & (rep != 1.0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([p.frequency_penalty], device=dev)[:, None]
        presence = torch.tensor([p.presence_penalty], device=dev)[:, None]
        row = (sub - freq * counts - presence * (counts > 0).float())[0]
    return row


def old_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = (row.float() - row.max()) / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop = cum - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def old_draw(row: torch.Tensor, r: Request) -> int:
    gen = torch.Generator(device=row.device).manual_seed((r.params.seed * 1_000_003 + len(r.output_ids)) % 2**64)
    return int(torch.multinomial(old_probs(row, r.params), 1, generator=gen).item())


# ---- random requests ---------------------------------------------------------------------------------

def random_request(rng: random.Random, i: int, seeded: bool = True) -> Request:
    kw = dict(temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]), top_k=rng.choice([0, 0, 1, 20, 1000]),
              top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.97]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
              seed=rng.randrange(2**40) if seeded else None, max_tokens=64, logprobs=rng.choice([None, None, 0, 3]))
    if rng.random() < 0.3:
        kw.update(frequency_penalty=rng.choice([0.0, 0.7, -1.2]), presence_penalty=rng.choice([0.0, 1.5]),
                  repetition_penalty=rng.choice([1.0, 1.3, 0.8]))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-20, 20) for _ in range(3)}
    if rng.random() < 0.15:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), 50)
    if rng.random() < 0.2:
        kw.update(min_tokens=rng.randrange(1, 8), stop_token_ids=[rng.randrange(VOCAB)])
    out = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    if rng.random() < 0.3 and out:
        kw["bad_words_ids"] = [[out[-1], rng.randrange(VOCAB)], [rng.randrange(VOCAB)]]
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    return Request(f"q{i}", prompt, SamplingParams(**kw), output_ids=out)


def logits_for(rng: random.Random, n: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return (torch.randn(n, VOCAB, generator=g) * rng.choice([1.0, 3.0, 8.0])).to(dev)


# the same construction on CUDA (a tensor divided by a host scalar, a lone row's reductions): checked
# wherever a GPU is present
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(6))
def test_seeded_rows_draw_the_old_samplers_tokens_bit_for_bit_whatever_shares_the_batch(case, device):
    rng = random.Random(case)
    n = [1, 3, 8, 8, 16, 5][case]
    reqs = [random_request(rng, i, seeded=rng.random() < 0.8) for i in range(n)]
    dev = torch.device(device)
    logits = logits_for(rng, n, dev)
    s = Sampler(dev, eos_token_ids=EOS)
    processed, failed = s.process(logits, reqs)
    assert not failed
    drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
    seeded = [j for j, i in enumerate(drawn) if reqs[i].params.seed is not None]
    probs = probabilities(processed[drawn], DrawParams.of([reqs[i].params for i in drawn]), seeded)
    results = s.results(s.pick(logits, reqs), reqs)
    for i, r in enumerate(reqs):
        want_row = old_processed(logits[i], r)
        assert torch.equal(processed[i], want_row), r.params
        token, lps = results[i]
        if r.params.greedy:
            assert token == int(want_row.argmax())
        elif r.params.seed is not None:
            assert torch.equal(probs[drawn.index(i)], old_probs(want_row, r.params)), r.params
            assert token == old_draw(want_row, r), r.params
            alone = Request(r.request_id, r.prompt_ids, r.params, output_ids=list(r.output_ids))
            assert s.sample(logits[i:i + 1], [alone]) == [token]  # the same token alone in its batch
        if r.params.logprobs is None:
            assert lps is None
        else:
            [want] = logprobs_of(logits[i:i + 1], torch.tensor([token], device=dev), r.params.logprobs)
            assert lps == want


def test_a_batched_sum_is_not_a_rows_sum_so_seeded_rows_take_their_own():
    """Why seeded rows' reductions are taken alone: over [s, vocab] a row's sum may differ in its last
    bits from the same row's sum alone (the CPU splits a long row across threads): if this stops
    holding, the per-row reductions are only a cost."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the CPU takes every sum the same way")
    x = torch.softmax(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    assert any(not torch.equal(x.sum(-1)[i], x[i].sum()) for i in range(8))


def test_the_counts_grow_on_the_device_by_each_picked_token():
    s = Sampler(torch.device("cpu"))
    r = Request("c", [1, 2, 3], SamplingParams(max_tokens=8, frequency_penalty=1.0), output_ids=[4, 4])
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 5.0
    [token] = s.sample(logits, [r])
    assert token == 9
    counts = r.sampler_state.counts
    assert counts[4] == 2 and counts[9] == 1 and counts.sum() == 3  # the token just chosen, before it is appended
    r.output_ids.append(token)
    processed, _ = s.process(logits, [r])
    assert processed[0, 9] == 5.0 - 1.0 and processed[0, 4] == -2.0


def test_a_bad_words_last_token_still_on_the_device_is_compared_there():
    """A two-token bad word [a, b] whose a is the token still on the device (PENDING on the host):
    b is banned only where that token is a."""
    from types import SimpleNamespace

    from pdserve.workers.engine.request import PENDING

    s = Sampler(torch.device("cpu"))
    logits = torch.zeros(2, VOCAB)
    logits[:, 77] = 9.0
    reqs = [Request(f"b{i}", [1, 2], SamplingParams(max_tokens=8, bad_words_ids=[[5, 77]]), output_ids=[3, PENDING])
            for i in range(2)]
    prev = SimpleNamespace(tokens=torch.tensor([6, 5]), index={id(reqs[0]): 1, id(reqs[1]): 0})
    picked = s.pick(logits, reqs, prev)
    tokens = [t for t, _ in s.results(picked, reqs)]
    assert tokens[0] != 77 and tokens[1] == 77  # r0's last token is 5: banned; r1's is 6: not
    with_known = Request("k", [1, 2], SamplingParams(max_tokens=8, bad_words_ids=[[5, 77]]), output_ids=[3, 5])
    assert s.sample(logits[:1], [with_known]) != [77]


def test_an_id_outside_the_vocabulary_fails_that_request_alone():
    s = Sampler(torch.device("cpu"))
    bad = Request("bad", [1], SamplingParams(max_tokens=4, logit_bias={VOCAB + 3: 1.0}))
    good = Request("good", [1], SamplingParams(max_tokens=4, logit_bias={7: 50.0}))
    out = s.sample(torch.zeros(2, VOCAB), [bad, good])
    assert "request bad: applying its penalties or min_tokens failed" in str(out[0])
    assert f"logit_bias [{VOCAB + 3}] outside the vocabulary" in str(out[0])
    assert out[1] == 7


def test_draw_params_are_built_without_a_list_per_row():
    ps = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1), SamplingParams(temperature=1.0)]
    p = DrawParams.of(ps)
    assert p.temperature.dtype == np.float32 and list(p.top_k) == [3, 0] and p.top_p[1] == 1.0
