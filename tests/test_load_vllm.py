"""`pdserve-bench load` with `vllm bench serve`'s habits: its flag spellings folded into ours (or refused with
a reason), an API key sent to a server that requires one and never written down, --max-concurrency
honoured, and --save-result's flat file with vLLM's keys, equal to our own block."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.arms import Arm, with_cache_modes
from pdserve.bench.load.fake_server import FakeConfig, FakeServer
from pdserve.bench.load import vllm_compat
from pdserve.bench.load.vllm_compat import resolve

KEY = "sk-test-0123456789abcdef"
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests")


def _args(argv: list[str], environ: dict | None = None):
    p = argparse.ArgumentParser()
    generator.add_arguments(p)
    args = p.parse_args(argv)
    resolve(args, environ=environ or {})
    return args


def test_vllm_spellings_fold_into_ours():
    a = _args(["--host", "10.0.0.5", "--port", "9001", "--backend", "openai-chat", "--dataset-name", "random",
               "--random-input-len", "1000", "--random-output-len", "100", "--random-range-ratio", "0.25"])
    assert a.base_url == "http://10.0.0.5:9001" and a.chat and a.endpoint == "/v1/chat/completions"
    assert a.dataset == "synthetic" and a.input_len == "uniform:750:1250" and a.output_len == "uniform:75:125"
    d = _args([])
    assert d.base_url == "http://127.0.0.1:8000" and not d.chat and d.backend == "openai"
    assert (d.input_len, d.output_len, d.num_prompts) == ("1024", "128", 100)  # vLLM's random defaults, our count
    assert _args(["--random-input-len", "64"]).input_len == "64"
    assert _args(["--endpoint", "v1/chat/completions"]).backend == "openai-chat"
    assert not _args(["--backend", "vllm"]).chat  # vLLM's older name for openai
    assert _args(["--dataset", "multiturn"]).chat  # multi-turn speaks chat unless told otherwise
    assert not _args(["--dataset", "multiturn", "--backend", "openai"]).chat


def test_api_key_and_headers():
    assert _args([], {"OPENAI_API_KEY": KEY}).headers == {"Authorization": f"Bearer {KEY}"}
    assert _args(["--api-key", "other"], {"OPENAI_API_KEY": KEY}).headers == {"Authorization": "Bearer other"}
    h = _args(["--header", "x-a=1", "Authorization=Bearer mine", "--header", "x-b=2"], {"OPENAI_API_KEY": KEY}).headers
    assert h == {"x-a": "1", "Authorization": "Bearer mine", "x-b": "2"}  # an explicit Authorization wins
    assert _args([]).headers == {}


@pytest.mark.parametrize("argv, match", [
    (["--backend", "tgi"], "OpenAI's HTTP API only"),
    (["--endpoint", "/v1/embeddings"], "only /v1/completions"),
    (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "but --endpoint says"),
    (["--base-url", "http://x:1", "--port", "2"], "not both"),
    (["--random-input-len", "10", "--input-len", "20"], "not both"),
    (["--random-range-ratio", "1.0"], r"\[0, 1\)"),
    (["--random-range-ratio", "0.5", "--input-len", "20"], "uniform:LO:HI"),
    (["--dataset-name", "sharegpt", "--random-input-len", "10"], "random only"),
    (["--ignore-eos", "--no-ignore-eos"], "contradict"),
    (["--percentile-metrics", "ttft,goodness"], "subset of ttft,tpot,itl,e2el"),
    (["--result-dir", "x"], "add --save-result"),
    (["--max-concurrency", "2", "--concurrency", "4"], "give one of them"),
    (["--max-concurrency", "0"], ">= 1"),
    (["--header", "novalue"], "KEY=VALUE"),
])
def test_what_cannot_be_honoured_is_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        _args(argv)


def test_vllm_only_dataset_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        _args(["--dataset-name", "sonnet"])
    assert "'sonnet' dataset is not implemented here" in capsys.readouterr().err


def test_the_key_never_reaches_the_record():
    argv = ["--api-key", KEY, "--header", "Authorization=Bearer x", "x-k=v", "--num-prompts", "3",
            f"--api-key={KEY}"]
    shown = generator.redacted(argv)
    assert KEY not in " ".join(shown) and "Bearer" not in " ".join(shown)
    assert shown[-3:-1] == ["--num-prompts", "3"]


def test_cache_arms_carry_the_worker_flags():
    arms = [Arm.parse("colocated=colocated:--colocated-workers 1"),
            Arm.parse("disaggregated=disaggregated:--no-colocated")]
    out = with_cache_modes(arms, ["cache-off", "gpu", "gpu+host", "gpu+host+disk"], host_gb=8, disk_dir="/d",
                           disk_gb=20)
    assert [a.label for a in out] == [f"{p}:{m}" for p in ("colocated", "disaggregated")
                                      for m in ("cache-off", "gpu", "gpu+host", "gpu+host+disk")]
    assert out[0].server_args == ("--colocated-workers", "1", "--worker-arg=--no-prefix-cache")
    assert out[1].server_args == ("--colocated-workers", "1")
    assert out[2].server_args[-1] == "--worker-arg=--host-cache-gb=8"
    assert out[7].server_args[-2:] == ("--worker-arg=--disk-cache-dir=/d/disaggregated_gpu+host+disk",
                                       "--worker-arg=--disk-cache-gb=20")
    assert all(a.policy == "disaggregated" for a in out[4:])
    assert Arm.parse("colocated:gpu=colocated:").label == "colocated:gpu"
    with pytest.raises(ValueError, match="needs --cache-host-gb"):
        with_cache_modes(arms, ["gpu+host"])
    with pytest.raises(ValueError, match="unknown cache mode"):
        with_cache_modes(arms, ["gpu+ssd"])
    with pytest.raises(ValueError, match="its own server"):
        with_cache_modes([Arm("colocated", "colocated")], ["gpu"])


def test_vllm_flags_against_a_server_that_wants_a_key(tmp_path, monkeypatch):
    out, results = tmp_path / "run", tmp_path / "vllm"
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeServer(FakeConfig(itl_ms=2.0, prefill_ms_per_token=0.5, api_key=KEY)) as srv:
        rc = generator.main(["--host", "127.0.0.1", "--port", str(srv.port), "--backend", "openai-chat",
                        "--dataset-name", "random", "--random-input-len", "40", "--random-output-len", "5",
                        "--num-prompts", "8", "--request-rate", "inf", "--max-concurrency", "2", "--seed", "1",
                        "--ignore-eos", "--save-result", "--result-dir", str(results), "--result-filename", "r.json",
                        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
                        "--warmup-batch", "1", "--warmup-max-batches", "2", "--out", str(out), "--disable-tqdm",
                        "--no-plots"])
        bodies = list(srv.bodies)
    assert rc == 0
    assert all("messages" in b and b["ignore_eos"] is True for b in bodies)  # chat, and every request got in
    run = json.loads((out / "results.json").read_text())
    assert KEY not in (out / "results.json").read_text() and KEY not in (out / "summary.md").read_text()
    assert run["args"]["api_key"] is None and run["args"]["header_names"] == ["Authorization"]
    (block,) = run["results"]
    assert block["completed"] == 8 and block["max_concurrency"] == 2
    # at most 2 in flight: no moment is inside more than 2 requests' [start, end)
    spans = [(r["start_s"], r["start_s"] + r["e2e_s"]) for r in block["requests"]]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) == 2
    flat = json.loads((results / "r.json").read_text())
    assert set(VLLM_KEYS) <= set(flat)
    assert flat["backend"] == flat["endpoint_type"] == "openai-chat" and flat["request_rate"] == "inf"
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90"):
            assert flat[f"{stat}_{m}_ms"] == block[f"{stat}_{m}_ms"]
    assert "p99_ttft_ms" not in flat  # only the asked percentiles, as vLLM writes them
    assert all(not isinstance(v, (list, dict)) for v in flat.values())  # flat, as vLLM's tools read it
    # vLLM's peaks count whole seconds (a request in every second it touched), so they may pass the cap
    assert flat["max_concurrent_requests"] >= 2 and flat["max_output_tokens_per_s"] >= 5


def test_without_the_key_the_run_fails_saying_why(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeServer(FakeConfig(itl_ms=1.0, api_key=KEY)) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--model", "fake-model", "--num-prompts", "2", "--input-len", "8",
                        "--output-len", "2", "--warmup-batch", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 1
    assert "401" in capsys.readouterr().err


def test_result_file_names_follow_vllm():
    args = argparse.Namespace(result_dir=None, out="o", result_filename=None, label=None, backend="openai")
    blocks = [{"arm": "colocated:gpu+host", "phase": "point", "request_rate": 2.0, "max_concurrency": None},
              {"arm": "disaggregated", "phase": "sweep", "request_rate": None, "max_concurrency": 8}]
    run = {"results": blocks[:1], "model_id": "org/qwen2.5-7b", "date": "20261201-101010"}
    assert [p.as_posix() for p in vllm_compat.result_paths(run, args)] == ["o/openai-2qps-qwen2.5-7b-20261201-101010.json"]
    run["results"] = blocks
    assert [p.name for p in vllm_compat.result_paths(run, args)] == [
        "openai-colocated_gpu+host-00-point-2qps-qwen2.5-7b-20261201-101010.json",
        "openai-disaggregated-01-sweep-infqps-concurrency8-qwen2.5-7b-20261201-101010.json"]
    args.result_filename, args.result_dir = "mine.json", "d"
    assert [p.as_posix() for p in vllm_compat.result_paths(run, args)] == ["d/mine-00-colocated_gpu+host.json",
                                                                         "d/mine-01-disaggregated.json"]


@pytest.mark.parametrize("argv", [["--temperature", "0"], ["--save-detailed"], ["--num-warmups", "3"],
                                  ["--ramp-up-strategy", "linear"]])
def test_vllm_flags_without_a_counterpart_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"vLLM's {argv[0]} is not supported by pdserve-bench load: " in err, err
