"""Running pdserve as an operator does: --help and --version, the workers' warm-up and log lines,
one log format, and a Ctrl-C that logs no warning.

- `pdserve --help` (and `pdserve router`, `pdserve-worker`) shows the defaults, never the API key
  of the environment; `--version` on both commands names pdserve's version and protocol;
  `--config FILE` on each: YAML keys are the flags, the command line wins, a bad file is refused.
- warm_up() on a tiny engine (no server): a real request runs and leaves the pool as it found it
  (every block free, nothing in the prefix cache, no request left); the startup line's figures.
- StatsLine: a line per interval while there is work, one more once it ends, none while idle.
- A live server (tiny, router + prefill + decode + colocated worker, every process real): each worker
  warms up and logs its KV capacity and its start's parts (the warm-up request's among them) before
  it registers, logs stats lines while requests run;
  SIGINT (a terminal's Ctrl-C) ends it with code 0 and every worker gone, and its whole stderr is
  lines of the one log format at INFO: no warning, no error, no traceback.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version as installed

import pytest

from test_server_harness import ROOT, TINY, Pdserve, wait_gone  # pytest puts tests/ on sys.path
from pdserve.protocol import control as P
from pdserve.workers.status_log import StatsLine

LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO) [\w.]+: .*")


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_help_shows_defaults_but_never_the_api_key():
    import os

    secret = "s3cret-from-the-environment-0123"
    env = {**os.environ, "PDSERVE_API_KEY": secret}
    out = run("-m", "pdserve.server.cli", "--help", env=env)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for shown in ("(default: 8000)", "(default: auto)", "(default: 30.0)", "(default: 10.0)", "(default: ipc)"):
        assert shown in text, f"{shown} missing from pdserve --help"
    assert secret not in out.stdout and "default: $PDSERVE_API_KEY" in text
    router = run("-m", "pdserve.server.cli", "router", "--help", env=env)
    assert router.returncode == 0 and "(default: tcp://127.0.0.1:7100)" in " ".join(router.stdout.split())
    assert secret not in router.stdout
    worker = run("-m", "pdserve.workers.cli", "--help")
    assert worker.returncode == 0
    assert "(default: 16)" in " ".join(worker.stdout.split())  # --block-size


def test_version_of_both_commands():
    want = f"{installed('pdserve')} (control protocol {P.PROTOCOL_VERSION})"
    for module, prog in (("pdserve.server.cli", "pdserve"), ("pdserve.workers.cli", "pdserve-worker")):
        out = run("-m", module, "--version")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{prog} {want}"


def test_config_file_keys_are_the_flags_and_the_command_line_wins(tmp_path):
    from pdserve.server.cli import pdserve_parser, router_parser
    from pdserve.settings.cli import parse_args
    from pdserve.workers.cli import serve_parser

    cfg = tmp_path / "pdserve.yaml"
    cfg.write_text("model: tiny\nmax-num-seqs: 8\nno_colocated: true\nno-warmup: false\n"
                   "worker-arg: [--handshake-timeout, 10]\nstats-interval: 2.5\n")
    args = parse_args(pdserve_parser(), ["--config", str(cfg), "--max-num-seqs", "4"])
    assert (args.model, args.max_num_seqs, args.no_colocated, args.warmup) == ("tiny", 4, True, True)
    assert args.worker_arg == ["--handshake-timeout", "10"] and args.stats_interval == 2.5
    assert args.port == 8000  # not in the file: the default
    router = tmp_path / "router.yaml"
    router.write_text("keys: /etc/pdserve/router\nregister: tcp://10.0.0.1:7100\n")
    args = parse_args(router_parser(), ["--config", str(router)])
    assert (args.keys, args.register) == ("/etc/pdserve/router", "tcp://10.0.0.1:7100")
    worker = tmp_path / "worker.yaml"
    worker.write_text("role: decode\nkeys: /k\nkv-port: 7300\n")
    args = parse_args(serve_parser(), ["--config", str(worker), "--role", "prefill"])
    assert (args.role, args.keys, args.kv_port) == ("prefill", "/k", 7300)
    for text, says in (("bogus: 1\n", "'bogus' is not a flag of pdserve"),
                       ("no-colocated: 3\n", "'no-colocated' is an on/off flag"),
                       ("- a\n", "must be a mapping"), ("port: [1, 2\n", "is not YAML")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        out = run("-m", "pdserve.server.cli", "--config", str(bad))
        assert out.returncode == 2 and says in out.stderr, out.stderr


def test_warm_up_runs_a_request_and_leaves_the_pool_as_it_was():
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.status_log import startup_line
    from pdserve.workers.warmup import warm_up

    engine = Engine(EngineConfig(model="tiny", num_blocks=64))
    free = engine.blocks.num_free
    assert warm_up(engine) > 0
    assert engine.blocks.num_free == free == engine.blocks.num_blocks
    assert engine.blocks.num_cached == 0 and engine.requests == {}
    line = startup_line("colocated-0", "colocated", engine)
    lay = engine.layout
    assert f"KV cache {engine.blocks.num_blocks} blocks x {lay.block_size} tokens = " \
           f"{engine.blocks.num_blocks * lay.block_size} tokens" in line
    assert f"max concurrency {engine.config.max_num_seqs} requests" in line
    assert f"for requests of max_model_len {engine.max_model_len} tokens" in line


def test_stats_line_while_there_is_work_and_once_after():
    s = StatsLine("w0", interval_s=10.0)
    assert s.maybe_log(0, 0, 10, 10) is None  # the interval has not passed
    s._since -= 10
    assert s.maybe_log(0, 0, 10, 10) is None  # idle: nothing to say
    s.received(P.Generate("r1", [1] * 40, P.Sampling()))
    s.sent(P.Tokens("w0", [P.TokenOut("r1", 5, "a")] * 20))
    s._since -= 10
    line = s.maybe_log(running=2, waiting=1, free_blocks=6, num_blocks=8)
    assert re.search(r"prompt throughput 4\.0 tokens/s, generation throughput 2\.0 tokens/s, running 2 reqs, "
                     r"waiting 1 reqs, KV cache usage 25\.0% \(2/8 blocks\)", line), line
    s._since -= 10
    hits = P.CacheFigures(queried_tokens=100, gpu_hit_tokens=30, tier_hit_tokens={"host": 10})
    assert ", prefix cache hit rate 40.0%" in s.maybe_log(1, 0, 8, 8, hits)
    s._since -= 10
    more = P.CacheFigures(queried_tokens=150, gpu_hit_tokens=30, tier_hit_tokens={"host": 15})
    assert ", prefix cache hit rate 10.0%" in s.maybe_log(1, 0, 8, 8, more)  # this interval's: 5 of 50
    s._since -= 10
    assert "generation throughput 0.0 tokens/s" in s.maybe_log(0, 0, 8, 8)  # the load ended
    s._since -= 10
    assert s.maybe_log(0, 0, 8, 8) is None
    assert StatsLine("w0", interval_s=0).maybe_log(5, 5, 0, 8) is None  # 0: never


@pytest.mark.timeout(300)
def test_live_warm_up_startup_and_stats_lines_then_a_quiet_ctrl_c():
    srv = Pdserve(*TINY, "--stats-interval", "0.5").__enter__()
    try:
        health = srv.health()
        for policy in ("colocated", "disaggregated"):
            r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True,
                                             "policy": policy})
            assert r.status_code == 200, r.text
        time.sleep(1.5)  # a stats interval after the requests
        pids = srv.worker_pids()
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.proc.wait(timeout=60)
        gone = not wait_gone(pids.values(), 15.0)
        log = srv.log_text()
    finally:
        srv.kill()
    assert rc == 0, log[-4000:]
    assert gone, f"workers outlived pdserve\n{log[-4000:]}"
    lines = [line for line in log.splitlines() if line.strip()]
    odd = [line for line in lines if not LOG_LINE.fullmatch(line)]
    assert not odd, "stderr lines outside the log format, or not at INFO:\n" + "\n".join(odd[:20])
    for w in health["workers"]:
        wid = w["id"]
        startup = next(i for i, line in enumerate(lines) if f"{wid}: {w['role']} on cpu" in line)
        registered = next(i for i, line in enumerate(lines) if f"{wid}: registered with the router" in line)
        assert startup < registered
        assert f"KV cache {w['num_blocks']} blocks x {w['block_size']} tokens = " \
               f"{w['num_blocks'] * w['block_size']} tokens" in lines[startup]
        warmed = re.search(r"warm-up request ([\d.]+) s", lines[startup])  # warmed up before it registered
        assert warmed and float(warmed[1]) > 0, lines[startup]
        frozen = next(i for i, line in enumerate(lines) if f"{wid}: " in line and "objects of the start frozen" in line)
        assert startup < frozen < registered  # the start's objects frozen out of garbage collection before serving
        assert int(re.search(r"(\d+) objects of the start frozen", lines[frozen])[1]) > 10_000, lines[frozen]
    stats = [line for line in lines if "generation throughput" in line]
    for wid in ("colocated-0", "decode-0"):
        assert any(f"{wid}: prompt throughput" in line and "generation throughput 0.0" not in line for line in stats), \
            f"no stats line of {wid} with tokens generated:\n" + "\n".join(stats)
    assert any("SIGINT; draining, then shutting down" in line for line in lines)
