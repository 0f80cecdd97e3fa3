"""allowed_token_ids on the worker: the mask is built once per request and kept with it, so a step costs
the same whatever the list's length, and a request with a vocabulary-sized list beside another does
not slow that other one down (it was rebuilt from Python ints every step: 600k ids with n=16 made a
neighbour 74x slower)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.workers.engine.sampler import Sampler

VOCAB = 49152


def counting_tensor(monkeypatch) -> list[int]:
    """Patch torch.tensor to count the Python values it converts (lists of ints, nested); returns the
    list whose sum is that count."""
    seen: list[int] = []
    real = torch.tensor

    def size(data) -> int:
        return sum(size(x) for x in data) if isinstance(data, (list, tuple)) else 1

    def tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            seen.append(size(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return seen


def test_a_step_converts_no_list_of_allowed_ids_after_the_first(monkeypatch):
    s = Sampler(torch.device("cpu"))
    wide = Request("wide", [1, 2], SamplingParams(max_tokens=8, allowed_token_ids=list(range(VOCAB))))
    narrow = Request("narrow", [1, 2], SamplingParams(max_tokens=8, allowed_token_ids=[5, 6, 7]))
    seen = counting_tensor(monkeypatch)
    logits = torch.randn(2, VOCAB)
    s.sample(logits, [wide, narrow])
    assert sum(seen) >= VOCAB  # the first step builds the masks
    for step in range(4):
        seen.clear()
        wide.output_ids.append(step)
        narrow.output_ids.append(step)
        out = s.sample(torch.randn(2, VOCAB), [wide, narrow])
        assert out[1] in (5, 6, 7)
        assert sum(seen) <= 8, seen  # the rows' indices, not the ids: the same for 3 ids as for 49152


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", num_blocks=128))


def step_times(engine: Engine, companions: list[int] | None) -> list[float]:
    """The decode step times (s) of a plain greedy request beside 16 others whose allowed_token_ids is
    `companions` (None: not set)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=companions or [])
    reqs = [Request("plain", [5 + i for i in range(8)], SamplingParams(max_tokens=6, ignore_eos=True))]
    reqs += [Request(f"c{i}", [7 + i + j for j in range(8)], params) for i in range(16)]
    for r in reqs:
        engine.add_request(r)
    times = []
    while not reqs[0].finished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.run_until_done(reqs)
    return times[1:]  # the decode steps (the first prefills all 17, and builds the masks)


@pytest.mark.alone  # its bound is a timing
def test_a_neighbour_with_a_vocabulary_of_allowed_ids_does_not_slow_a_request(engine):
    """The fastest decode step (the least disturbed by whatever else runs on the machine) of a plain
    request beside 16 that allow the whole vocabulary, against beside 16 that allow anything by
    leaving the field out; interleaved ABBA."""
    whole = list(range(engine.vocab_size))
    step_times(engine, None)  # warm up
    runs = {"whole": [], "none": []}
    for k in ("whole", "none", "none", "whole"):
        runs[k] += step_times(engine, whole if k == "whole" else None)
    fastest = {k: min(v) * 1e3 for k, v in runs.items()}
    print(f"plain request's fastest decode step beside 16 others (ms): allowed_token_ids of the whole vocabulary "
          f"{fastest['whole']:.1f}, not set {fastest['none']:.1f}")
    # rebuilt each step from the Python lists (the kept state cleared before each step) it measured 84.8
    # against 6.6 ms, +78 ms a step; stacking the kept masks and applying them adds 1.2-2.5 ms on this 2-core
    # machine (4.2-5.2 against 2.7-3.2 ms), and a clean-clone CI run read 8.6 against 3.0 (+5.6; 2.9x, past the
    # ratio bound this test had, 2.2x, once the plain step got faster). The bound is on what the masks add a
    # step, between the two
    assert fastest["whole"] - fastest["none"] < 15.0, fastest
