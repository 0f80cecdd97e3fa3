"""A newcomer's first hour, each snag a test: torch threads defaulted from the cores and the workers
pdserve starts (and said in the ready line); every worker flag taken by `pdserve` itself; a bad flag or
a bad model answered in one line (with "did you mean" and pdserve's spelling of vLLM's flags) before
anything starts; --served-model-name; the default max_tokens settable; /docs; `pdserve-client
--host/--port`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_server_harness import ROOT, Pdserve
from pdserve.client import cli as client_cli
from pdserve.server import cli
from pdserve.workers.cli import serve_parser

pytestmark = pytest.mark.timeout(300)

CORES = len(os.sched_getaffinity(0))
# pdserve-worker flags that are each worker's own, set by pdserve per worker (or the router's)
PER_WORKER = {"--role", "--control", "--router", "--advertise-host", "--worker-id", "--parent-pid", "--run-dir",
              "--keys", "--worker-config", "--kv-host", "--kv-port", "--model", "--log-level", "--config",
              "--version", "--help", "-h"}


def run_pdserve(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.server.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_threads_default_to_the_cores_shared_among_the_workers(tmp_path):
    assert cli.default_threads(1) == CORES and cli.default_threads(3) == max(1, CORES // 3)
    assert cli.default_threads(4 * CORES) == 1

    def threads(*argv: str) -> list[int]:
        args = cli.pdserve_parser().parse_args(list(argv))
        specs = cli.plan(args, ["cpu"], {"prefill": 1, "decode": 1, "colocated": 1}, "ipc:///x", str(tmp_path))
        return [s.engine.threads for s in specs]

    assert threads() == [max(1, CORES // 3)] * 3
    assert threads("--threads", "5") == [5] * 3


def test_pdserve_takes_every_worker_flag(tmp_path):
    worker = {o for a in serve_parser()._actions for o in a.option_strings} - PER_WORKER
    ours = set(cli.pdserve_parser()._option_string_actions)
    assert not worker - ours, f"pdserve-worker flags pdserve does not take: {sorted(worker - ours)}"
    args = cli.pdserve_parser().parse_args(["--no-prefix-cache", "--chunk-tokens", "64", "--host-cache-gb", "1",
                                            "--disk-cache-dir", str(tmp_path), "--no-chunked-prefill"])
    [spec] = cli.plan(args, ["cpu"], {"colocated": 1}, "ipc:///x", str(tmp_path))
    e = spec.engine
    assert (e.prefix_cache, e.chunk_tokens, e.host_cache_gb, e.disk_cache_dir, e.chunked_prefill) == \
        (False, 64, 1.0, str(tmp_path), False)


def test_the_chunk_budget_without_a_flag_is_the_devices_measured_one(tmp_path):
    """No --chunk-tokens: each worker's budget follows the device the router gives it after parsing (8192 on
    CUDA, the best of the H200 capacity sweep; 512 on the CPU), an explicit one holds on every device."""
    from pdserve.settings.worker import CHUNK_TOKENS

    args = cli.pdserve_parser().parse_args([])
    cpu, gpu = (cli.plan(args, [d], {"colocated": 1}, "ipc:///x", str(tmp_path))[0].engine for d in ("cpu", "cuda:0"))
    assert (cpu.chunk_tokens, gpu.chunk_tokens) == (None, None)
    assert (cpu.step_chunk_tokens, gpu.step_chunk_tokens) == (CHUNK_TOKENS["cpu"], CHUNK_TOKENS["cuda"]) == (512, 8192)
    args = cli.pdserve_parser().parse_args(["--chunk-tokens", "2048"])
    [spec] = cli.plan(args, ["cuda:0"], {"colocated": 1}, "ipc:///x", str(tmp_path))
    assert spec.engine.step_chunk_tokens == 2048


@pytest.mark.parametrize("argv,words", [
    (["--gpu-memory-utilization", "0.9"], "--kv-memory-gb"),
    (["--max-model-length", "4096"], "--max-model-len"),
    (["serve", "tiny"], "pdserve --model MODEL"),
    (["--chunk-tokenz", "64"], "did you mean --chunk-tokens?"),
    (["--tensor-parallel-size", "2"], "--devices"),
    (["tiny"], "--model tiny"),
    (["--port", "eighty"], "invalid int value"),
])
def test_a_bad_flag_is_one_line_that_says_what_to_type(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.pdserve_parser().parse_args(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: ") and words in lines[0], err
    assert "--help" in lines[0]


def test_the_command_itself_says_one_line():
    r = run_pdserve("--gpu-memory-utilization", "0.9")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--kv-memory-gb" in r.stderr


def test_a_bad_model_is_one_line_before_any_worker_starts(tmp_path):
    for model, words in [("llama-3-8b", "unknown model 'llama-3-8b'"), (str(tmp_path), "holds no config.json")]:
        r = run_pdserve("--model", model, "--port", "0")
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and words in lines[0], r.stderr
        assert "Traceback" not in r.stderr and "starting" not in r.stderr
    assert cli.keygen([str(tmp_path / "keys")]) == 0
    r = run_pdserve("router", "--keys", str(tmp_path / "keys" / "router"), "--model", "llama-3-8b", "--port", "0")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "llama-3-8b" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_served_model_name_default_max_tokens_docs_and_the_client(tmp_path):
    with Pdserve("--model", "tiny", "--num-blocks", "256", "--prefill-workers", "0", "--decode-workers", "0",
                 "--served-model-name", "tiny-chat", "--default-max-tokens", "3",
                 "--default-chat-max-tokens", "5") as srv:
        ready = next(line for line in srv.stdout if line.startswith("pdserve ready:"))
        assert f"{CORES} torch threads each ({CORES} cores / 1 workers)" in ready and "as tiny-chat" in ready, ready
        assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["tiny-chat"]
        assert srv.get("/v1/models/tiny-chat").status_code == 200
        out = srv.post("/v1/completions", {"model": "tiny-chat", "prompt": "Hello", "ignore_eos": True}).json()
        assert out["model"] == "tiny-chat" and out["usage"]["completion_tokens"] == 3, out
        assert set(out["timings"]["reused_tokens"]) == {"device", "host", "disk"}, out["timings"]  # no "gpu" on a CPU
        chat = srv.post("/v1/chat/completions", {"model": "tiny", "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["usage"]["completion_tokens"] == 5, chat
        r = srv.post("/v1/completions", {"model": "other", "prompt": "Hello"})
        assert r.status_code == 404 and "tiny-chat" in r.json()["error"]["message"]
        docs = srv.get("/docs")
        assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
        assert "continuous_usage_stats" in docs.text and "/v1/chat/completions" in docs.text
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        run = subprocess.run([sys.executable, "-m", "pdserve.client.cli", "Hello", "--host", host, "--port", port,
                              "--max-tokens", "2", "--ignore-eos"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0 and "completion_tokens=2" in run.stdout, run.stdout + run.stderr
    assert not Path(srv.log.name).exists(), "a passing test left its pdserve log behind"


@pytest.mark.parametrize("make", [cli.pdserve_parser, cli.router_parser, client_cli.build_parser],
                         ids=["pdserve", "pdserve router", "pdserve-client"])
def test_help_shows_every_default(make):
    p = make()
    formatter = p._get_formatter()  # argparse's own, as --help formats each option
    hidden = [a.option_strings[0] for a in p._actions
              if a.option_strings and a.nargs != 0 and a.default not in (None, [], argparse.SUPPRESS)
              and "default" not in (formatter._expand_help(a) if a.help else "")]
    assert not hidden, f"{p.prog} --help shows no default for {hidden}"


def test_one_metric_prefix():
    from pdserve.server.metrics import Metrics

    names = [m.name for m in Metrics("tiny").registry.collect()]
    odd = [n for n in names if not (n.startswith("pdserve_") or n.startswith("vllm:"))]
    assert names and not odd, f"metrics outside pdserve_* and vLLM's vllm:*: {odd}"
