"""Decoding from a transferred cache equals the colocated run, bitwise, for every transport and mode.

Prefill and decode run as two processes (bench/transfer/roles.py, the same code `pdserve-bench
transfer` times): the decode process reserves blocks and poisons them with NaN, the prefill
process runs prefill_only (with the per-layer hook in layer mode) and pushes the KV, the decode
process adopts the request and decodes 20 greedy tokens; token ids and every step's logits must
equal a colocated run of the same (per-run, seeded) prompt on the decode engine (the first
token's logits are compared by SHA-256 of their bytes). tests/test_bench_honesty.py shows the
same check failing when the sender drops data.
"""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.transfer import table as bench
from pdserve.protocol.enums import MODES, TRANSPORTS

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


def test_decode_from_transferred_cache_equals_colocated(tmp_path):
    """Every transport and mode (the real model's shapes over nixl and zmq: test_server_e2e; on the GPU:
    `pdserve-bench transfer`). 5: shorter than one block; 16: exactly one; 40: three blocks, the last
    one partly filled."""
    lengths = "5,16,40"
    result = run_bench(tmp_path, "--model", "tiny", "--device", "cpu", "--lengths", lengths, "--repeats", "1",
                       "--warmup", "0", "--no-seed-method")
    assert_all_exact(result, {(t, m) for t in TRANSPORTS for m in MODES})
    assert [row["tokens"] for row in result["lengths"]] == [int(n) for n in lengths.split(",")]
    assert result["config"]["tokens_compared"] == 20


def test_bench_cpu_smoke(tmp_path):
    """The CPU smoke command of `pdserve-bench transfer`, with the seed's method beside ours, at one length
    (several lengths: the test above)."""
    result = run_bench(tmp_path, "--model", "tiny", "--device", "cpu", "--lengths", "256", "--repeats", "2",
                       "--transports", "ipc,zmq,nixl")
    assert_all_exact(result, ALL_METHODS)
    assert result["complete"] is True and result["provenance"]["gpu_end"] is None
    row = result["lengths"][-1]
    assert row["kv_bytes"] == 256 * result["config"]["kv_bytes_per_token"]
    assert len(row["prefill_ms"]["runs"]) == 2 * 4  # one plain prefill per round, per transport and seed-copy
    seeds = [s for x in result["lengths"] for r in x["results"] for s in r["prompt_seeds"]]
    assert len(set(seeds)) == len(seeds) == 2 * len(ALL_METHODS), "a prompt was reused"
    for r in row["results"]:
        assert r["transfer_ms"]["median"] > 0 and len(r["transfer_ms"]["runs"]) == 2
        assert r["exposed_ms"]["median"] >= 0 and r["first_step_ms"] > 0
        assert r["exact_runs"] == r["runs"] == 2
        extra = r["extra_vs_plain"]
        assert extra["pairs"] == 2 and extra["diff"]["min"] <= extra["diff"]["median"] <= extra["diff"]["max"]
        assert r["layer_extra_ms"] == extra["diff"]["median"]
        assert [sorted(o) for o in r["orders"]] == [["bulk", "layer", "plain"]] * 2
        assert ("extra_vs_bulk" in r) == (r["mode"] == "layer")
    bw = result["bandwidth"]
    assert bw["d2d_gbps"] > 0 and bw["paged_run"]["blocks"] == 16
    assert bw["paged_run"]["strided_gbps"] > 0 and bw["paged_run"]["per_layer_gbps"] > 0
    targets = result["targets"]
    assert targets["all_exact"] is True
    # each verdict follows from the figures in the same JSON
    by = {(r["transport"], r["mode"]): r for r in row["results"]}
    nixl_over_ipc = by["nixl", "bulk"]["transfer_ms"]["median"] / by["ipc", "bulk"]["transfer_ms"]["median"]
    assert targets["nixl_over_ipc"] == pytest.approx(nixl_over_ipc)
    assert targets["nixl_within_1.1x_ipc"] is (nixl_over_ipc <= 1.1)
    fraction = by["ipc", "bulk"]["gbps"] / bw["d2d_gbps"]
    assert targets["ipc_bulk_fraction_of_d2d"] == pytest.approx(fraction)
    assert targets["ipc_bulk_at_least_0.9_d2d"] is (fraction >= 0.9)
    layer_fraction = by["ipc", "layer"]["extra_vs_plain"]["diff"]["median"] / row["prefill_ms"]["median"]
    assert targets["ipc_layer_extra_within_0.5pct"] is (layer_fraction <= 0.005)
    prov = result["provenance"]
    assert prov["commit"] and prov["versions"]["torch"] and prov["gpu_start"] is None  # no GPU here
    text = (tmp_path / "transfer.md").read_text()
    assert "### 256 tokens" in text and "| seed-copy | layer |" in text and "targets at 256 tokens" in text
    assert "FAULT" not in text and "yes (2/2)" in text
