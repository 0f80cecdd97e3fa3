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
from dataclasses import fields
from pathlib import Path

from pdserve.settings.keys import KeyFileError, keygen as keygen_folders, load_router_keys, new_deployment, write_worker_keys
from pdserve.settings.cli import add_config_argument, parse_args, setup_logging, version
from pdserve.settings.worker import EngineConfig, TransferConfig, WorkerConfig  # not workers.*: no torch in the router
from pdserve.protocol.enums import Role
from pdserve.settings.flags import FLAG, add_arguments, from_args, values
from pdserve.settings.models import MODEL_NAMES, cache_is_current, smollm2_cache_dir, smollm2_gguf_path
from pdserve.settings.router import RouterConfig
from pdserve.server.parser import Parser

log = logging.getLogger("pdserve")

# the flags `pdserve` takes for every worker it starts: each of the engine's and the transfer's (but the
# model, the router's; and the KV receiver's address, each decode worker's own), and the worker's own
WORKER_FLAGS = {EngineConfig: tuple(f.name for f in fields(EngineConfig) if FLAG in f.metadata and f.name != "model"),
                TransferConfig: tuple(f.name for f in fields(TransferConfig) if FLAG in f.metadata
                                      and f.name not in ("host", "port")),
                WorkerConfig: ("stats_interval_s", "warmup")}
# where pdserve's flag means something else than the worker's
WORKER_OVERRIDES = {"device": {"default": None, "help": "one device for every worker (e.g. cpu; default: --devices)"},
                    "threads": {"help": "CPU threads for torch in each worker (default: this machine's cores shared "
                                        "among the workers it starts, at least 1)"}}


def add_router_arguments(p: argparse.ArgumentParser, register_default: str | None) -> None:
    """The router's flags: RouterConfig's fields, and the HTTP socket's and the process's own."""
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface (0.0.0.0: all; then set --api-key)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port; the ready line says which)")
    register = {} if register_default == RouterConfig.register else {"register": {
        "default": register_default, "help": "ZMQ endpoint workers register at (port 0: any free port); default: an "
                                             "ipc:// socket in a temporary directory"}}
    add_arguments(p, RouterConfig, overrides=register)
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR, for the router and its workers")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this process dies (for scripts that start pdserve, e.g. deploy/local-gpus.sh)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers started on this machine")
    for cls, names in WORKER_FLAGS.items():
        add_arguments(g, cls, only=names, overrides=WORKER_OVERRIDES)
    g.add_argument("--devices", default=None,
                   help="comma-separated devices dealt to prefill, decode, colocated workers in turn "
                        "(default: every GPU, else cpu)")
    g.add_argument("--prefill-workers", type=int, default=1, help="prefill workers to start")
    g.add_argument("--decode-workers", type=int, default=1, help="decode workers to start")
    g.add_argument("--colocated-workers", type=int, default=1, help="colocated workers to start")
    g.add_argument("--no-colocated", action="store_true", help="no colocated worker (same as --colocated-workers 0)")
    g.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker (repeat: --worker-arg=--handshake-timeout --worker-arg=10)")
    g.add_argument("--no-restart", action="store_true",
                   help="a worker that dies stays gone (default: restarted with backoff, 0.5 s doubling to 30 s)")
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for every worker to register (the first start converts the model)")


def router_config(args, keys, expected: dict[str, int] | None = None) -> RouterConfig:
    """The RouterConfig of the parsed flags; `expected`: the worker counts when --expect-workers is not given."""
    try:
        return from_args(RouterConfig, args, keys=keys, api_key=api_key(args),
                         expected_workers=args.expect_workers or expected)
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


def check_model(model: str, tokenizer: str | None = None) -> None:
    """Exit with one line, before anything starts, when the model (or its tokenizer) is not on this machine."""
    if model in MODEL_NAMES:
        if tokenizer is None and not cache_is_current(smollm2_cache_dir()):
            try:  # the named models take SmolLM2's tokenizer, converted from the GGUF on first use
                smollm2_gguf_path()
            except FileNotFoundError as e:
                sys.exit(f"pdserve: {e}")
        return
    path = Path(model)
    if not path.is_dir():
        sys.exit(f"pdserve: unknown model {model!r}: give one of {', '.join(MODEL_NAMES)} or a local checkpoint "
                 f"directory (no model hub is reached)")
    if not (path / "config.json").is_file():
        sys.exit(f"pdserve: {model} holds no config.json; --model takes a HuggingFace checkpoint directory")


