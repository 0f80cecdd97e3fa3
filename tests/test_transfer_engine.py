"""Decoding from a transferred cache equals the colocated run, bitwise, for every transport and mode.

Prefill and decode run as two processes (bench/transfer_roles.py, the same code `pdserve-bench
transfer` times): the decode process reserves blocks, the prefill process runs prefill_only (with
the per-layer hook in layer mode) and pushes the KV, the decode process adopts the request and
decodes 20 greedy tokens; token ids and every step's logits must equal a colocated run of the
same prompt on the decode engine (the first token's logits are compared by SHA-256 of their bytes).
"""

from __future__ import annotations

import argparse
import json

import pytest

from bench import transfer as bench
from workers.transfer.base import MODES, TRANSPORTS

pytestmark = pytest.mark.timeout(900)


def run_bench(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([*argv, "--out", str(tmp_path / "transfer")])
    assert bench.run(args) == 0
    return json.loads((tmp_path / "transfer.json").read_text())


def assert_all_exact(result: dict, methods: set) -> None:
    for row in result["lengths"]:
        assert {(r["transport"], r["mode"]) for r in row["results"]} == methods
        for r in row["results"]:
            assert r["failed"] == 0, f"{row['tokens']} tokens, {r['transport']} {r['mode']}: {r['errors']}"
            assert r["exact"], f"{row['tokens']} tokens, {r['transport']} {r['mode']}: {r['mismatch']}"


ALL_METHODS = {(t, m) for t in TRANSPORTS for m in MODES} | {(bench.SEED_METHOD, m) for m in MODES}


@pytest.mark.parametrize("model, lengths", [("tiny", "5,16,40"), ("smollm2-135m", "5,40")])
def test_decode_from_transferred_cache_equals_colocated(tmp_path, model, lengths):
    # 5: shorter than one block; 16: exactly one; 40: three blocks, the last one partly filled
    result = run_bench(tmp_path, "--model", model, "--device", "cpu", "--lengths", lengths, "--repeats", "1",
                       "--warmup", "0", "--prefill-runs", "1", "--no-seed-method")
    assert_all_exact(result, {(t, m) for t in TRANSPORTS for m in MODES})
    assert [row["tokens"] for row in result["lengths"]] == [int(n) for n in lengths.split(",")]
    assert result["config"]["tokens_compared"] == 20


def test_bench_cpu_smoke(tmp_path):
    """The CPU smoke command of `pdserve-bench transfer`, with the seed's method beside ours."""
    result = run_bench(tmp_path, "--model", "tiny", "--device", "cpu", "--lengths", "64,256", "--repeats", "2",
                       "--transports", "ipc,zmq,nixl")
    assert_all_exact(result, ALL_METHODS)
    row = result["lengths"][-1]
    assert row["kv_bytes"] == 256 * result["config"]["kv_bytes_per_token"]
    assert len(row["prefill_ms"]["runs"]) == 9
    for r in row["results"]:
        assert r["transfer_ms"]["median"] > 0 and len(r["transfer_ms"]["runs"]) == 2
        assert r["exposed_ms"]["median"] >= 0 and r["first_step_ms"] > 0
    bw = result["bandwidth"]
    assert bw["d2d_gbps"] > 0 and bw["paged_run"]["blocks"] == 16
    assert bw["paged_run"]["strided_gbps"] > 0 and bw["paged_run"]["per_layer_gbps"] > 0
    targets = result["targets"]
    assert targets["all_exact"] is True
    assert targets["nixl_within_2x_ipc"] in (True, False) and targets["ipc_bulk_at_least_half_d2d"] in (True, False)
    text = (tmp_path / "transfer.md").read_text()
    assert "### 256 tokens" in text and "| seed-copy | layer |" in text and "targets at 256 tokens" in text
