"""What a run reused from the server's prefix cache (MEASURING.md rule 11), against the fake server's prefix cache
(16-word blocks): two invocations with the same --seed send new words the second time (a nonce per invocation,
in results.json), so the second is as cold as the first; --reuse-prompts sends the same words on purpose and
the report states the share served from the cache; dataset prompts sent again are warned about."""

from __future__ import annotations

import json

from pdserve.bench.load import generator
from pdserve.bench.load.fake_server import FakeConfig, FakeServer

COMMON = ["--num-prompts", "6", "--input-len", "70", "--output-len", "3", "--request-rate", "inf",
          "--warmup-batch", "0", "--seed", "3", "--no-progress", "--no-plots"]


def load(srv, out, *extra) -> tuple[dict, str]:
    assert generator.main(["--base-url", srv.base_url, *COMMON, *extra, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), (out / "summary.md").read_text()


def main_row(summary: str) -> list[str]:
    """The runs' table's one row (the server phases' table below it has one too)."""
    rows = [line for line in summary.splitlines() if line.startswith("| default | point |")]
    return [c.strip() for c in rows[0].strip("|").split("|")]


def cached_column(summary: str) -> int:
    header = next(line for line in summary.splitlines() if line.startswith("| arm | phase | load |"))
    return [c.strip() for c in header.strip("|").split("|")].index("cached share")


def test_a_second_invocation_is_fresh_and_reuse_on_purpose_is_stated(tmp_path):
    with FakeServer(FakeConfig(itl_ms=1.0, prefix_cache_block=16)) as srv:
        first, _ = load(srv, tmp_path / "first")
        second, second_md = load(srv, tmp_path / "second")
        load(srv, tmp_path / "reuse1", "--reuse-prompts")
        reused, reused_md = load(srv, tmp_path / "reuse2", "--reuse-prompts")
        bodies = list(srv.bodies)
    # the same lengths and seed, new words: nothing of the first invocation's prompts is cached for the second
    assert first["prompt_text"]["nonce"] != second["prompt_text"]["nonce"] and not second["prompt_text"]["reused"]
    assert [r["prompt_len"] for r in first["results"][0]["requests"]] == \
           [r["prompt_len"] for r in second["results"][0]["requests"]]
    prompts = [b["prompt"] for b in bodies]
    assert not set(prompts[:6]) & set(prompts[6:12])
    [block] = second["results"]
    assert block["cached_tokens_reported"] == 6 and block["total_cached_tokens"] == 0 and block["cached_share"] == 0.0
    assert main_row(second_md)[cached_column(second_md)] == "0% (0 / 420 tok)"
    assert "served from a cache" not in second_md and "fresh: each run its own text" in second_md
    # --reuse-prompts: the same words as the invocation before; 4 whole blocks of each 70-word prompt cached
    assert sorted(prompts[12:18]) == sorted(prompts[18:24])  # sent concurrently: they may arrive in another order
    [block] = reused["results"]
    assert reused["prompt_text"]["reused"] and block["total_cached_tokens"] == 6 * 64
    assert block["cached_share"] == 64 / 70
    assert main_row(reused_md)[cached_column(reused_md)] == "91% (384 / 420 tok)"
    assert reused["verdict"]["cached_share"] == {"default": 64 / 70} and second["verdict"]["cached_share"] == {
        "default": 0.0}
    assert "reused on purpose (--reuse-prompts)" in reused_md and "served from a cache" not in reused_md


def test_dataset_prompts_sent_again_are_warned_about(tmp_path):
    """ShareGPT prompts are the file's: a second invocation sends the same text, and the report says that run
    was served from a cache though it should have been cold."""
    data = tmp_path / "sharegpt.json"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    data.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": " ".join(words[(i + k) % 10] for k in range(48)) + f" q{i}"},
        {"from": "gpt", "value": "one two three four five six seven eight"}]} for i in range(6)]))
    sharegpt = ["--dataset", "sharegpt", "--dataset-path", str(data)]
    with FakeServer(FakeConfig(itl_ms=1.0, prefix_cache_block=16)) as srv:
        _, first_md = load(srv, tmp_path / "a", *sharegpt)
        again, again_md = load(srv, tmp_path / "b", *sharegpt)
    assert "served from a cache" not in first_md
    assert again["results"][0]["cached_share"] > 0.9
    assert "**served from a cache**: default at rate inf (point) had" in again_md