def default_threads(workers: int) -> int:
    """torch threads per worker when --threads is not given: this machine's cores shared among the workers
    pdserve starts on it (each would take every core by default, and they would fight over them)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


def plan(args, devices: list[str], counts: dict[str, int], router: str, run_dir: str) -> list[WorkerConfig]:
    """The config of each worker to start: the flags pdserve offers for them, the router's model."""
    from pdserve.server.launcher import plan_workers

    try:  # the device: each worker's own, dealt by plan_workers
        threads = args.threads or default_threads(sum(counts.values()))
        # the disk tier keeps a key in its folder: this run's deployment keys end with it
        engine = from_args(EngineConfig, args, only=WORKER_FLAGS[EngineConfig], model=args.model, device=devices[0],
                           threads=threads, disk_cache_own_key=True)
        transfer = from_args(TransferConfig, args, only=WORKER_FLAGS[TransferConfig])
        return plan_workers(counts, devices, engine, transfer=transfer, router=router, parent_pid=os.getpid(),
                            run_dir=run_dir, **values(WorkerConfig, args, only=WORKER_FLAGS[WorkerConfig]))
    except ValueError as e:  # before any worker starts: e.g. --block-size 3, --device gpu
        sys.exit(f"pdserve: {e}")


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

    from pdserve.server.connections import connection_options

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: pdserve's handler stops the workers too."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29 calls this instead
            pass

    # log_config=None: uvicorn's loggers go through pdserve's (one format for every line)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=5, log_config=None,
                            **connection_options(app.state.router.cfg))  # caps, fd reserve, timeouts (server/connections.py)
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
    from pdserve.server.launcher import Launcher, default_devices, device_problem

    counts = {Role.PREFILL: args.prefill_workers, Role.DECODE: args.decode_workers,
              Role.COLOCATED: 0 if args.no_colocated else args.colocated_workers}
    if counts[Role.PREFILL] != counts[Role.DECODE] and 0 in (counts[Role.PREFILL], counts[Role.DECODE]):
        sys.exit("pdserve: disaggregated serving needs prefill and decode workers both (or neither)")
    if not any(counts.values()):
        sys.exit("pdserve: no workers to start; drop --no-colocated or ask for prefill/decode workers")
    devices = [args.device] if args.device else (args.devices.split(",") if args.devices else default_devices())
    given = "--device" if args.device else "--devices" if args.devices else None
    problem = device_problem(devices, given) if given else None
    if problem is not None:  # before any worker starts (each would fail the same way, after seconds)
        print(f"pdserve: {problem}", file=sys.stderr)
        return 2
    check_model(args.model, args.tokenizer)
    rundir = tempfile.mkdtemp(prefix="pdserve-")  # 0700: only this user can reach what is inside
    launcher = None
    try:  # whatever happens from here on, the run directory goes
        # fresh keys for this run: the router's stay in memory, the workers' go to a 0600 file they read
        router_keys, worker_keys = new_deployment()
        keys_dir = write_worker_keys(os.path.join(rundir, "keys"), worker_keys)
        # the endpoint is fixed before the router binds it, so the workers start loading at once
        if args.register is None:
            args.register = f"ipc://{rundir}/register"
        elif args.register.startswith("tcp://") and args.register.endswith(":0"):
            args.register = f"{args.register[:-2]}:{free_port(args.register[6:-2])}"
        cfg = router_config(args, router_keys, {str(role): n for role, n in counts.items() if n})
        specs = plan(args, devices, counts, cfg.register, rundir)
        warn_if_open(args.host, cfg.api_key)
        sock = bind_http(args.host, args.port)
        url = url_of(sock)
        launcher = Launcher(specs, str(keys_dir), rundir, extra_args=args.worker_arg, log_level=args.log_level,
                            restart=not args.no_restart)
        watchers: list[asyncio.Task] = []
        launcher.start()  # first: the workers load their model while the router imports its app
        from pdserve.server.app import create_app
        from pdserve.server.tokenizer import load_tokenizer

        app = create_app(cfg, load_tokenizer(cfg.model, cfg.tokenizer))
        router = app.state.router
        router.supervisor = launcher  # /health shows a worker it cannot restart

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
            where = ", ".join(f"{s.worker_id} on {s.engine.device}" for s in specs)
            disagg = f"; KV {args.transport}/{args.mode}" if counts[Role.PREFILL] else ""
            threads = f"{specs[0].engine.threads} torch threads each (" + (
                "--threads" if args.threads else f"{len(os.sched_getaffinity(0))} cores / {len(specs)} workers") + ")"
            named = f" as {cfg.served_name}" if cfg.served_name != cfg.model else ""
            print(f"pdserve ready: {url} (model {cfg.model}{named}; {where}; {threads}{disagg}; policy {cfg.policy})",
                  flush=True)
            # supervision: a worker that exits is dropped by the router at once, and restarted;
            # keep a reference: tasks are weakly held
            watchers.append(asyncio.create_task(launcher.watch(stop, router.pool.lost)))
            return 0

        return asyncio.run(serve(app, sock, args, after_start, on_stop=launcher.terminate))
    finally:
        if launcher is not None:
            launcher.stop()
        shutil.rmtree(rundir, ignore_errors=True)


def run_router(args) -> int:
    from pdserve.server.app import create_app
    from pdserve.server.tokenizer import load_tokenizer

    if args.keys is None:
        sys.exit("pdserve router: --keys DIR is required: the router folder of `pdserve keygen DIR` (workers get "
                 "DIR/worker with their --keys); only workers holding that key can register")
    try:
        keys = load_router_keys(args.keys)
    except KeyFileError as e:
        sys.exit(f"pdserve router: {e}")
    cfg = router_config(args, keys)
    try:  # the router needs only the tokenizer: the model may live on the workers' machines alone
        tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"pdserve router: {e}")
    warn_if_open(args.host, cfg.api_key)
    sock = bind_http(args.host, args.port)
    url = url_of(sock)
    app = create_app(cfg, tokenizer)

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
    p = Parser(prog="pdserve", description=__doc__.splitlines()[0],
               epilog="`pdserve router --help`: the router alone; `pdserve keygen DIR`: keys for workers on other "
                      "machines. Docs: docs/serving.md.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_config_argument(p)
    add_router_arguments(p, register_default=None)
    add_worker_arguments(p)
    return p


def router_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pdserve router", description="Run only the router; workers started elsewhere (pdserve-worker "
               "--router ... --keys DIR/worker) register with it.")
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
    from pdserve.settings.cli import exit_now

    setup_logging(args.log_level)
    if args.parent_pid is not None:
        from pdserve.settings.cli import die_with_parent

        die_with_parent(args.parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))
    rc = run(args)
    exit_now(rc)  # the workers are stopped and the sockets closed; skip the interpreter's slow teardown


if __name__ == "__main__":
    sys.exit(main())
