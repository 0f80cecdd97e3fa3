"""`pdserve-bench engine` end to end on the CPU with the tiny model (the GPU run's smoke test):
the JSON's shape, positive figures, and every derived figure recomputed from the raw ones."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import pytest
import torch

from pdserve.bench import cli
from pdserve.bench.engine import steps
from pdserve.settings.worker import EngineConfig
from pdserve.bench.engine.decode import mixed_contexts

SMOKE = ["--model", "tiny", "--device", "cpu", "--lengths", "64,128", "--pairs", "3", "--batches", "1,2",
         "--contexts", "64,128", "--mixed-batch", "3", "--mixed-contexts", "64,128", "--repeats", "2",
         "--warmup", "1", "--hf-decode-context", "64", "--chunk-decodes", "4", "--chunk-context", "64",
         "--chunk-prompt", "256", "--chunk-tokens", "64", "--chunk-steady-steps", "4", "--mixed-step", "3,64,96,32"]


def run(tmp_path, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    steps.add_arguments(parser)
    out = tmp_path / "engine.json"
    assert steps.run(parser.parse_args([*argv, "--out", str(out)])) == 0
    return json.loads(out.read_text())


def check_summary(s: dict, n: int) -> None:
    assert len(s["runs"]) == n and 0 < s["min"] <= s["median"] <= s["max"]


def test_engine_bench_cpu_smoke(tmp_path, capsys):
    result = run(tmp_path, SMOKE)
    prov, c = result["provenance"], result["config"]
    assert prov["commit"] and prov["versions"]["torch"] and prov["gpus"] is None and prov["gpu_start"] is None
    assert isinstance(prov["command"], str) and prov["command"] and prov["date"]
    assert c["model"] == "tiny" and c["block_size"] == 16 and c["repeats"] == 2 and c["pairs"] == 3
    assert result["skipped"] == []

    # decode: the grid, then the mixed point, each beside its roofline
    rows = result["decode"]
    assert [(r["kind"], r["batch"], r["context"]) for r in rows] == [
        ("uniform", 1, 64), ("uniform", 2, 64), ("uniform", 1, 128), ("uniform", 2, 128), ("mixed", 3, None)]
    mixed = rows[-1]
    assert mixed["contexts"] == mixed_contexts(3, 64, 128, 0) and all(64 <= x <= 128 for x in mixed["contexts"])
    for r in rows:
        check_summary(r["ours_ms"], 2)
        check_summary(r["roofline_ms"], 4)  # two copies at the start, two at the end
        contexts = r.get("contexts") or [r["context"]] * r["batch"]
        assert r["kv_bytes"] == sum(contexts) * c["kv_bytes_per_token"]
        assert r["bytes"] == c["weight_bytes"]["read_per_step"] + r["kv_bytes"]
        assert r["ratio"] == r["ours_ms"]["median"] / r["roofline_ms"]["median"]
        assert r["copy_gbps"] == pytest.approx(r["bytes"] / r["roofline_ms"]["median"] * 1e3 / 1e9)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["ours_ms"]["median"] * 1e3)
        assert r["roofline_start_ms"] > 0 and r["roofline_end_ms"] > 0
    # the mixed step: its wall time on the host clock; GPU-busy time only where there is a GPU
    m = result["mixed_step"]
    assert (m["decodes"], m["context"], m["prefix"], m["chunk"], m["path"]) == (3, 64, 96, 32, "piecewise graphs")
    assert m["wall_ms"]["n"] == 10 and 0 < m["wall_ms"]["min"] <= m["wall_ms"]["median"] * (1 + 1e-12)
    assert m["gpu_busy_ms"] is None and m["wall_over_busy"] is None
    assert result["targets"]["mixed_step_within_1_25x_gpu_busy"]["met"] is None
    # tiny's embedding table is its own (untied): a step reads B rows of it, not all 49152 x 64 floats
    w = c["weight_bytes"]
    assert w["input_embedding_excluded"] is True and w["total"] - w["read_per_step"] == 49152 * 64 * 4

    # prefill: paired rounds; the ratio is the median of the per-round ratios, not of the medians
    assert [r["tokens"] for r in result["prefill"]] == [64, 128]
    for r in result["prefill"]:
        check_summary(r["transformers_ms"], 3)
        check_summary(r["ours_ms"], 3)
        per_round = [o / t for t, o in zip(r["transformers_ms"]["runs"], r["ours_ms"]["runs"])]
        assert r["ratio"] == r["paired"]["ratio"]["median"] == pytest.approx(statistics.median(per_round))
        assert [sorted(o) for o in r["orders"]] == [["ours", "transformers"]] * 3
        # float32 on the CPU: our paged prefill gives transformers' logits
        assert r["first_token_agrees"] and r["max_abs_logit_diff"] < 1e-3
    assert [(r["batch"], r["context"]) for r in result["transformers_decode"]] == [(1, 64), (2, 64)]
    for r in result["transformers_decode"]:
        check_summary(r["ours_ms"], 3)
        assert r["ratio"] == r["paired"]["ratio"]["median"] > 0

    # chunked prefill scenario, on and off
    assert set(result["chunked"]) == {"on", "off"}
    for key, r in result["chunked"].items():
        assert r["chunked_prefill"] is (key == "on") and r["decodes"] == 4 and r["prompt"] == 256
        g = r["gap_during_prefill_ms"]
        assert 0 < g["p50"] <= g["p99"] <= g["max"] and g["n"] >= 4
        assert r["steady_gap_ms"]["median"] > 0 and r["steady_gap_ms"]["n"] == 4 * 3  # 4 decodes, 4 steady steps
        assert r["max_gap_over_steady"] == g["max"] / r["steady_gap_ms"]["median"]
        assert r["prefill_steps"] == len(r["prefill_step_ms"]) >= 1 and r["ttft_ms"] > 0
    # chunks of 64 prompt tokens: the 256-token prompt takes 4 steps, each still decoding all 4 requests;
    # unchunked it takes one step, in which nothing else runs
    on, off = result["chunked"]["on"], result["chunked"]["off"]
    # (a token at position p counts 1 + p / chunk_attention_tokens of the budget: a chunk late in the
    # prompt is a little smaller)
    scale, pos, chunks = EngineConfig().chunk_attention_tokens, 0, 0
    while pos < 256:
        pos, chunks = pos + min(256 - pos, round(64 / (1 + pos / scale))), chunks + 1
    assert chunks == 5  # 64, 64, 64, 63, 1
    assert on["chunk_tokens"] == 64 and on["prefill_steps"] == chunks and on["decodes_per_prefill_step"] == [4] * chunks
    assert off["chunk_tokens"] is None and off["prefill_steps"] == 1 and off["decodes_per_prefill_step"] == [0]

    # every verdict follows from the figures beside it
    t = result["targets"]
    assert t["decode_within_roofline_limit"]["met"] is all(r["ratio"] <= 1.5 for r in rows)
    assert t["decode_within_roofline_limit"]["measured"]["worst_ratio"] == max(r["ratio"] for r in rows)
    assert t["decode_b1_1k"] == {"target": "decode batch 1 at 1024 context <= 4.7 ms", "measured": None, "met": None}
    assert t["decode_b32_16k"]["met"] is None
    assert t["prefill_within_3pct"]["met"] is all(r["ratio"] <= 1.03 for r in result["prefill"])
    on = result["chunked"]["on"]
    assert t["chunked_max_gap_within_3x_steady"]["met"] is (on["max_gap_over_steady"] <= 3.0)

    printed = capsys.readouterr().out.strip().splitlines()
    k = len(t)
    assert printed[-k - 1] == "targets:" and all(line.startswith("- ") for line in printed[-k:])
    assert any(line.startswith("| 128 | 2 |") for line in printed)
    assert any(line.startswith("| mixed 64-128") for line in printed)


def test_points_that_do_not_fit_are_skipped_and_listed(tmp_path):
    # tiny: 512 B of KV per token, 8 KiB a block; batch 1 at 64 needs 5 blocks, batch 2 needs 10
    result = run(tmp_path, ["--model", "tiny", "--device", "cpu", "--lengths", "64", "--pairs", "1",
                            "--batches", "1,2", "--contexts", "64", "--mixed-batch", "0", "--repeats", "1",
                            "--warmup", "0", "--hf-decode-context", "0", "--chunk-decodes", "0",
                            "--kv-memory-gb", str(8 * 8192 / 2**30)])
    assert [(r["batch"], r["context"]) for r in result["decode"]] == [(1, 64)]
    assert [(s["batch"], s["context"]) for s in result["skipped"]] == [(2, 64)]
    assert result["skipped"][0]["kv_gib_needed"] > result["skipped"][0]["kv_gib_available"]
    assert result["transformers_decode"] == [] and result["chunked"] == {}
    assert result["targets"]["chunked_max_gap_within_3x_steady"]["met"] is None


def test_parse_counts():
    assert cli.parse_counts("1k, 4k,16384") == [1024, 4096, 16384]
    with pytest.raises(ValueError):
        cli.parse_counts("0")


def test_offline_bench_cpu_smoke(tmp_path):
    from pdserve.bench.engine import offline

    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    out = tmp_path / "offline.json"
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--prompts", "5", "--min-len", "16",
                              "--max-len", "48", "--out-tokens", "4", "--configs", "default,unchunked,chunk16",
                              "--no-peer", "--kv-memory-gb", "0.05", "--out", str(out)])
    assert offline.run(args) == 0
    result = json.loads(out.read_text())
    c, floor, arms = result["config"], result["floor"], result["arms"]
    assert c["prompts"] == 5 and 5 * 16 <= c["prompt_tokens"] <= 5 * 48 and c["configs"]["chunk16"] == {
        "chunked": True, "chunk_tokens": 16}
    assert c["sampling"] == ["greedy", "sampled"] and c["temperature"] == 0.8
    # every config greedy and sampled; no peer asked
    assert set(arms) == {"default", "unchunked", "chunk16", "default sampled", "unchunked sampled", "chunk16 sampled"}
    for row in arms.values():
        [run_] = row["runs"]
        assert run_["gen_tokens"] == 5 * 4 and row["wall_s"] == run_["wall_s"] > 0
        assert row["over_floor"] == row["wall_s"] / floor["s"] and row["over_transformers"] is None
    assert floor["s"] == floor["prefill_s"] + floor["decode_s"] and floor["prefill_s"] > 0 and floor["decode_s"] > 0
    t = result["targets"]
    assert set(t) == {"greedy_within_2x_floor", "sampled_within_2x_floor", "greedy_4x_transformers",
                      "sampled_4x_transformers"}
    assert t["greedy_within_2x_floor"]["met"] is (arms["default"]["over_floor"] <= 2.0)
    assert t["sampled_within_2x_floor"]["measured"] == arms["default sampled"]["over_floor"]
    assert t["sampled_4x_transformers"]["met"] is None  # no peer ran: not measured, not met
    assert result["provenance"]["commit"]
    with pytest.raises(SystemExit, match="--sampling"):
        offline.run(parser.parse_args(["--model", "tiny", "--device", "cpu", "--sampling", "beam"]))


def test_offline_sampled_runs_draw_each_prompt_with_its_own_seed():
    from pdserve.bench.engine import mixed as mx
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", device="cpu", kv_memory_gb=0.05, prefix_cache=False))
    prompts = [[5, 6, 7, 8] * 4, [5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    params = mx.offline_params(3, 12, 0.8, seed=40)
    assert [p.seed for p in params] == [40, 41, 42] and all(p.temperature == 0.8 for p in params)
    first = [r.output_ids for r in engine.generate(prompts, params)]
    again = [r.output_ids for r in engine.generate(prompts, params)]
    assert first == again  # seeded: the same draws on a second run
    assert first[0] != first[1]  # one prompt twice, two seeds: two different samples
    greedy = [r.output_ids for r in engine.generate(prompts, mx.offline_params(3, 12, 0.0, seed=40))]
    assert greedy[0] == greedy[1] and greedy != first
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        engine.generate(prompts, params[:2])


def test_profiled_writes_its_tables_and_trace(tmp_path):
    import torch

    from pdserve.bench.engine.decode import profiled

    profiled(None, torch.device("cpu"), lambda: torch.ones(64).cumsum(0), str(tmp_path / "prof"))
    assert "aten::cumsum" in (tmp_path / "prof" / "by-self-cpu.txt").read_text()
    assert json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]
    assert not (tmp_path / "prof" / "by-device.txt").exists()  # no device on the CPU


@pytest.mark.parametrize("overlap", [True, False])
def test_transformers_decode_ab_reads_overlapped_steps(overlap):
    # the A/B's engine arm on an engine whose steps overlap (as on CUDA): a step returns the tokens of
    # the one before, none on the first; every round is still one step that decodes the whole batch
    import torch

    from pdserve.workers.engine.models import load_model

    loaded = load_model("tiny", None, "cpu")
    twin = steps.hf_twin(loaded.model)  # before the engine re-routes the original's attention
    engine = steps.make_engine(loaded, torch.device("cpu"), torch.float32, num_blocks=64, max_num_seqs=4,
                               overlap=overlap)
    assert engine.overlap is overlap
    args = argparse.Namespace(warmup=2, pairs=3, seed=0)
    row = steps.hf_decode_ab(engine, twin, 3, 64, loaded.model.config.vocab_size,
                             torch.device("cpu"), args)
    assert (row["batch"], row["context"]) == (3, 64)
    check_summary(row["ours_ms"], 3)
    check_summary(row["transformers_ms"], 3)
    assert row["ratio"] == row["paired"]["ratio"]["median"] > 0
    # the batch's requests: warmup + pairs tokens each, all read back; nothing left in flight or held
    assert row["ours_tokens"] == [2 + 3] * 3
    assert not engine.has_work() and engine.blocks.num_free == engine.blocks.num_blocks


def test_cpu_bench_against_generate_smoke(tmp_path, capsys):
    # `pdserve-bench cpu` with the tiny model: both arms every round, the same greedy tokens (float32),
    # and every derived figure recomputed from the rounds
    from pdserve.bench.engine import cpu

    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    out = tmp_path / "cpu.json"
    args = parser.parse_args(["--model", "tiny", "--threads", "1", "--batches", "1,2", "--prompt-tokens", "12",
                              "--new-tokens", "5", "--pairs", "3", "--out", str(out)])
    assert cpu.run(args) == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] and result["config"]["engine"]["overlap"] is False
    assert len(result["config"]["loadavg_start"]) == 3
    assert [(p["threads"], p["batch"]) for p in result["points"]] == [(1, 1), (1, 2)]
    for p in result["points"]:
        check_summary(p["transformers_ms_per_token"], 3)
        check_summary(p["ours_ms_per_token"], 3)
        per_round = [o / t for t, o in zip(p["transformers_ms_per_token"]["runs"], p["ours_ms_per_token"]["runs"])]
        assert p["ratio"] == p["paired"]["ratio"]["median"] == pytest.approx(statistics.median(per_round))
        assert [sorted(o) for o in p["orders"]] == [["ours", "transformers"]] * 3
        assert p["tokens_agree"] == [True] * 3 and len(p["loadavg_1m"]) == 3
        assert p["floor_ms"]["median"] > 0 and p["ours_over_floor"] == p["ours_ms_per_token"]["median"] / p[
            "floor_ms"]["median"]
    t = result["target"]
    assert t["measured"] == {"1": result["points"][0]["ratio"]} and t["met"] is (result["points"][0]["ratio"] <= 1.0)
    assert "| 1 | 2 |" in capsys.readouterr().out


def test_cpu_bench_serves_the_same_prompts_through_pdserve(tmp_path, capsys):
    # --served: a third arm through a pdserve server the bench starts (tiny), in every round with the same
    # prompts; its TPOT paired with transformers', its text that of transformers' greedy tokens. The server a
    # colocated worker alone with a small KV pool (--server-args): it starts sooner than the default's three workers
    from pdserve.bench.engine import cpu

    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    out = tmp_path / "cpu.json"
    flags = ["--prefill-workers", "0", "--decode-workers", "0", "--kv-memory-gb", "0.05"]
    args = parser.parse_args(["--model", "tiny", "--threads", "1", "--batches", "2", "--prompt-tokens", "12",
                              "--new-tokens", "5", "--pairs", "2", "--served", "--server-args", " ".join(flags),
                              "--out", str(out)])
    assert cpu.run(args) == 0
    result = json.loads(out.read_text())
    server = result["config"]["served"]["1"]
    assert server["command"][-4:] == ["--model", "tiny", "--threads", "1"] and "1 torch threads each" in server["ready"]
    assert server["command"][-4 - len(flags):-4] == flags and "colocated-0 on cpu;" in server["ready"]
    assert "prefill-0" not in server["ready"] and "decode-0" not in server["ready"]
    with pytest.raises(ValueError, match="give --served"):  # flags for a server that would not start
        cpu.run(parser.parse_args(["--model", "tiny", "--server-args", " ".join(flags)]))
    (p,) = result["points"]
    assert [sorted(o) for o in p["orders"]] == [["ours", "served", "transformers"]] * 2
    check_summary(p["served_ms_per_token"], 2)
    per_round = [s / t for t, s in zip(p["transformers_ms_per_token"]["runs"], p["served_ms_per_token"]["runs"])]
    assert p["served_ratio"] == pytest.approx(statistics.median(per_round))
    assert p["served_text_agrees"] == [True, True] and p["served_workers"] == ["colocated-0"]
    assert p["served_itl_ms"]["n"] == 2 * 2 * (5 - 1) and p["served_ttft_ms"]["n"] == 2 * 2
    assert result["target"]["served_measured"] is None and result["target"]["met"] is None  # no batch-1 point
    assert "| 1 | 2 |" in capsys.readouterr().out


def test_the_served_text_expected_is_the_workers_text_of_those_tokens():
    # what the worker streams for a request's tokens, special ones among them (<|im_end|>, <|im_start|>),
    # with the API's defaults: the bench's expectation of a served arm's text
    from pdserve.bench.engine.cpu_served import expected_text
    from pdserve.workers.engine.models import load_model
    from pdserve.workers.engine.request import Request, SamplingParams
    from pdserve.workers.engine.text import ModelText

    tokenizer = load_model("tiny", None, "cpu").tokenizer
    tokens = [282, 2801, 47, 2, 198, 1, 520]
    req = Request("r", [5, 6], SamplingParams(max_tokens=len(tokens), ignore_eos=True))
    text = ModelText(tokenizer, {2}, 2048)
    for t in tokens:
        req.output_ids.append(t)
        text.detokenize(req)
    assert expected_text(tokenizer, tokens) == req.text == " of sleep?\nass"


def test_the_transformers_arm_does_not_stop_at_the_models_eos():
    # generate() falls back to the model's EOS where the bench's config leaves it unset: a row that met it
    # was padded (batch > 1) or cut short (batch 1); make the model's EOS a token greedy decoding meets
    from pdserve.bench.engine import cpu
    from pdserve.bench.engine.steps import hf_twin
    from pdserve.workers.engine.models import load_model

    twin = hf_twin(load_model("tiny", None, "cpu").model)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    _, free = cpu.theirs(twin, prompts, 8)
    twin.generation_config.eos_token_id = [free[0][2], free[1][2]]
    for batch in (prompts, prompts[:1]):
        _, again = cpu.theirs(twin, batch, 8)
        assert again == free[:len(batch)]


def test_per_token_time_excludes_the_first_token():
    from pdserve.bench.engine.cpu import per_token_ms

    assert per_token_ms([10.0, 10.5, 10.7, 11.0]) == pytest.approx(1000 / 3)
    with pytest.raises(ValueError):
        per_token_ms([1.0])


def test_profile_decode_profiles_the_first_point_and_every_batch_1_point(tmp_path):
    """Points (1, 64), (2, 64), (1, 128), (2, 128): the first into the folder, (1, 128) into b1-128, no batch 2."""
    prof = tmp_path / "decode-prof"
    run(tmp_path, ["--model", "tiny", "--device", "cpu", "--lengths", "64", "--pairs", "1", "--batches", "1,2",
                   "--contexts", "64,128", "--mixed-batch", "0", "--repeats", "1", "--warmup", "0",
                   "--hf-decode-context", "0", "--chunk-decodes", "0", "--mixed-step", "",
                   "--profile-decode", str(prof)])
    for folder in (prof, prof / "b1-128"):
        table = (folder / "by-self-cpu.txt").read_text()
        assert "aten::" in table and (folder / "trace.json").stat().st_size > 0
    assert sorted(p.name for p in prof.iterdir() if p.is_dir()) == ["b1-128"]


def test_the_kernel_timeline_sums_a_profiled_runs_device_time():
    """kernel_timeline reads torch.profiler's chrome trace: busy time is the union of the kernels (overlapping
    streams count once), the rest of their span is gaps; kinds by name; per step where steps are given."""
    from pdserve.bench.engine.kernel_timeline import render, summarize

    k = lambda name, ts, dur, cat="kernel": {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}  # noqa: E731
    trace = {"traceEvents": [
        k("sm90_xmma_gemm_bf16", 0.0, 100.0), k("triton_red_fused_rms_norm_0", 102.0, 3.0),
        k("_paged_attention_kernel", 110.0, 20.0), k("Memcpy HtoD (Pinned -> Device)", 125.0, 10.0, "gpu_memcpy"),
        k("nvjet_tst_64x8_gemv", 140.0, 50.0), k("triton_poi_fused_silu_mul_1", 195.0, 4.0),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0}]}  # host events are not the device's
    s = summarize(trace, steps=2)
    assert s["kernels"] == 6 and s["span_us"] == 199.0
    # busy: 100 + 3 + [110, 135) (the copy overlaps attention) + 50 + 4 = 182; gaps 2 + 5 + 5 + 5 = 17
    assert s["busy_us"] == 182.0 and s["gap_us"] == 17.0
    assert {k: v["kernels"] for k, v in s["by_kind"].items()} == {"gemm": 2, "fused": 2, "attention": 1, "copy": 1}
    assert s["small_kernels"] == 2 and s["small_us"] == 7.0
    assert s["per_step"] == {"kernels": 3.0, "busy_us": 91.0, "gap_us": 8.5, "small_kernels": 1.0}
    assert s["top"][0]["name"] == "sm90_xmma_gemm_bf16" and s["top"][0]["kind"] == "gemm"
    text = render(s)
    assert "6 device kernels over 0.20 ms: busy 0.18 ms (91%)" in text and "per step (2): 3 kernels" in text
    assert render(summarize({"traceEvents": []})) == "no device kernels in the trace (a CPU run)"
    assert "(100%)" in render(summarize({"traceEvents": [k("triton_poi_0", 5.0, 0.0)]}))  # a span of 0


def test_the_chunked_scenarios_profile_holds_the_prompts_steps(monkeypatch, tmp_path):
    """--profile: the chunked run's window starts at its first chunk over a prefix and the unchunked run's at its
    prompt's step; each ends with the prompt's first token (six steps at most), so no decode-only step after it
    is profiled as the prompt's (with 8192-token chunks a 32k prompt takes 8 steps: a window from step 8 on held
    decode steps only)."""
    import torch

    from pdserve.bench.engine import decode as dec
    from pdserve.workers.engine.engine import Engine

    windows = []

    def recording(engine, device, fn, folder, steps=None):
        fn()
        windows.append((folder, steps() if callable(steps) else steps))

    monkeypatch.setattr(dec, "profiled", recording)
    scenario = dict(decodes=2, context=32, prompt=256, steady_steps=2, after_steps=1, seed=0, max_prefill_steps=12)
    for chunked, start in ((True, 1), (False, 0)):
        engine = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                     chunked_prefill=chunked, chunk_tokens=64, chunk_attention_tokens=0,
                                     prefix_cache=False))  # the second run computes the same prompt again
        plain = dec.chunked_scenario(engine, torch.device("cpu"), tag=f"plain-{chunked}", **scenario)
        seen = dec.chunked_scenario(engine, torch.device("cpu"), tag=f"prof-{chunked}", profile=str(tmp_path),
                                    profile_from=start, **scenario)
        assert seen["prefill_steps"] == plain["prefill_steps"]  # the window ran no step past the first token
        # chunked: 4 chunks of 64 (+ the step that reads the last one back), the first outside the window
        assert windows[-1] == (str(tmp_path), min(6, plain["prefill_steps"] - start))
    assert windows[0][1] >= 3  # the chunks over a prefix are in it


def test_the_attention_benchs_graphs_rotate_their_inputs(monkeypatch):
    """--graph N: each graph captures N calls on inputs of its own, consecutive replays read other inputs (none
    finds the last one's in L2), as many graphs as it takes to touch every input once, at most MAX_GRAPHS. CUDA's
    graph calls replaced by a recorder: which inputs each capture and each replay touched."""
    from pdserve.bench.engine import paged_attention as pa

    touched, capturing = [], []

    class Graph:
        def __init__(self):
            self.calls = []

        def replay(self):
            touched.append(list(self.calls))

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(g)
        yield
        capturing.pop()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    eager = []

    def call(i):
        (capturing[-1].calls if capturing else eager).append(i)

    replay = pa.graphed(call, 4, 10)  # 10 inputs, 4 calls a graph: 3 graphs
    assert eager == list(range(10))  # every input's call once before any capture
    for i in range(4):
        replay(i)
    assert touched == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]  # (the caller reads i % inputs)
    touched.clear()
    many = pa.graphed(call, 2, 1000)
    for i in range(pa.MAX_GRAPHS + 1):
        many(i)
    assert len({tuple(t) for t in touched}) == pa.MAX_GRAPHS and touched[0] == touched[-1]
