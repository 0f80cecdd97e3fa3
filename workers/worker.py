"""One worker process: control sockets, registration, heartbeats, and the loop that drives a role.

    Worker(cfg).run()
      inbox thread    reads the control socket the moment a message lands and stamps it
                      (time.monotonic()); hands (stamp, frame) to the main thread's queue
      main thread     take what the inbox holds -> role.handle(msg, arrived); role.tick() (engine
                      steps, prefills, transfers); every engine and transport call happens here
      heartbeat thread  Register until the router acknowledges, then Heartbeat every interval
                      (free KV blocks, queue depth); it only reads counters, never the engine; it
                      also watches its CURVE handshakes: a router that refuses our key (or holds
                      another key than the one we have for it) stops this worker with that reason

Who is obeyed: the control socket is a CURVE server whose Gate lets in only the router's public key
(protocol/auth.py), and every frame carries the incarnation id this process drew at start; frames for
another incarnation, or that do not decode, are dropped, counted and logged at most once per interval.

Why a thread for the inbox: a message that lands while the main thread runs a step (a long prefill,
a decode batch) would otherwise sit unread, and unstamped, until the step ends; that wait is the
`inbox` phase of a request's TTFT (protocol/phases.py), so it must be measured from the arrival.
Draining the socket between steps cannot see it; one thread blocked in recv() can. Its stamp is
late only by the time it takes to get the GIL back (at most the interpreter's switch interval,
5 ms, while the main thread runs Python code; torch kernels release the GIL), and what is late
counts as `hops`, never as work on this worker. The thread only stamps and queues: decoding and
handling stay on the main thread, so roles stay single-threaded.

The roles (workers/roles/) hold the per-request state; this module knows nothing about requests.
Stops on SIGTERM/SIGINT: Goodbye to the router, close transports, free the KV pool (and its
/dev/shm file); every step of that has a time limit (STOP_GRACE_S in all, then the stacks go to the
log and the process exits). The parent's death (PR_SET_PDEATHSIG or the parent-watch thread, see
workers/cli.py) is not a stop but `die()`: nobody is left to say Goodbye to or to serve, so the
KV pool's /dev/shm file and the parent's run directory are removed and the process exits at once,
whatever its threads are doing.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import zmq

from pdserve.protocol import auth
from pdserve.settings import keys
from pdserve.protocol import control as P
from pdserve.settings.worker import WorkerConfig
from pdserve.workers.engine.compiles import LOG_MARK, ServingWork
from pdserve.workers.engine.compiles import describe as describe_work
from pdserve.workers.preflight import StartupError, describe_bind_error
from pdserve.workers.roles.kv_report import KVReport
from pdserve.workers.status_log import StatsLine, startup_line
from pdserve.workers.warmup import freeze_start, start_engine, unfreeze_start

log = logging.getLogger("pdserve.worker")

SERVING_WORK_CHECK_S = 5.0  # how often the loop looks for compiles and captures since ready (check_serving_work)
IDLE_POLL_MS = 50  # nothing to do: wake up this often to notice a stop request
STOP_GRACE_S = 5.0  # a worker still stopping this long after SIGTERM dumps its stacks and exits
JOIN_S = 1.5  # stopping: the longest wait for one thread, or for the ZMQ context's last messages
MAX_CONTROL_FRAME = 64 * 2**20  # bytes; a Generate of the longest prompt is a few MB
WAKE = (0.0, b"")  # put in the inbox's queue to end a take() (Inbox.wake); never handed to a role


class RouterLink:
    """The PUSH socket to the router; sends never block the loop (a gone router drops messages).
    With `watch`, its failed CURVE handshakes can be read from `.watch` (the heartbeat thread's link)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, incarnation: str, keys: keys.WorkerKeys | None,
                 watch: bool = False):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        if keys is not None:
            auth.connect_curve(self.sock, keys.worker, keys.router_public)
        self.watch = auth.HandshakeWatch(self.sock, server=False) if watch and keys is not None else None
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.incarnation = incarnation

    def send(self, msg) -> bool:
        try:
            self.sock.send(P.from_worker(self.incarnation, msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.error("router at %s is not taking messages (queue full); dropped %s", self.endpoint,
                      type(msg).__name__)
            return False

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sock.close()


class Inbox:
    """The control socket (PULL), read by its own thread: every frame is stamped on arrival.
    With keys, a CURVE server whose Gate lets in the router's key only (answered by the same thread)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, advertise_host: str | None, keys: keys.WorkerKeys | None,
                 throttle: auth.Throttle):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME)  # a bigger frame drops its connection
        self.gate = self.watch = None
        self.throttle = throttle
        if keys is not None:
            self.gate = auth.Gate(ctx, keys.control_gate(), "control socket", throttle)
            auth.serve_curve(self.sock, keys.worker)
            self.watch = auth.HandshakeWatch(self.sock, server=True)
        self.address = bind_endpoint(self.sock, endpoint, advertise_host)
        self._frames: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="inbox", daemon=True)

    def start(self) -> None:
        self._thread.start()  # from here on the socket belongs to the thread

    def take(self, timeout_s: float) -> list[tuple[float, bytes]]:
        """(arrival stamp, frame) of everything that landed, waiting up to timeout_s for the first (or
        until wake())."""
        try:
            out = [self._frames.get(timeout=timeout_s) if timeout_s > 0 else self._frames.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._frames.get_nowait())
            except queue.Empty:
                return [item for item in out if item is not WAKE]

    def wake(self) -> None:
        """End a take() now, from any thread or a signal handler. Needed, not a nicety: in CPython 3.11,
        SimpleQueue.get(timeout) interrupted by a signal whose handler runs past the timeout recomputes
        a negative timeout, which its lock takes as "wait forever": the main thread, waiting there
        when SIGTERM's handler ran, slept until the next control frame, and after SIGTERM none came
        (the drain test's worker that "ignored SIGTERM" until the launcher killed it)."""
        self._frames.put(WAKE)

    def _read(self) -> None:
        poller = auth.poller(self.sock, self.gate, self.watch)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(IDLE_POLL_MS))  # wake up now and then to notice close()
                if not ready:
                    continue
                if self.gate is not None and self.gate.sock in ready:
                    self.gate.answer()
                if self.watch is not None and self.watch.sock in ready:
                    for why in self.watch.failures():
                        self.throttle(why, logging.WARNING, "control socket: %s", why)  # a fixed set of texts
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._frames.put((time.monotonic(), frame))
        finally:
            if self.watch is not None:
                self.watch.close()
            if self.gate is not None:
                self.gate.close()
            self.sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=JOIN_S)
        else:  # never started: the sockets are still ours
            for extra in (self.watch, self.gate):
                if extra is not None:
                    extra.close()
            self.sock.close()


def bind_endpoint(sock: zmq.Socket, endpoint: str, advertise_host: str | None) -> str:
    """Bind (port 0 = any free port) and return the endpoint peers should connect to."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port == 0:
        endpoint = f"tcp://{parts.hostname}:*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:  # checked before (preflight.py); taken since, or not an address of ours
        raise StartupError(describe_bind_error("--control", endpoint, OSError(e.errno, e.strerror))) from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    parts = urlsplit(bound)
    if parts.scheme == "tcp" and parts.hostname in ("0.0.0.0", "::", "*"):
        host = advertise_host or socket.gethostbyname(socket.gethostname())
        bound = f"tcp://{host}:{parts.port}"
    return bound


class Worker:
    def __init__(self, cfg: WorkerConfig, engine=None):
        from pdserve.workers.roles import make_role

        self.cfg = cfg
        self.worker_id: str = cfg.worker_id
        self.incarnation = secrets.token_hex(16)  # this process; the router binds our id to it
        self.throttle = auth.Throttle(log)
        # the control port first: one that is taken fails the start before the model loads
        self.ctx = zmq.Context()
        self.inbox = Inbox(self.ctx, cfg.control, cfg.advertise_host, cfg.keys, self.throttle)
        self.address = self.inbox.address
        self.serving_work = ServingWork().start()  # before anything compiles: see check_serving_work
        if engine is None:  # built, graphs captured, warmed up; the ready line says where the time went
            engine = start_engine(cfg.engine, cfg.role, cfg.warmup, cfg.disk_key())
            log.info("%s", startup_line(cfg.worker_id, cfg.role, engine))
        self.engine = engine
        self.serving_work.mark(engine)
        if cfg.engine.step_trace and hasattr(engine, "trace_steps"):  # from ready on: the warm-up is not traced
            try:
                log.info("%s: a line per step in %s", cfg.worker_id, engine.trace_steps(cfg.worker_id, cfg.role))
            except OSError as e:
                raise StartupError(f"--step-trace {cfg.engine.step_trace}: cannot write the step trace there: {e}")
        frozen, took_ms = freeze_start()  # last of the start: what it built is not walked by later collections
        log.info("%s: %d objects of the start frozen out of garbage collection (a full collection over them took "
                 "%.0f ms)", cfg.worker_id, frozen, took_ms)
        self._work_checked = time.monotonic()
        self.stats = StatsLine(cfg.worker_id, cfg.stats_interval_s)
        self.kv_report = KVReport(engine, cfg.worker_id) if hasattr(engine, "prefix_root") else None
        self.router = RouterLink(self.ctx, cfg.router, self.incarnation, cfg.keys)
        self.role = make_role(cfg.role, self)
        self.registered = threading.Event()
        self.heartbeat_interval_s = 1.0
        self._stop = threading.Event()
        self._stop_reason = "stopped"  # told to the router in Goodbye
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self.fatal_error: str | None = None

    # ---- what the router learns about us ----------------------------------------------------

    def registration(self) -> P.Register:
        eng = self.engine
        transfer = self.cfg.transfer if self.cfg.role != "colocated" else None
        return P.Register(
            version=P.PROTOCOL_VERSION, worker_id=self.worker_id, role=self.cfg.role, address=self.address,
            model=eng.model_name, max_model_len=eng.max_model_len, block_size=eng.layout.block_size,
            num_blocks=eng.blocks.num_blocks, free_blocks=eng.blocks.num_free, device=str(eng.device),
            dtype=eng.layout.dtype, pid=os.getpid(),
            transport=transfer.transport if transfer else None, mode=transfer.mode if transfer else None,
            kv_address=self.role.kv_address, block_root=getattr(eng, "prefix_root", None),
        )

    def heartbeat(self) -> P.Heartbeat:
        return P.Heartbeat(worker_id=self.worker_id, address=self.address,
                           free_blocks=self.engine.blocks.num_free, queue_depth=self.role.queue_depth(),
                           running=self.role.running(), sent_at=time.time(), cache=self.cache_figures(),
                           faults=self.role.faults(),
                           costs=self.kv_report.costs() if self.kv_report is not None else None)

    def cache_figures(self) -> P.CacheFigures | None:
        try:  # read from the heartbeat thread: figures a step is updating may be one step old
            return self.engine.cache_figures()
        except RuntimeError:  # a dict changed size under us: the next heartbeat has them
            return None

    def send(self, msg) -> None:
        self.stats.sent(msg)
        self.router.send(msg)

    # ---- life cycle ---------------------------------------------------------------------------

    def stop(self, reason: str = "stopped") -> None:
        self._stop_reason = reason
        self._stop.set()
        self.inbox.wake()  # the main loop sees the stop now, whatever its wait was doing

    def die(self, reason: str) -> None:
        """The parent died (any thread may call this): remove what it would have removed and exit now."""
        log.error("%s: %s; exiting now", self.worker_id, reason)
        self.engine.kv.close()  # unlinks the /dev/shm pool; the mapping stays valid for threads still in it
        if self.cfg.run_dir:
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
        logging.shutdown()
        os._exit(1)

    def parent_died(self) -> bool:
        return self.cfg.parent_pid is not None and os.getppid() != self.cfg.parent_pid

    def install_signal_handlers(self) -> None:
        def on_signal(signum, _frame):
            if self.parent_died():  # nobody to drain for (pdserve's workers get PARENT_DIED for that)
                self.die(f"parent process {self.cfg.parent_pid} died ({signal.Signals(signum).name})")
            self.stop(f"signal {signal.Signals(signum).name}")
            # a stop that hangs must not outlive the launcher's patience: after STOP_GRACE_S the
            # threads' stacks go to the log (so the hang can be found) and the process exits
            faulthandler.dump_traceback_later(STOP_GRACE_S, exit=True)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def check_serving_work(self) -> str | None:
        """Compiles and graph captures since ready (or the last check), logged as a warning: each held the
        steps it happened in, and requests waited (workers/engine/compiles.py). Returns the line's text."""
        self._work_checked = time.monotonic()
        taken = self.serving_work.take(self.engine)
        if taken is None:
            return None
        text = describe_work(taken)
        log.warning("%s: %s%s", self.worker_id, LOG_MARK, text)
        return text

    def run(self) -> int:
        log.info("%s: control %s, router %s, model %s on %s", self.worker_id, self.address, self.cfg.router,
                 self.engine.model_name, self.engine.device)
        self._heartbeat.start()
        self.inbox.start()
        try:
            while not self._stop.is_set():
                for arrived, frame in self.inbox.take(self.role.wait_ms(IDLE_POLL_MS) / 1e3):
                    self._on_frame(arrived, frame)
                self.role.tick()
                if self.stats.due():
                    self.stats.log(self.role.running(), self.role.queue_depth(), self.engine.blocks.num_free,
                                   self.engine.blocks.num_blocks, self.cache_figures())
                if time.monotonic() - self._work_checked >= SERVING_WORK_CHECK_S:
                    self.check_serving_work()
        except Exception as e:
            self._stop_reason = f"crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self.close()
        if self.fatal_error:
            log.error("%s: %s", self.worker_id, self.fatal_error)
            return 2
        return 0

    def _on_frame(self, arrived: float, frame: bytes) -> None:
        try:
            envelope = P.decode_to_worker(frame)
        except P.ProtocolError as e:
            self.throttle("bad_frame", logging.ERROR, "%s: dropped a message: %s", self.worker_id, e)
            return
        msg = envelope.msg
        if envelope.incarnation != self.incarnation:  # for an earlier process under our id, or forged
            self.throttle("stranger", logging.WARNING, "%s: dropped a %s addressed to another incarnation of "
                          "this worker id", self.worker_id, type(msg).__name__)
            return
        if isinstance(msg, P.RegisterAck):
            self._on_register_ack(msg)
        else:
            self.stats.received(msg)
            self.role.handle(msg, arrived)

    def _on_register_ack(self, ack: P.RegisterAck) -> None:
        if ack.ok:
            self.heartbeat_interval_s = ack.heartbeat_interval_s
            if not self.registered.is_set():
                log.info("%s: registered with the router (heartbeat every %.2fs)", self.worker_id,
                         ack.heartbeat_interval_s)
                if self.kv_report is not None:  # a router that (re)learns us learns all our names
                    self.kv_report.resync()
            self.registered.set()
        elif ack.retry:  # the router restarted and forgot us, or our id is still held: register again
            self.throttle("retry", logging.WARNING, "%s: router asks to register again (%s)", self.worker_id,
                          ack.error)
            self.registered.clear()
        else:
            self.fatal_error = f"the router refused this worker: {ack.error}"
            self.stop(self.fatal_error)

    def _heartbeat_loop(self) -> None:
        link = RouterLink(self.ctx, self.cfg.router, self.incarnation, self.cfg.keys, watch=True)
        try:
            while not self._stop.is_set():
                if self.registered.is_set():
                    link.send(self.heartbeat())
                    events = self.kv_report.events() if self.kv_report is not None else None
                    if events is not None:  # the names its tiers gained and lost (the router's index)
                        link.send(events)
                else:
                    link.send(self.registration())
                if self._wait_watching(link, self.heartbeat_interval_s):
                    return
            link.send(P.Goodbye(self.worker_id, self._stop_reason))
        finally:
            link.close()

    def _wait_watching(self, link: RouterLink, seconds: float) -> bool:
        """Wait (until stop) while watching the link's handshakes; True if the router refused us."""
        end = time.monotonic() + seconds
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            if link.watch is None:
                self._stop.wait(left)
                continue
            if not link.watch.sock.poll(min(left, IDLE_POLL_MS / 1e3) * 1e3):
                continue
            failures = link.watch.failures()
            if failures:
                self.fatal_error = (f"the router at {link.endpoint} refused this worker at connect: {failures[0]}; "
                                    "start it with --keys set to the worker folder of the router's deployment "
                                    "(`pdserve keygen DIR` wrote DIR/worker)")
                self.stop(self.fatal_error)  # run() logs it on the way out
                return True
        return False

    def close(self) -> None:
        """Every wait bounded: a thread that does not stop, or a Goodbye the router does not take,
        costs at most JOIN_S each, never a hang (the process exits without the interpreter's teardown)."""
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=JOIN_S)  # it says Goodbye on its way out
            if self._heartbeat.is_alive():
                log.error("%s: the heartbeat thread did not stop within %.1fs", self.worker_id, JOIN_S)
        self.role.close()
        self.inbox.close()
        self.router.close()
        self.engine.kv.close()
        self.engine.close()  # the KV tiers' threads and files in flight
        unfreeze_start()  # its garbage collectable again, where the process goes on (a worker run in a test)
        if not self._heartbeat.is_alive():
            # term() waits for every socket of the context to close and for the Goodbye's linger;
            # on a thread of its own, so that a socket left open costs JOIN_S, not forever
            term = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
            term.start()
            term.join(JOIN_S)
            if term.is_alive():
                log.error("%s: the ZMQ context did not close within %.1fs (a socket still open, or the router "
                          "not taking the Goodbye); exiting anyway", self.worker_id, JOIN_S)
        if self.parent_died() and self.cfg.run_dir:  # it died while we stopped
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)

