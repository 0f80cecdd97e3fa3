"""pdserve-bench paths: the fast paths judged against the plain one (bench/engine/paths.py), on the CPU."""

from __future__ import annotations

import argparse
import json

import torch

from pdserve.bench.engine import paths
from pdserve.workers.engine import attention


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    paths.add_arguments(p)
    a = p.parse_args(["--device", "cpu", "--requests", "3", "--max-tokens", "5", "--chunk-tokens", "32",
                      "--out", str(tmp_path / "paths.json")])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_the_cpu_paths_agree_with_the_plain_path_and_the_json_says_so(tmp_path):
    assert paths.run(_args(tmp_path)) == 0
    rec = json.loads((tmp_path / "paths.json").read_text())
    assert rec["passed"] and set(rec["arms"]) == {"fast", "chunked"}
    for arm in rec["arms"].values():
        assert arm["greedy_requests_equal"] == arm["requests_total"] == 6
        assert arm["max_logit_diff"] <= 1e-3
        assert all(r["agree"] == 5 for r in arm["requests"])
    assert rec["provenance"]["commit"]


def test_a_wrong_prefix_chunk_fails_the_chunked_arm(tmp_path, monkeypatch):
    real = attention.reference_prefix

    def wrong(q, pool_layer, table, pos, scale):  # attends as if the chunk saw only half its prefix
        return real(q, pool_layer, table, pos, scale * 4.0)

    monkeypatch.setattr(attention, "reference_prefix", wrong)
    assert paths.run(_args(tmp_path)) == 1
    rec = json.loads((tmp_path / "paths.json").read_text())
    chunked = rec["arms"]["chunked"]
    assert not chunked["passed"] and chunked["max_logit_diff"] > 0.02 and chunked["mismatches"]


def test_a_difference_at_a_near_tie_is_not_a_mismatch_and_elsewhere_is():
    logits = torch.tensor([[0.0, 5.0, 4.99], [0.0, 1.0, 9.0]])
    plain = {"tokens": [1, 2], "logits": list(logits)}
    tie = {"tokens": [2, 2], "logits": list(logits + 0.005)}
    row = paths.compare(plain, tie, atol=0.02)
    assert row["agree"] == 0 and row["near_tie"] and abs(row["margin_at_difference"] - 0.01) < 1e-5
    wrong = {"tokens": [1, 1], "logits": list(logits)}
    row = paths.compare(plain, wrong, atol=0.02)
    assert row["agree"] == 1 and row["near_tie"] is False and row["margin_at_difference"] == 8.0
    assert "near_tie" not in paths.compare(plain, plain, atol=0.02)
