"""`pdserve-bench engine` end to end on the CPU with the tiny model (the GPU run's smoke test)."""

from __future__ import annotations

import argparse
import json

from bench import engine_bench


def test_engine_bench_cpu_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    out = tmp_path / "engine.json"
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--lengths", "64,128", "--batches", "1,2",
                              "--repeats", "2", "--context", "256", "--out", str(out)])
    assert engine_bench.run(args) == 0

    result = json.loads(out.read_text())
    assert result["machine"]["device_type"] == "cpu" and result["machine"]["torch"]
    assert result["config"]["model"] == "tiny" and result["config"]["block_size"] == 16
    assert [row["tokens"] for row in result["prefill"]] == [64, 128]
    assert [row["batch"] for row in result["decode"]] == [1, 2]
    for row in result["prefill"] + result["decode"]:
        for side in ("transformers_ms", "ours_ms"):
            s = row[side]
            assert len(s["runs"]) == 2 and 0 < s["min"] <= s["median"] <= s["max"]
        assert row["ratio"] == row["ours_ms"]["median"] / row["transformers_ms"]["median"]
    for row in result["prefill"]:
        # float32 on the CPU: our paged prefill gives transformers' logits
        assert row["first_token_agrees"] and row["max_abs_logit_diff"] < 1e-3
        assert row["met"] == (row["ratio"] <= 1.05)
    t = result["targets"]
    assert set(t["prefill_within_5pct"]) == {"64", "128"}
    assert t["decode_b1_not_slower"] in (True, False) and t["decode_b32_within_2x_b1"] is None
    # the markdown table is the last thing printed
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("decode b1 <= transformers b1:")
    assert any(line.startswith("| 128 |") for line in printed)


def test_parse_counts():
    assert engine_bench.parse_counts("1k, 4k,16384") == [1024, 4096, 16384]
