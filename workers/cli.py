"""`pdserve-worker`: run one worker process, or generate locally from the command line.

    pdserve-worker --role decode --model smollm2-135m --device cuda:1 --transport nixl --keys keys/worker \\
        --router tcp://10.0.0.1:7100 --control tcp://10.0.0.2:7201 --kv-host 10.0.0.2 --kv-port 7300
    pdserve-worker generate "What is the capital of France?" --chat --max-tokens 32

The flags are the fields of settings/worker.py (settings/flags.py derives them). `pdserve` starts its
workers with `--worker-config FILE`: their whole WorkerConfig, which the flags then read as defaults.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from dataclasses import replace

from pdserve.settings.cli import (PARENT_DIED, HelpFormatter, add_config_argument, die_with_parent, exit_now, parse_args,
                                  setup_logging, version)
from pdserve.settings.worker import EngineConfig, TransferConfig, WorkerConfig, read_worker_config
from pdserve.protocol.enums import Role, Transport
from pdserve.settings.flags import add_arguments, from_args
from pdserve.protocol.shm import remove_pools


def add_engine_arguments(p: argparse.ArgumentParser, base: EngineConfig | None = None) -> None:
    add_arguments(p.add_argument_group("engine"), EngineConfig, base=base)


def engine_config(args, base: EngineConfig | None = None, **given) -> EngineConfig:
    """The EngineConfig of the parsed flags (on top of `base`); --no-compile drops the fused projections too."""
    cfg = from_args(EngineConfig, args, base=base, **given)
    return replace(cfg, fuse_qkv=cfg.fuse_qkv and cfg.compile, fuse_gate_up=cfg.fuse_gate_up and cfg.compile)


def serve_parser(base: WorkerConfig | None = None) -> argparse.ArgumentParser:
    """The flags of a worker; with `base` (a WorkerConfig from --worker-config) its values are the defaults."""
    p = argparse.ArgumentParser(prog="pdserve-worker", description="Run one pdserve worker process "
                                "(or `pdserve-worker generate PROMPT` to generate locally).", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_config_argument(p)
    p.add_argument("--worker-config", metavar="FILE", help="internal, for the workers `pdserve` starts: a "
                   "WorkerConfig as JSON (it writes one per worker into its run directory); flags given too "
                   "apply on top")
    add_engine_arguments(p, base and base.engine)
    add_arguments(p.add_argument_group("KV transfer (prefill and decode roles)"), TransferConfig,
                  base=base and base.transfer)
    g = p.add_argument_group("worker and control plane")
    add_arguments(g, WorkerConfig, base=base)
    g.add_argument("--keys", required=True, metavar="DIR",
                   help="the worker key folder of the deployment (`pdserve keygen DIR` wrote DIR/worker; `pdserve` "
                        "passes its own): CURVE on every control and KV socket")
    p.add_argument("--log-level", default="INFO")
    return p


def worker_config(args, base: WorkerConfig | None = None, keys=None) -> WorkerConfig:
    """The WorkerConfig of the parsed flags (on top of `base`), with the deployment's keys."""
    # the ipc transport on CPU maps the decode worker's pool from /dev/shm
    shared = args.role != Role.COLOCATED and args.transport == Transport.IPC
    engine = engine_config(args, base and base.engine, kv_shared=shared)
    transfer = from_args(TransferConfig, args, base=base and base.transfer, keys=keys)
    return from_args(WorkerConfig, args, base=base, engine=engine, transfer=transfer, keys=keys)


def keep_compiled_code() -> str:
    """Inductor's on-disk cache in pdserve's (settings.models.compile_cache_dir), so that a worker restarted
    after /tmp was emptied starts warm (a GPU worker compiles its layers once a machine: ~10 s of its start
    on empty caches). A TORCHINDUCTOR_CACHE_DIR already set wins. Returns the directory in use."""
    from pdserve.settings.models import compile_cache_dir

    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


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
    from pdserve.settings.keys import KeyFileError, load_worker_keys

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--worker-config")
    given, _ = pre.parse_known_args(argv)
    try:
        base = read_worker_config(given.worker_config) if given.worker_config else None
    except (OSError, ValueError, TypeError) as e:  # TypeError: a key no WorkerConfig field has
        print(f"pdserve-worker: cannot read --worker-config {given.worker_config}: {e}", file=sys.stderr)
        return 2
    args = parse_args(serve_parser(base), argv)
    setup_logging(args.log_level)
    try:
        keys = load_worker_keys(args.keys)
        cfg = worker_config(args, base, keys)
    except (KeyFileError, ValueError) as e:
        print(f"pdserve-worker: {e}", file=sys.stderr)
        return 2
    from pdserve.workers.preflight import StartupError, preflight

    problem = preflight(cfg)  # the ports and the device, before the model loads
    if problem is not None:
        print(f"pdserve-worker: {problem}", file=sys.stderr)
        return 2

    stopper = {"worker": None}
    if cfg.parent_pid is not None:
        def abandon(parent_died: bool) -> None:
            """Still loading: the KV pool may exist already (protocol/shm.py names it)."""
            remove_pools(os.getpid())
            if parent_died and cfg.run_dir:
                shutil.rmtree(cfg.run_dir, ignore_errors=True)
            os._exit(1)

        def on_parent_death():
            worker = stopper["worker"]
            if worker is not None:
                worker.die(f"parent process {cfg.parent_pid} died")
            else:
                abandon(parent_died=True)

        # until the worker installs its own: a SIGTERM while loading cleans up too
        signal.signal(signal.SIGTERM, lambda _s, _f: abandon(parent_died=os.getppid() != cfg.parent_pid))
        signal.signal(PARENT_DIED, lambda _s, _f: on_parent_death())
        die_with_parent(cfg.parent_pid, on_parent_death, PARENT_DIED)

    from pdserve.workers.worker import Worker

    set_threads(cfg.engine.threads)
    keep_compiled_code()
    try:
        worker = Worker(cfg)
    except StartupError as e:
        print(f"pdserve-worker: {e}", file=sys.stderr)
        return 2
    stopper["worker"] = worker
    worker.install_signal_handlers()
    rc = worker.run()
    exit_now(rc)


def generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    setup_logging(args.log_level)
    from pdserve.workers.engine.request import InvalidRequest, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:  # what can be checked without the model, before the model loads
        params.validate()
        if not args.prompt:
            raise InvalidRequest("the prompt is empty; give some text to continue")
    except InvalidRequest as e:
        print(f"pdserve-worker generate: {e}", file=sys.stderr)
        return 2
    from pdserve.workers.preflight import device_problem

    try:
        cfg = engine_config(args)
    except ValueError as e:
        print(f"pdserve-worker generate: {e}", file=sys.stderr)
        return 2
    problem = device_problem(cfg.device)
    if problem is not None:
        print(f"pdserve-worker generate: {problem}", file=sys.stderr)
        return 2
    set_threads(cfg.threads)
    keep_compiled_code()
    from pdserve.workers.engine.engine import Engine

    engine = Engine(cfg)
    ids = engine.text.encode_prompt(args.prompt, chat=args.chat)
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
