"""`pdserve-worker`: run one worker process, or generate locally from the command line.

    pdserve-worker --role decode --model smollm2-135m --device cuda:1 --transport nixl --keys keys/worker \\
        --router tcp://10.0.0.1:7100 --control tcp://10.0.0.2:7201 --kv-host 10.0.0.2 --kv-port 7300
    pdserve-worker generate "What is the capital of France?" --chat --max-tokens 32
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import sys

from protocol.cli import (PARENT_DIED, HelpFormatter, add_config_argument, die_with_parent, exit_now, parse_args,
                          setup_logging, version)
from protocol.enums import MODES, ROLES, TRANSPORTS


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, qwen2.5-7b or a local checkpoint dir")
    g.add_argument("--device", default="cpu", help="cpu or cuda:N")
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (or --kv-memory-gb)")
    g.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool size in GiB")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running requests at once")
    g.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="with --no-chunked-prefill: prompt tokens per prefill step (a longer prompt runs alone)")
    g.add_argument("--chunk-tokens", type=int, default=512,
                   help="prompt tokens per step; each step also carries every running request's next token")
    g.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="prefill whole prompts in steps of their own (running requests wait for them)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt in full (default: reuse the KV of full blocks a previous prompt began with)")
    g.add_argument("--host-cache-gb", type=float, default=0.0,
                   help="host memory (pinned on CUDA) that keeps the KV of finished requests' blocks below the GPU, "
                        "reloaded instead of recomputed when that is cheaper (0: off)")
    g.add_argument("--disk-cache-dir", default=None,
                   help="with --host-cache-gb: a directory for blocks pushed out of host memory (written in the background)")
    g.add_argument("--disk-cache-gb", type=float, default=16.0, help="size of the --disk-cache-dir tier")
    g.add_argument("--attention", default="auto", choices=["auto", "triton", "reference"],
                   help="auto: Triton paged decode + flash over gathered prefixes on CUDA; triton: Triton for prefixes too; reference: gather + SDPA (CPU always)")
    g.add_argument("--no-compile", dest="compile", action="store_false",
                   help="CUDA: run decoder layers eagerly (no torch.compile, no fused Q/K/V)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def engine_config(args, kv_shared: bool = False):
    from protocol.config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                        num_blocks=args.num_blocks, kv_memory_gb=args.kv_memory_gb, max_num_seqs=args.max_num_seqs,
                        max_batched_tokens=args.max_batched_tokens, kv_shared=kv_shared,
                        max_model_len=args.max_model_len, chunked_prefill=args.chunked_prefill,
                        chunk_tokens=args.chunk_tokens, attention=args.attention, compile=args.compile,
                        fuse_qkv=args.compile, prefix_cache=args.prefix_cache, host_cache_gb=args.host_cache_gb,
                        disk_cache_dir=args.disk_cache_dir, disk_cache_gb=args.disk_cache_gb)


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-worker", description="Run one pdserve worker process "
                                "(or `pdserve-worker generate PROMPT` to generate locally).", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_config_argument(p)
    p.add_argument("--role", required=True, choices=ROLES)
    add_engine_arguments(p)
    g = p.add_argument_group("KV transfer (prefill and decode roles)")
    g.add_argument("--transport", default="ipc", choices=TRANSPORTS,
                   help="ipc: same host; nixl: NIXL/UCX; zmq: host-staged TCP, works anywhere")
    g.add_argument("--mode", default="bulk", choices=MODES, help="bulk: after prefill; layer: each layer as it is done")
    g.add_argument("--kv-host", default="127.0.0.1", help="decode: interface the KV receiver binds and advertises")
    g.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: any free port)")
    g.add_argument("--handshake-timeout", type=float, default=30.0,
                   help="seconds for a KV transport handshake (a request's own deadline comes from the router)")
    g = p.add_argument_group("control plane")
    g.add_argument("--router", default="tcp://127.0.0.1:7100", help="the router's registration endpoint")
    g.add_argument("--control", default="tcp://127.0.0.1:0",
                   help="endpoint this worker binds for router messages (port 0: any free port)")
    g.add_argument("--advertise-host", default=None, help="host to give the router when --control binds 0.0.0.0")
    g.add_argument("--worker-id", default=None, help="default: <role>-<hostname>-<pid>")
    g.add_argument("--keys", required=True, metavar="DIR",
                   help="the worker key folder of the deployment (`pdserve keygen DIR` wrote DIR/worker; `pdserve` "
                        "passes its own): CURVE on every control and KV socket")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process dies (set by `pdserve`, which starts its workers with it)")
    p.add_argument("--run-dir", default=None,
                   help="with --parent-pid: that process's private run directory, removed if it dies first")
    p.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between stats lines in the log (throughput, running, waiting, KV usage) while "
                        "there is work; 0: none")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="register without running a warm-up request first (the first real request pays for torch's "
                        "lazy start)")
    p.add_argument("--log-level", default="INFO")
    return p


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-worker generate", description="Generate from one prompt on this "
                                "machine (no router, no other process) and print the text.", formatter_class=HelpFormatter)
    p.add_argument("prompt")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")
    return p


def serve(argv: list[str]) -> int:
    args = parse_args(serve_parser(), argv)
    setup_logging(args.log_level)
    stopper = {"worker": None}
    if args.parent_pid is not None:
        def abandon(parent_died: bool) -> None:
            """Still loading: the KV pool may exist already (workers/engine/kv_cache.py SHM_PREFIX)."""
            for path in glob.glob(f"/dev/shm/pdserve-kv-{os.getpid()}-*"):
                os.unlink(path)
            if parent_died and args.run_dir:
                shutil.rmtree(args.run_dir, ignore_errors=True)
            os._exit(1)

        def on_parent_death():
            worker = stopper["worker"]
            if worker is not None:
                worker.die(f"parent process {args.parent_pid} died")
            else:
                abandon(parent_died=True)

        # until the worker installs its own: a SIGTERM while loading cleans up too
        signal.signal(signal.SIGTERM, lambda _s, _f: abandon(parent_died=os.getppid() != args.parent_pid))
        signal.signal(PARENT_DIED, lambda _s, _f: on_parent_death())
        die_with_parent(args.parent_pid, on_parent_death, PARENT_DIED)

    from protocol.auth import KeyFileError, load_worker_keys
    from protocol.config import TransferConfig, WorkerConfig
    from workers.worker import Worker

    try:
        keys = load_worker_keys(args.keys)
    except KeyFileError as e:
        print(f"pdserve-worker: {e}", file=sys.stderr)
        return 2

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    disaggregated = args.role in ("prefill", "decode")
    cfg = WorkerConfig(
        role=args.role,
        engine=engine_config(args, kv_shared=disaggregated and args.transport == "ipc"),
        transfer=TransferConfig(transport=args.transport, mode=args.mode, host=args.kv_host, port=args.kv_port,
                                deadline_s=args.handshake_timeout, keys=keys),
        control=args.control, router=args.router, advertise_host=args.advertise_host, worker_id=args.worker_id,
        keys=keys, parent_pid=args.parent_pid, run_dir=args.run_dir, stats_interval_s=args.stats_interval,
        warmup=args.warmup,
    )
    worker = Worker(cfg)
    stopper["worker"] = worker
    worker.install_signal_handlers()
    rc = worker.run()
    exit_now(rc)


def generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    setup_logging(args.log_level)
    from workers.engine.request import InvalidRequest, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:  # what can be checked without the model, before the model loads
        params.validate()
        if not args.prompt:
            raise InvalidRequest("the prompt is empty; give some text to continue")
    except InvalidRequest as e:
        print(f"pdserve-worker generate: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from workers.engine.engine import Engine

    engine = Engine(engine_config(args))
    ids = engine.encode_prompt(args.prompt, chat=args.chat)
    try:
        [req] = engine.generate([ids], params)
    except InvalidRequest as e:
        print(f"pdserve-worker generate: {e}", file=sys.stderr)
        return 2
    print(req.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return generate(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
