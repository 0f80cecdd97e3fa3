"""The client and the load generator against a real `pdserve --model tiny` (CPU, both policies)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.load import generator
from pdserve.client import Client, ServerError
from pdserve.client import cli
from test_load_run import PNGS, check_block_against_records  # pytest puts tests/ on sys.path (no tests/__init__.py)


@pytest.fixture(scope="module")
def pdserve(tiny_pdserve) -> str:
    return tiny_pdserve.url  # the request-only live tests' shared pdserve (conftest.py)


def test_client_and_cli_against_pdserve(pdserve, capsys):
    with Client(pdserve) as c:
        assert c.models() == ["tiny"]
        out = c.complete("The capital of France is", max_tokens=4, ignore_eos=True, policy="disaggregated")
        assert out.usage.completion_tokens == 4 and out.finish_reason == "length"
        t = out.timings
        assert t.policy == "disaggregated" and t.transport == "ipc" and t.kv_bytes > 0
        assert t.prefill_worker and t.decode_worker and t.prompt_tokens == out.usage.prompt_tokens
        with c.stream_chat("Hi", max_tokens=3, ignore_eos=True, policy="colocated") as s:
            tokens = [d for d in s if d.is_token]
        assert len(tokens) == 3 and s.result.timings.policy == "colocated" and s.result.timings.transfer_ms is None
        with pytest.raises(ServerError) as e:
            c.complete("x", max_tokens=1, policy="sideways")
        assert e.value.status == 400 and e.value.param == "policy"
    assert cli.main(["Hello", "--base-url", pdserve, "--max-tokens", "3", "--stream", "--ignore-eos",
                     "--policy", "disaggregated"]) == 0
    printed = capsys.readouterr().out
    assert "server timings:" in printed and "transfer_exposed_ms" in printed and "kv_bytes" in printed


def test_load_run_both_policies_against_pdserve(pdserve, tmp_path):
    out = tmp_path / "pdserve-load"
    rc = generator.main(["--base-url", pdserve, "--policies", "colocated,disaggregated", "--request-rate", "4",
                    "--num-prompts", "5", "--input-len", "uniform:16:200", "--output-len", "6",
                    "--tokenizer", "tiny", "--warmup-batch", "1", "--warmup-max-batches", "2",
                    "--goodput", "ttft:60000", "tpot:60000",
                    "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    assert run["model"] == "tiny" and run["policy_runs"] == "separate"
    colo, disagg = run["results"]
    assert (colo["policy"], disagg["policy"]) == ("colocated", "disaggregated")
    for block in (colo, disagg):
        assert block["completed"] == 5 and block["failed"] == 0 and block["timings_reported"] == 5
        check_block_against_records(block, {"ttft": 60000.0, "tpot": 60000.0})
        assert all(r["output_len"] == 6 for r in block["requests"])  # ignore_eos honoured
        assert {r["timings"]["policy"] for r in block["requests"]} == {block["policy"]}
        assert block["mean_prefill_ms"] > 0 and block["ttft_split_ms"]["prefill"] > 0
    # both policies got the same prompt lengths, and the server counted what the generator planned
    assert [r["prompt_len"] for r in colo["requests"]] == [r["prompt_len"] for r in disagg["requests"]]
    assert all(r["prompt_len"] == r["planned_prompt_len"] for b in (colo, disagg) for r in b["requests"])
    assert colo["mean_transfer_ms"] is None and disagg["mean_transfer_ms"] is not None
    assert all(r["timings"]["kv_bytes"] > 0 and r["timings"]["transport"] == "ipc" for r in disagg["requests"])
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| disaggregated | point | rate 4/s | 5 | 0 |" in (out / "summary.md").read_text()
    # each policy's own run, its throughput over its own duration (check_block_against_records)
    assert colo["duration_basis"] == disagg["duration_basis"] == "own run"
    assert [a["warmup"]["batches"] for a in run["arms"]] == [2, 2]


def test_multiturn_chat_reuses_each_previous_turn(pdserve, tmp_path):
    """Conversations over chat against pdserve's prefix cache (on by default), both policies: every later
    turn's prompt starts with the previous turn's prompt tokens (the chat template keeps them an exact
    prefix), so the server reports at least its whole blocks as cached."""
    out = tmp_path / "multiturn"
    rc = generator.main(["--base-url", pdserve, "--policies", "colocated,disaggregated", "--dataset", "multiturn",
                    "--conversations", "2", "--turns", "3", "--input-len", "120", "--new-message-len", "12",
                    "--output-len", "4", "--concurrency", "1", "--tokenizer", "tiny", "--warmup-batch", "0",
                    "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    assert run["endpoint"] == "/v1/chat/completions"
    block_size = 16  # pdserve's default --block-size
    for block in run["results"]:
        assert block["completed"] == 6, block["errors"]
        by = {(r["conversation"], r["turn"]): r for r in block["requests"]}
        for c in range(2):
            for t in (2, 3):
                prev, cur = by[(c, t - 1)], by[(c, t)]
                assert cur["prompt_len"] > prev["prompt_len"] + prev["output_len"]
                whole_blocks = prev["prompt_len"] // block_size * block_size
                assert cur["cached_tokens"] >= whole_blocks, (block["policy"], prev, cur)
        assert [row["turn"] for row in block["per_turn"]] == [1, 2, 3]
        assert block["per_turn"][1]["cached_share"] > 0.6
