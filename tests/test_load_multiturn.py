"""The multi-turn workload against the fake server with and without its prefix cache: each turn's prompt is
the previous one + the reply actually returned + a new message, TTFT and cached tokens come out per turn,
and reuse shows (later turns fast with the cache, not without)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.fake_server import FakeConfig, FakeServer
from pdserve.bench.load.multiturn import conversations
from pdserve.bench.load.workload import LengthDist, PromptBuilder, arrival_times
from test_load_report_tables import _tables, check_tables  # pytest puts tests/ on sys.path

BLOCK = 16  # the fake's prefix-cache block, in words


def _run(tmp_path, cfg: FakeConfig, *extra: str):
    out = tmp_path / "run"
    with FakeServer(cfg) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--dataset", "multiturn", "--conversations", "3", "--turns", "3",
                        "--input-len", "1500", "--new-message-len", "uniform:30:50", "--output-len", "4",
                        "--concurrency", "1", "--out", str(out), "--no-progress", "--no-plots", "--seed", "3",
                        *extra])
        bodies = list(srv.bodies)
    assert rc == 0
    return json.loads((out / "results.json").read_text()), (out / "summary.md").read_text(), bodies


def test_conversations_are_seeded():
    b = PromptBuilder()
    args = (4, 3, LengthDist.parse("100"), LengthDist.parse("uniform:5:50"), LengthDist.parse("uniform:2:9"), b)
    one, same, fresh = (conversations(*args, seed=1, text_seed=t) for t in (7, 7, 8))
    assert one == same
    assert [[t.message_len for t in c.turns] for c in one] == [[t.message_len for t in c.turns] for c in fresh]
    assert one[0].turns[0].message != fresh[0].turns[0].message  # fresh words each run: no cache carries over
    c = one[0]
    lens = [t.message_len for t in c.turns]
    outs = [t.output_len for t in c.turns]
    second = lens[0] + outs[0] + lens[1]
    assert c.planned_prompt_lens() == [lens[0], second, second + outs[1] + lens[2]]


def test_chat_turns_grow_by_the_returned_reply_and_reuse_shows_per_turn(tmp_path):
    cfg = FakeConfig(itl_ms=1.0, prefill_ms_per_token=0.05, prefix_cache_block=BLOCK)
    run, summary, bodies = _run(tmp_path, cfg, "--warmup-batch", "2", "--warmup-max-batches", "2")
    assert run["endpoint"] == "/v1/chat/completions" and run["backend"] == "openai-chat"
    (block,) = run["results"]
    assert block["load_label"] == "1 conversations at a time" and block["conversations_in_flight"] == 1
    assert block["completed"] == 9 and block["request_rate"] is None
    reqs = block["requests"]
    # every body went to chat; the measured ones are the last 9, sent one conversation after another
    measured = bodies[-9:]
    for c in range(3):
        turns = measured[3 * c:3 * c + 3]
        for t in range(1, 3):
            prev, cur = turns[t - 1]["messages"], turns[t]["messages"]
            assert cur[:len(prev)] == prev and len(cur) == len(prev) + 2
            # the assistant message is exactly what the server returned for the previous turn
            assert cur[len(prev)] == {"role": "assistant", "content": " tok0 tok1 tok2 tok3"}
            assert cur[-1]["role"] == "user"
    # cached tokens per turn, as the fake reports them: the previous prompt's whole blocks
    by = {(r["conversation"], r["turn"]): r for r in reqs}
    for c in range(3):
        assert by[(c, 1)]["cached_tokens"] == 0
        for t in (2, 3):
            assert by[(c, t)]["cached_tokens"] == by[(c, t - 1)]["prompt_len"] // BLOCK * BLOCK
    rows = block["per_turn"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["completed"] == 3 for r in rows)
    assert rows[0]["mean_cached_tokens"] == 0 and rows[1]["cached_share"] > 0.9
    assert rows[1]["mean_reused_tokens"] == {"device": rows[1]["mean_cached_tokens"], "host": 0, "disk": 0}
    # turn 1 prefills ~1500 words (75 ms); later turns only the ~50 new ones
    assert rows[1]["median_ttft_ms"] < 0.5 * rows[0]["median_ttft_ms"], rows
    assert rows[2]["median_ttft_ms"] < 0.5 * rows[0]["median_ttft_ms"], rows
    assert rows[1]["mean_prefill_ms"] < 0.5 * rows[0]["mean_prefill_ms"]
    ttft2 = [r["ttft_s"] * 1e3 for r in reqs if r["turn"] == 2]
    assert (rows[1]["min_ttft_ms"], rows[1]["max_ttft_ms"]) == pytest.approx((min(ttft2), max(ttft2)))
    # the per-turn table, one row per turn
    assert len(check_tables(summary)) == 3  # the main table, server phases, per turn: each renders
    (per_turn,) = [t for t in _tables(summary) if "turn" in t[0]]
    assert [r[2] for r in per_turn[2:]] == ["1", "2", "3"]
    assert per_turn[3][per_turn[0].index("cached share")].endswith("%")
    assert run["arms"][0]["warmup"]["batches"] >= 1


def test_without_a_prefix_cache_later_turns_are_not_faster(tmp_path):
    """The same run against a server that recomputes everything: the check above would fail here."""
    run, summary, _ = _run(tmp_path, FakeConfig(itl_ms=1.0, prefill_ms_per_token=0.05), "--warmup-batch", "0")
    rows = run["results"][0]["per_turn"]
    assert rows[1]["median_ttft_ms"] > 0.9 * rows[0]["median_ttft_ms"], rows
    assert rows[0]["mean_cached_tokens"] is None and rows[1]["cached_share"] is None  # none reported
    (per_turn,) = [t for t in _tables(summary) if "turn" in t[0]]
    assert per_turn[2][per_turn[0].index("cached share")] == "-"


def test_completions_concatenate_the_text(tmp_path):
    cfg = FakeConfig(itl_ms=1.0, prefill_ms_per_token=0.01, prefix_cache_block=BLOCK)
    run, _, bodies = _run(tmp_path, cfg, "--endpoint", "/v1/completions", "--warmup-batch", "0",
                          "--think-time", "0.05")
    assert all("prompt" in b for b in bodies)
    for c in range(3):
        p0, p1, p2 = (b["prompt"] for b in bodies[3 * c:3 * c + 3])
        assert p1.startswith(p0 + " tok0 tok1 tok2 tok3 ") and p2.startswith(p1 + " tok0 tok1 tok2 tok3 ")
    reqs = run["results"][0]["requests"]
    # think time: a turn goes >= 50 ms after the previous one's answer
    by = {(r["conversation"], r["turn"]): r for r in reqs}
    for c in range(3):
        for t in (2, 3):
            prev = by[(c, t - 1)]
            assert by[(c, t)]["start_s"] - (prev["start_s"] + prev["e2e_s"]) >= 0.045


@pytest.mark.parametrize("bad", [["--capacity-search", "--goodput", "ttft:100"], ["--num-prompts", "4"],
                                 ["--concurrency", "2", "--request-rate", "1"], ["--max-concurrency", "2"]])
def test_multiturn_refuses_what_it_cannot_do(bad, capsys):
    assert generator.main(["--dataset", "multiturn", "--no-progress", *bad]) == 2
    err = capsys.readouterr().err
    assert "multi-turn" in err or "conversations" in err, err


def test_conversations_start_at_a_seeded_rate(tmp_path):
    cfg = FakeConfig(itl_ms=1.0, prefill_ms_per_token=0.005, prefix_cache_block=BLOCK)
    out = tmp_path / "run"
    with FakeServer(cfg) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--dataset", "multiturn", "--conversations", "4", "--turns", "2",
                        "--input-len", "100", "--output-len", "3", "--request-rate", "5", "--warmup-batch", "0",
                        "--out", str(out), "--no-progress", "--no-plots", "--seed", "2"])
    assert rc == 0
    (block,) = json.loads((out / "results.json").read_text())["results"]
    assert block["load_label"] == "conversations 5/s" and block["conversation_rate"] == 5.0
    assert block["request_rate"] is None and block["saturation"] is None  # a request rate it is not
    firsts = sorted((r for r in block["requests"] if r["turn"] == 1), key=lambda r: r["scheduled_s"])
    assert [r["scheduled_s"] for r in firsts] == pytest.approx(list(arrival_times(4, 5.0, 1.0, seed=2)))
    assert all(0 <= r["start_s"] - r["scheduled_s"] < 0.5 for r in block["requests"])  # went when due (busy box)
