"""Flags derived from the config dataclasses (settings/flags.py), and the config pdserve hands its workers.

    names and defaults   every flag of pdserve, pdserve router and pdserve-worker, as users know them;
                         no flag parsed with nothing given differs from its field's default
    declared once        a flag pdserve offers for its workers is the worker's own, same help text
    round trip           parsed flags -> config; on/off flags; --max-body-mb in MiB, --min-body-rate in
                         KiB/s; --expect-workers
    the handoff          the launcher's 0600 JSON file: the whole WorkerConfig, no key material (the key
                         folder's path goes as --keys); the worker reads it back, --worker-arg extras on
                         top; the same command for every start of a worker
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import fields, replace

import pytest

from pdserve.settings.keys import new_deployment, write_worker_keys
from pdserve.settings.worker import EngineConfig, TransferConfig, WorkerConfig, read_worker_config, write_worker_config
from pdserve.settings.flags import FLAG, from_args, option
from pdserve.server import cli as server_cli
from pdserve.server import launcher as L
from pdserve.settings.router import RouterConfig
from pdserve.workers import cli as W

WORKER_FLAGS = {
    "--advertise-host", "--attention", "--block-size", "--chunk-attention-tokens", "--chunk-tokens", "--config", "--control", "--device",
    "--disk-cache-dir", "--disk-cache-gb", "--dtype", "--fuse-gate-up", "--graphs", "--handshake-timeout", "--help", "--host-cache-gb", "--keys",
    "--kv-checksum", "--kv-host", "--kv-memory-gb", "--kv-plaintext", "--kv-port", "--kv-staging-gb", "--kv-streams",
    "--log-level",
    "--max-batched-tokens", "--max-model-len", "--max-num-seqs", "--mode", "--model", "--no-chunked-prefill", "--no-compile", "--no-prefix-cache",
    "--no-warmup", "--num-blocks", "--parent-pid", "--role", "--router", "--run-dir", "--stats-interval",
    "--step-trace", "--threads", "--transport", "--version", "--worker-config", "--worker-id"}
ROUTER_FLAGS = {
    "--allowed-hosts", "--body-timeout", "--chat-special-tokens", "--client-share", "--header-timeout",
    "--max-bodies-mb", "--max-connections", "--min-body-rate", "--send-timeout",  # the front door (server/guard.py,
    # bodies.py, connections.py), chat text (server/tokenizer.py)
    "--access-log", "--api-key", "--api-key-file", "--auto-threshold", "--config", "--drain-timeout",
    "--expect-workers", "--failover", "--heartbeat-interval", "--heartbeat-misses", "--help", "--host",
    "--kv-deadline", "--log-level", "--max-body-mb", "--max-inflight-requests", "--max-inflight-tokens", "--migrate",
    "--model", "--parent-pid", "--policy", "--port", "--public-metrics", "--register", "--retry-after", "--routing",
    "--token-timeout", "--default-max-tokens", "--default-chat-max-tokens", "--served-model-name",
    "--tokenizer", "--version"}
# pdserve's own worker flags; beside them it takes every flag of pdserve-worker but those that name one
# worker's identity, endpoints or files (the launcher sets those for each worker)
PDSERVE_OWN_WORKER_FLAGS = {"--colocated-workers", "--decode-workers", "--devices", "--no-colocated", "--no-restart",
                            "--prefill-workers", "--startup-timeout", "--worker-arg"}
PER_WORKER_FLAGS = {"--advertise-host", "--control", "--keys", "--kv-host", "--kv-port", "--role", "--router",
                    "--run-dir", "--worker-config", "--worker-id"}
PDSERVE_WORKER_FLAGS = PDSERVE_OWN_WORKER_FLAGS | (WORKER_FLAGS - PER_WORKER_FLAGS)


def flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings if s.startswith("--")}


def test_every_flag_keeps_its_name_and_default():
    assert set(flags(W.serve_parser())) == WORKER_FLAGS
    assert set(flags(server_cli.router_parser())) == ROUTER_FLAGS | {"--keys"}
    assert set(flags(server_cli.pdserve_parser())) == ROUTER_FLAGS | PDSERVE_WORKER_FLAGS
    args = W.serve_parser().parse_args(["--role", "decode", "--keys", "/k"])
    assert (args.block_size, args.max_num_seqs, args.chunk_tokens, args.kv_host, args.kv_port) == (16, 64, None,
                                                                                                 "127.0.0.1", 0)
    assert (args.handshake_timeout, args.stats_interval, args.router) == (30.0, 10.0, "tcp://127.0.0.1:7100")
    assert args.warmup and args.compile and args.prefix_cache and args.chunked_prefill and args.dtype is None
    assert args.graphs == "all"  # every graph before ready, until a GPU A/B says otherwise
    assert W.worker_config(args) == replace(WorkerConfig("decode", worker_id=args.worker_id),
                                            engine=EngineConfig(kv_shared=True))
    pd = server_cli.pdserve_parser().parse_args([])
    assert (pd.register, pd.device, pd.port, pd.max_body_mb, pd.expect_workers) == (None, None, 8000, 4 * 2**20, None)
    assert server_cli.router_parser().parse_args([]).register == RouterConfig.register == "tcp://127.0.0.1:7100"
    assert server_cli.router_config(server_cli.router_parser().parse_args([]), None) == RouterConfig()


def test_only_the_flags_of_no_config_are_written_by_hand():
    derived = {option(f)[0] for cls in (EngineConfig, TransferConfig, WorkerConfig, RouterConfig) for f in fields(cls)
               if FLAG in f.metadata}
    common = {"--config", "--help", "--version", "--log-level"}
    assert set(flags(W.serve_parser())) - derived == common | {"--worker-config", "--keys"}
    # (and --parent-pid, pdserve's own: the name of a WorkerConfig flag too, so not in this difference)
    assert set(flags(server_cli.pdserve_parser())) - derived == common | {
        "--host", "--port", "--api-key-file", "--access-log", "--devices", "--prefill-workers",
        "--decode-workers", "--colocated-workers", "--no-colocated", "--worker-arg", "--no-restart",
        "--startup-timeout"}
    assert flags(W.serve_parser())["--worker-config"].help.startswith("internal")


def test_the_flags_pdserve_offers_its_workers_are_the_workers_own():
    worker, pdserve = flags(W.serve_parser()), flags(server_cli.pdserve_parser())
    shared = set(worker) & set(pdserve) - {"--config", "--help", "--version", "--log-level", "--parent-pid", "--model"}
    assert shared == set(worker) - PER_WORKER_FLAGS - {"--config", "--help", "--version", "--log-level",
                                                       "--parent-pid", "--model"}
    assert {"--chunk-tokens", "--host-cache-gb", "--no-prefix-cache", "--disk-cache-dir"} <= shared  # the README's
    # --device: one for every worker, default dealt from --devices; --threads: default the cores shared among them
    for name in shared - {"--device", "--threads"}:
        w, p = worker[name], pdserve[name]
        assert (w.help, w.default, w.choices, w.type, w.dest) == (p.help, p.default, p.choices, p.type, p.dest), name
    assert pdserve["--device"].default is None and worker["--device"].default == "cpu"
    assert pdserve["--threads"].default is worker["--threads"].default is None  # None: each picks its own share
    assert pdserve["--threads"].type is worker["--threads"].type and "shared among the workers" in pdserve["--threads"].help
    assert worker["--model"].help == pdserve["--model"].help  # one text for the router's and the engine's model


def test_parsed_flags_build_the_configs():
    args = W.serve_parser().parse_args(["--role", "prefill", "--keys", "/k", "--no-compile", "--no-warmup",
                                        "--kv-port", "7300", "--handshake-timeout", "5", "--dtype", "float16",
                                        "--transport", "zmq", "--threads", "2"])
    cfg = W.worker_config(args)
    assert (cfg.engine.compile, cfg.engine.fuse_qkv, cfg.engine.dtype, cfg.engine.threads) == (False, False,
                                                                                              "float16", 2)
    assert (cfg.transfer.port, cfg.transfer.deadline_s, cfg.transfer.transport) == (7300, 5.0, "zmq")
    on = W.worker_config(W.serve_parser().parse_args(["--role", "decode", "--keys", "/k", "--fuse-gate-up"]))
    off = W.worker_config(W.serve_parser().parse_args(["--role", "decode", "--keys", "/k", "--fuse-gate-up",
                                                       "--no-compile"]))
    assert on.engine.fuse_gate_up and not off.engine.fuse_gate_up  # --no-compile drops the fused projections
    assert not W.worker_config(W.serve_parser().parse_args(["--role", "decode", "--keys", "/k"])).engine.fuse_gate_up
    assert not cfg.warmup and not cfg.engine.kv_shared  # /dev/shm only for ipc
    with pytest.raises(SystemExit):
        W.serve_parser().parse_args(["--keys", "/k"])  # --role is required without --worker-config
    with pytest.raises(SystemExit):
        W.serve_parser().parse_args(["--role", "chef", "--keys", "/k"])

    args = server_cli.router_parser().parse_args(["--max-body-mb", "0.5", "--expect-workers", "prefill=2,decode=1",
                                         "--public-metrics", "--failover", "--heartbeat-interval", "0.25",
                                         "--min-body-rate", "1.5", "--client-share", "0.5"])
    cfg = server_cli.router_config(args, None)
    assert (cfg.max_body_bytes, cfg.expected_workers) == (2**19, {"prefill": 2, "decode": 1})
    assert (cfg.min_body_rate, cfg.client_share, cfg.client_bodies_bytes) == (1536, 0.5, 32 * 2**20)
    assert cfg.public_metrics and cfg.failover and cfg.heartbeat_interval_s == 0.25
    with pytest.raises(SystemExit):
        server_cli.router_parser().parse_args(["--expect-workers", "chef=2"])


def test_the_launcher_hands_each_worker_its_config_in_a_private_file(tmp_path):
    args = server_cli.pdserve_parser().parse_args(["--model", "tiny", "--num-blocks", "64", "--no-warmup", "--devices",
                                          "cpu", "--stats-interval", "2", "--worker-arg=--no-prefix-cache"])
    counts = {"prefill": 1, "decode": 1, "colocated": 1}
    specs = server_cli.plan(args, ["cuda:0", "cuda:1"], counts, "ipc:///run/register", str(tmp_path))
    assert [(s.worker_id, s.engine.device) for s in specs] == [("prefill-0", "cuda:0"), ("decode-0", "cuda:1"),
                                                               ("colocated-0", "cuda:0")]
    _, worker_keys = new_deployment()
    keys_dir = str(write_worker_keys(tmp_path / "keys", worker_keys))
    launcher = L.Launcher(specs, keys_dir, str(tmp_path), extra_args=args.worker_arg, log_level="DEBUG")
    launcher._start = lambda spec: None  # write the files, start nothing
    launcher.start()
    decode = specs[1]
    path = launcher.config_file(decode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = open(path).read()
    assert worker_keys.worker.secret.decode() not in text and worker_keys.worker.public.decode() not in text
    base = read_worker_config(path)
    assert base == decode and base.parent_pid == os.getpid()
    assert (base.engine.model, base.engine.num_blocks, base.warmup, base.router) == ("tiny", 64, False,
                                                                                    "ipc:///run/register")
    cmd = launcher.command(decode)
    assert cmd == launcher.command(decode)  # a restart starts the same command, reads the same file
    assert cmd[cmd.index("--worker-config") + 1] == path and cmd[cmd.index("--keys") + 1] == keys_dir
    assert cmd[-3:] == ["--log-level", "DEBUG", "--no-prefix-cache"]

    # what the worker makes of it: the file's values are the defaults, flags after it win
    argv = cmd[cmd.index("--worker-config"):] + ["--kv-port", "7300"]
    args = W.serve_parser(base).parse_args(argv)
    cfg = W.worker_config(args, base)
    assert cfg == replace(decode, engine=replace(decode.engine, prefix_cache=False, kv_shared=True),
                          transfer=replace(decode.transfer, port=7300))
    assert args.keys == keys_dir and args.log_level == "DEBUG"


def test_a_worker_config_file_is_never_overwritten(tmp_path):
    path = str(tmp_path / "w.json")
    write_worker_config(WorkerConfig("colocated", worker_id="c"), path)
    with pytest.raises(FileExistsError):
        write_worker_config(WorkerConfig("colocated", worker_id="c"), path)


def test_from_args_keeps_the_base_fields_that_have_no_flag():
    base = TransferConfig(cancel_grace_s=3.0)
    args = argparse.Namespace(transport="zmq", mode="layer", kv_host="10.0.0.2", kv_port=1, handshake_timeout=2.0,
                              kv_streams=8, kv_plaintext=False, kv_checksum=False, kv_staging_gb=None)
    assert from_args(TransferConfig, args, base=base) == TransferConfig("zmq", "layer", "10.0.0.2", 1, 2.0, 3.0)
