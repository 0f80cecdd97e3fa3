"""The transfer bench's exact-match check can fail: a sender that drops data is caught.

`pdserve-bench transfer --break skip-block:K|skip-all` runs the bench path (two processes, the
real transports) with a sender that leaves block K of every request out, or sends nothing while
reporting success. The decode side poisoned the reserved blocks with NaN and each run has its own
prompt, so the decoded tokens and logits cannot match the colocated run. The same run without
the fault is exact (tests/test_transfer_engine.py covers every transport and mode).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from pdserve.bench.transfer import table as bench
from pdserve.bench.transfer.check import parse_fault, poison, prompt_ids, run_seed, scrub, skip
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.transfer.plan import make_plan

pytestmark = pytest.mark.timeout(600)


def run_bench(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--lengths", "40", "--repeats", "1",
                              "--warmup", "0", "--transports", "ipc,zmq", "--no-seed-method", *argv,
                              "--out", str(tmp_path / "transfer")])
    assert bench.run(args) == 0
    return json.loads((tmp_path / "transfer.json").read_text())


@pytest.mark.parametrize("fault", ["skip-block:1", "skip-all"])
def test_a_sender_that_drops_data_fails_the_exact_match(tmp_path, fault):
    result = run_bench(tmp_path, "--break", fault)
    assert result["config"]["fault"] == fault
    results = result["lengths"][0]["results"]
    assert {(r["transport"], r["mode"]) for r in results} == {(t, m) for t in ("ipc", "zmq") for m in ("bulk", "layer")}
    for r in results:
        # the transport reported success: only the exact-match check sees the missing data
        assert r["failed"] == 0, r["errors"]
        assert r["exact"] is False and r["exact_runs"] == 0, r
        # the NaN left in a skipped block reaches the logits: the decode engine refuses to pick a
        # token from them (or, where the poison was overwritten with stale bytes, the logits differ)
        assert ("logits are not finite" in r["mismatch"]
                or "first differing logits at generated token 1" in r["mismatch"]), r["mismatch"]
    assert result["targets"]["all_exact"] is False
    assert "FAULT INJECTED" in (tmp_path / "transfer.md").read_text()


def test_the_same_run_without_a_fault_is_exact(tmp_path):
    result = run_bench(tmp_path)
    assert result["config"]["fault"] is None
    for r in result["lengths"][0]["results"]:
        assert r["failed"] == 0 and r["exact"] is True and r["exact_runs"] == 1, r
    assert result["targets"]["all_exact"] is True


def test_skip_leaves_exactly_the_faulty_part_out():
    layout = KVLayout(2, 2, 16, "float32", 16, 64)
    plan = make_plan("r", [0, 1, 2, 7], [10, 11, 12, 13], 60, layout, layout)
    assert plan.runs == ((0, 10, 3), (7, 13, 1))
    assert skip(plan, parse_fault("skip-block:1")).runs == ((0, 10, 1), (2, 12, 1), (7, 13, 1))
    assert skip(plan, parse_fault("skip-block:-1")).runs == ((0, 10, 3),)
    assert skip(plan, parse_fault("skip-all")).runs == ()
    with pytest.raises(ValueError):
        parse_fault("skip-layer")


def test_poison_fills_only_the_named_blocks_and_scrub_clears_it():
    pool = torch.zeros(2, 8, 2, 4, 1, 3)  # [layers, blocks, 2, block_size, heads, dim]
    poison(pool, [2, 3, 5], seed=0)
    assert torch.isnan(pool[:, [2, 3, 5]]).all()
    assert not torch.isnan(pool[:, [0, 1, 4, 6, 7]]).any()
    scrub(pool)
    assert not torch.isnan(pool).any() and (pool == 0).all()
    ints = torch.zeros(2, 8, 4, dtype=torch.int16)  # no NaN: a seeded garbage pattern instead
    poison(ints, [1], seed=3)
    again = torch.zeros_like(ints)
    poison(again, [1], seed=3)
    assert (ints[:, 1] != 0).any() and torch.equal(ints, again) and (ints[:, 0] == 0).all()


def test_each_run_gets_its_own_prompt():
    seeds = {run_seed(0, 40, t, m, i) for t in ("ipc", "zmq") for m in ("plain", "bulk", "layer") for i in range(5)}
    assert len(seeds) == 30
    assert run_seed(0, 40, "ipc", "bulk", 0) == run_seed(0, 40, "ipc", "bulk", 0)  # the same in both processes
    a, b = prompt_ids(1000, 64, 1), prompt_ids(1000, 64, 2)
    assert a == prompt_ids(1000, 64, 1) and a != b and len(a) == 64 and 0 <= min(a) and max(a) < 1000
    assert math.isclose(len(set(a)) / 64, 1.0, abs_tol=0.1)  # not one repeated token
