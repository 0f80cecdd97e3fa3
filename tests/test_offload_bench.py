"""`pdserve-bench offload` on the CPU with the tiny model: every arm present and every reload
exact; with a deliberately wrong reload (--break) the exact check fails, so it can."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.transfer import offload

pytestmark = pytest.mark.timeout(300)

TIER_ARMS = {"gpu", "pinned", "pageable", "disk", "disk-warm"}


def run_bench(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    offload.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--lengths", "40", "--repeats", "1",
                              "--warmup", "0", "--tokens", "4", *argv, "--out", str(tmp_path / "offload")])
    assert offload.run(args) == 0
    return json.loads((tmp_path / "offload.json").read_text())


def test_every_arm_reloads_exactly(tmp_path):
    result = run_bench(tmp_path)
    c, [row] = result["config"], result["lengths"]
    assert result["provenance"]["commit"] and c["fault"] is None and c["page_cache"] == "fadvise"
    assert row["tokens"] == 40 and row["blocks"] == 3 and row["kv_bytes"] == 3 * c["entry_bytes"]
    assert set(row["arms"]) == TIER_ARMS | {"plain-pinned"}
    assert sorted(row["orders"][0]) == sorted(offload.ARMS)
    for name, a in row["arms"].items():
        assert a["reload_ms"]["median"] > 0 and a["offload_ms"]["median"] > 0
        assert a["speedup"]["median"] == pytest.approx(row["recompute_ms"]["runs"][0] / a["reload_ms"]["runs"][0])
        if name != "plain-pinned":
            assert a["exact"] is True and a["exact_runs"] == 1 and a["errors"] == [], (name, a)
    assert row["source_first_exact"] and row["recompute_first_token_equal"]
    per_token = row["recompute_ms"]["median"] / 1e3 / 40
    assert row["break_even_gbps"] == pytest.approx(row["kv_bytes_per_token"] / per_token / 1e9)
    assert result["targets"]["all_exact"] is True
    assert list(tmp_path.glob("offload-disk-*")) == []  # the temporary disk tier is gone
    assert "| 40 |" in (tmp_path / "offload.md").read_text()


def test_a_reload_that_leaves_a_block_out_is_not_exact(tmp_path):
    result = run_bench(tmp_path, "--break", "skip-block:1")
    [row] = result["lengths"]
    for name in TIER_ARMS:
        a = row["arms"][name]
        assert a["exact"] is False and a["exact_runs"] == 0, (name, a)
        assert "not finite" in a["mismatch"]  # the NaN poison left in block 1 reached the logits
    assert result["targets"]["all_exact"] is False
    assert "FAULT INJECTED" in (tmp_path / "offload.md").read_text()


def test_a_corrupted_stored_copy_is_not_exact_and_disk_refuses_it(tmp_path):
    result = run_bench(tmp_path, "--break", "corrupt:1", "--arms", "recompute,pinned,disk")
    [row] = result["lengths"]
    assert set(row["arms"]) == {"pinned", "disk", "disk-warm"}
    assert row["arms"]["pinned"]["exact"] is False
    assert "first differing logits at generated token 1" in row["arms"]["pinned"]["mismatch"]
    for name in ("disk", "disk-warm"):  # refused by checksum, then forgotten: never served
        a = row["arms"][name]
        assert a["exact"] is False and a["errors"] and "the reload failed" in a["mismatch"], a
    assert "checksum" in row["arms"]["disk"]["errors"][0]
    assert "in no tier" in row["arms"]["disk-warm"]["errors"][0]
