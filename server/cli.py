"""`pdserve`: the router, with its workers on this machine (default) or alone.

    pdserve                          router on 127.0.0.1:8000 + one prefill, one decode and one colocated
                                     worker (smollm2-135m, GPUs when present, transport ipc); prints
                                     "pdserve ready: <url>" once every worker registered
    pdserve --transport nixl --mode layer --devices cuda:0,cuda:1 --no-colocated
    pdserve keygen DIR               CURVE keys for a deployment across machines: DIR/router, DIR/worker
    pdserve router --keys DIR/router --register tcp://10.0.0.1:7100 --host 10.0.0.1
                                     only the router; workers started elsewhere (with --keys DIR/worker)
                                     register at --register

Everything binds to loopback unless an address is given. The control plane is CURVE-authenticated:
`pdserve` makes fresh keys for the workers it starts (the worker key pair in a 0600 file in its
private run directory, never on a command line); `pdserve router` needs the keys of `pdserve keygen`.
`--api-key` (or PDSERVE_API_KEY, or --api-key-file) makes the HTTP API take only `Authorization:
Bearer <key>`. Ctrl-C or SIGTERM drains (no new requests, those in flight finish for up to
--drain-timeout), then stops the router and every worker it started (no orphans).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import shutil
import socket
import sys
import tempfile

from protocol.auth import KeyFileError, keygen as keygen_folders, load_router_keys, new_deployment, write_worker_keys
from protocol.cli import HelpFormatter, add_config_argument, parse_args, setup_logging, version
from protocol.control import MODES, POLICIES, TRANSPORTS  # not workers.transfer: the router does not import torch

log = logging.getLogger("pdserve")


def add_router_arguments(p: argparse.ArgumentParser, register_default: str) -> None:
    from server.config import DEFAULT_MAX_BODY_BYTES

    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, qwen2.5-7b or a checkpoint dir")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, when the model's is not on this machine")
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface (0.0.0.0: all; then set --api-key)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port; the ready line says which)")
    p.add_argument("--register", default=register_default,
                   help="ZMQ endpoint workers register at (port 0: any free port)"
                        + ("" if register_default else "; default: an ipc:// socket in a temporary directory"))
    p.add_argument("--policy", default="auto", choices=POLICIES, help="default routing policy (a request's "
                   "\"policy\" field overrides it)")
    p.add_argument("--auto-threshold", type=int, default=256,
                   help="auto policy: prompts shorter than this many tokens stay colocated")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between worker heartbeats")
    p.add_argument("--heartbeat-misses", type=int, default=3, help="missed heartbeats before a worker is dropped")
    p.add_argument("--kv-deadline", type=float, default=60.0, help="seconds a decode reservation waits for its KV")
    p.add_argument("--token-timeout", type=float, default=120.0,
                   help="seconds of silence from a worker before its request fails")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on the HTTP API (/health without it shows no addresses "
                        "or PIDs); default: $PDSERVE_API_KEY. A flag is visible in `ps`: prefer the variable or "
                        "--api-key-file")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with an API key: serve /metrics without it too (a Prometheus scraper that holds no key)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                   help="largest HTTP request body in MiB (413 above it)")
    p.add_argument("--max-inflight-requests", type=int, default=0,
                   help="admission: requests in flight per role (colocated; prefill, decode) before new ones get "
                        "429 + Retry-After (0: the role's total KV blocks, as its workers registered them)")
    p.add_argument("--max-inflight-tokens", type=int, default=0,
                   help="admission: prompt tokens in flight per role before new requests get 429 (0: twice the "
                        "role's KV capacity in tokens)")
    p.add_argument("--retry-after", type=int, default=1, help="seconds in the Retry-After of a 429 or 503")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests may run (new ones get 503) before the rest are "
                        "aborted and the workers stopped")
    p.add_argument("--failover", action="store_true",
                   help="a disaggregated request whose prefill or KV transfer fails before its first token runs "
                        "once more on another decode worker or colocated (its timings say so); default: it fails")
    p.add_argument("--expect-workers", default=None, metavar="ROLE=N,...",
                   help="/health says \"degraded\" while fewer workers of a role are live, e.g. prefill=2,decode=2 "
                        "(pdserve: the counts it starts)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this process dies (for scripts that start pdserve, e.g. deploy/local-gpus.sh)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers started on this machine")
    g.add_argument("--transport", default="ipc", choices=TRANSPORTS, help="KV transport between prefill and decode")
    g.add_argument("--mode", default="bulk", choices=MODES, help="bulk: after prefill; layer: layer by layer")
    g.add_argument("--devices", default=None,
                   help="comma-separated devices dealt to prefill, decode, colocated workers in turn "
                        "(default: every GPU, else cpu)")
    g.add_argument("--device", default=None, help="one device for every worker (e.g. cpu)")
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument("--colocated-workers", type=int, default=1)
    g.add_argument("--no-colocated", action="store_true", help="no colocated worker (same as --colocated-workers 0)")
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size per worker in blocks")
    g.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool size per worker in GiB")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker")
    g.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker (repeat: --worker-arg=--handshake-timeout --worker-arg=10)")
    g.add_argument("--no-restart", action="store_true",
                   help="a worker that dies stays gone (default: restarted with backoff, 0.5 s doubling to 30 s)")
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for every worker to register (the first start converts the model)")
    g.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between each worker's stats line in the log (throughput, running, waiting, KV "
                        "usage) while it has work; 0: none")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="workers register without a warm-up request (then the first request pays for torch's lazy "
                        "start)")


def expected_counts(text: str | None) -> dict[str, int] | None:
    from protocol.control import ROLES

    if not text:
        return None
    out = {}
    for part in text.split(","):
        role, _, n = part.partition("=")
        if role.strip() not in ROLES or not n.strip().isdigit():
            sys.exit(f"pdserve: --expect-workers takes ROLE=N,... with roles {', '.join(ROLES)}; got {part!r}")
        out[role.strip()] = int(n)
    return out


def router_config(args, keys, expected: dict[str, int] | None = None):
    from server.config import RouterConfig

    expected = expected_counts(args.expect_workers) or expected

    try:
        return RouterConfig(model=args.model, tokenizer=args.tokenizer, register=args.register, policy=args.policy,
                            auto_threshold=args.auto_threshold, heartbeat_interval_s=args.heartbeat_interval,
                            heartbeat_misses=args.heartbeat_misses, kv_deadline_s=args.kv_deadline,
                            token_timeout_s=args.token_timeout, keys=keys, api_key=api_key(args),
                            public_metrics=args.public_metrics,
                            max_body_bytes=int(args.max_body_mb * 2**20),
                            max_inflight_requests=args.max_inflight_requests,
                            max_inflight_tokens=args.max_inflight_tokens, retry_after_s=args.retry_after,
                            drain_timeout_s=args.drain_timeout, expected_workers=expected,
                            failover=args.failover)
    except ValueError as e:
        sys.exit(f"pdserve: {e}")


def api_key(args) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                return f.readline().strip() or None
        except OSError as e:
            sys.exit(f"pdserve: cannot read --api-key-file {args.api_key_file}: {e.strerror}")
    return args.api_key or os.environ.get("PDSERVE_API_KEY") or None  # not argparse's default: --help would show it


def worker_args(args) -> list[str]:
    out = ["--model", args.model, "--transport", args.transport, "--mode", args.mode,
           "--log-level", args.log_level, "--stats-interval", str(args.stats_interval)]
    if not args.warmup:
        out.append("--no-warmup")
    for flag in ("dtype", "block_size", "num_blocks", "kv_memory_gb", "max_num_seqs", "max_model_len", "threads"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out + list(args.worker_arg)


def warn_if_open(host: str, api_key: str | None) -> None:
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = host == "localhost"
    if not loopback and api_key is None:
        log.warning("the HTTP API listens on %s without an API key: anyone who can reach it can use it and see "
                    "the workers' addresses in /health; set PDSERVE_API_KEY (or --api-key-file)", host)


def bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sys.exit(f"pdserve: cannot listen on {host}:{port}: {e.strerror}; pick another --port (0: any free port)")
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app, args):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: pdserve's handler stops the workers too."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29 calls this instead
            pass

    # log_config=None: uvicorn's loggers go through pdserve's (one format for every line)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=5, log_config=None)
    return Server(config)


async def serve(app, sock: socket.socket, args, after_start, on_stop=None) -> int:
    """Run uvicorn on `sock`; once it is up, `await after_start(stop_event)`. Ctrl-C/SIGTERM drain: no new
    requests (503 + Retry-After), the ones in flight finish for up to --drain-timeout, the rest are
    aborted; then uvicorn stops and on_stop() runs (e.g. to stop the workers, idle by then); a second
    signal exits at once."""
    server = _uvicorn_server(app, args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    drained: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s; exiting now", sig.name)
            os._exit(130)  # workers follow: PR_SET_PDEATHSIG and their parent-watch
        log.info("%s; draining, then shutting down", sig.name)
        stop.set()
        drained.append(loop.create_task(drain_then_stop()))  # a reference: tasks are weakly held

    async def drain_then_stop() -> None:
        try:
            pending, aborted = await app.state.router.dispatcher.drain(args.drain_timeout)
            log.info("drained %d of %d requests in flight%s", pending - aborted, pending,
                     f"; aborted {aborted} at the drain timeout" if aborted else "")
        finally:
            server.should_exit = True
            if on_stop is not None:
                on_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.02)
    if serve_task.done():
        await serve_task
        return 1
    rc = await after_start(stop)
    if rc:
        server.should_exit = True
    await serve_task
    return rc or 0


def run_embedded(args) -> int:
    from server.app import create_app
    from server.launcher import Launcher, default_devices, plan_workers
    from server.tokenizer import load_tokenizer

    counts = {"prefill": args.prefill_workers, "decode": args.decode_workers,
              "colocated": 0 if args.no_colocated else args.colocated_workers}
    if counts["prefill"] != counts["decode"] and 0 in (counts["prefill"], counts["decode"]):
        sys.exit("pdserve: disaggregated serving needs prefill and decode workers both (or neither)")
    if not any(counts.values()):
        sys.exit("pdserve: no workers to start; drop --no-colocated or ask for prefill/decode workers")
    devices = [args.device] if args.device else (args.devices.split(",") if args.devices else default_devices())
    specs = plan_workers(counts, devices, worker_args(args))
    rundir = tempfile.mkdtemp(prefix="pdserve-")  # 0700: only this user can reach what is inside
    # fresh keys for this run: the router's stay in memory, the workers' go to a 0600 file they read
    router_keys, worker_keys = new_deployment()
    keys_dir = write_worker_keys(os.path.join(rundir, "keys"), worker_keys)
    # the endpoint is fixed before the router binds it, so the workers start loading at once
    if args.register is None:
        args.register = f"ipc://{rundir}/register"
    elif args.register.startswith("tcp://") and args.register.endswith(":0"):
        args.register = f"{args.register[:-2]}:{free_port(args.register[6:-2])}"
    cfg = router_config(args, router_keys, {role: n for role, n in counts.items() if n})
    warn_if_open(args.host, cfg.api_key)
    sock = bind_http(args.host, args.port)
    url = url_of(sock)
    launcher = Launcher(specs, cfg.register, str(keys_dir), run_dir=rundir, restart=not args.no_restart)
    watchers: list[asyncio.Task] = []
    try:
        launcher.start()
        app = create_app(cfg, load_tokenizer(cfg.model, cfg.tokenizer))
        router = app.state.router

        async def after_start(stop: asyncio.Event) -> int:
            want = {s.worker_id for s in specs}
            loop = asyncio.get_running_loop()
            end = loop.time() + args.startup_timeout
            while not want <= set(router.pool.workers):
                dead = launcher.exited()
                if dead:
                    for wid, _pid, rc in dead:
                        print(f"pdserve: worker {wid} exited with code {rc} before registering (its log is "
                              f"above); stopping", file=sys.stderr, flush=True)
                    return 1
                if stop.is_set():
                    return 0
                if loop.time() > end:
                    missing = ", ".join(sorted(want - set(router.pool.workers)))
                    print(f"pdserve: workers {missing} did not register within {args.startup_timeout:.0f}s; "
                          f"stopping", file=sys.stderr, flush=True)
                    return 1
                await router.pool.wait_for(lambda pool: want <= set(pool.workers), timeout=0.2)
            where = ", ".join(f"{s.worker_id} on {s.device}" for s in specs)
            disagg = f"; KV {args.transport}/{args.mode}" if counts["prefill"] else ""
            print(f"pdserve ready: {url} (model {cfg.model}; {where}{disagg}; policy {cfg.policy})", flush=True)
            # supervision: a worker that exits is dropped by the router at once, and restarted;
            # keep a reference: tasks are weakly held
            watchers.append(asyncio.create_task(launcher.watch(stop, router.pool.lost)))
            return 0

        return asyncio.run(serve(app, sock, args, after_start, on_stop=launcher.terminate))
    finally:
        launcher.stop()
        shutil.rmtree(rundir, ignore_errors=True)


def run_router(args) -> int:
    from server.app import create_app
    from server.tokenizer import load_tokenizer

    if args.keys is None:
        sys.exit("pdserve router: --keys DIR is required: the router folder of `pdserve keygen DIR` (workers get "
                 "DIR/worker with their --keys); only workers holding that key can register")
    try:
        keys = load_router_keys(args.keys)
    except KeyFileError as e:
        sys.exit(f"pdserve router: {e}")
    cfg = router_config(args, keys)
    warn_if_open(args.host, cfg.api_key)
    sock = bind_http(args.host, args.port)
    url = url_of(sock)
    app = create_app(cfg, load_tokenizer(cfg.model, cfg.tokenizer))

    async def after_start(_stop: asyncio.Event) -> int:
        print(f"pdserve router ready: {url} (model {cfg.model}; workers register at {app.state.router.pool.address}; "
              f"policy {cfg.policy})", flush=True)
        return 0

    return asyncio.run(serve(app, sock, args, after_start))


def keygen(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve keygen", description="Write the CURVE keys of a deployment across "
                                "machines: DIR/router (for `pdserve router --keys`, stays on its machine) and "
                                "DIR/worker (for `pdserve-worker --keys`, copy it to every worker machine).")
    p.add_argument("dir", help="a new or empty folder")
    args = p.parse_args(argv)
    try:
        router, worker = keygen_folders(args.dir)
    except KeyFileError as e:
        sys.exit(f"pdserve keygen: {e}")
    print(f"router keys: {router}  (pdserve router --keys {router})\n"
          f"worker keys: {worker}  (pdserve-worker --keys {worker}; copy this folder, mode 0700, to each worker "
          f"machine)")
    return 0


def pdserve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0],
                                epilog="`pdserve router --help`: the router alone; `pdserve keygen DIR`: keys "
                                       "for workers on other machines.", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_config_argument(p)
    add_router_arguments(p, register_default=None)
    add_worker_arguments(p)
    return p


def router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve router", description="Run only the router; workers started "
                                "elsewhere (pdserve-worker --router ... --keys DIR/worker) register with it.",
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"pdserve {version()}")
    add_config_argument(p)
    add_router_arguments(p, register_default="tcp://127.0.0.1:7100")
    p.add_argument("--keys", default=None, help="the router folder `pdserve keygen DIR` wrote (DIR/router)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "keygen":
        return keygen(argv[1:])
    if argv and argv[0] == "router":
        args, run = parse_args(router_parser(), argv[1:]), run_router
    else:
        args, run = parse_args(pdserve_parser(), argv), run_embedded
    from protocol.cli import exit_now

    setup_logging(args.log_level)
    if args.parent_pid is not None:
        from protocol.cli import die_with_parent

        die_with_parent(args.parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))
    rc = run(args)
    exit_now(rc)  # the workers are stopped and the sockets closed; skip the interpreter's slow teardown


if __name__ == "__main__":
    sys.exit(main())
