"""The router's view of its workers: registration, heartbeats, liveness, choice, and message delivery.

    WorkerPool(cfg, metrics)
      .start() / .stop()          bind the registration endpoint (PULL); a reader thread takes each
                                  message off it as it lands and stamps it; one task handles them, one sweeps
      .pick(role, ...)            the least-loaded live worker of a role, or NoWorker
      .send(worker, msg)          PUSH to the worker's control endpoint
      .open_inbox(request_id)     per-request queue the receive task fills with that request's messages,
                                  as (message, time.monotonic() it landed on the router)
      .attach(request_id, worker) the request depends on that worker: if it is dropped, the inbox gets
                                  WorkerLost

A worker is dropped when it says Goodbye or misses `heartbeat_misses` heartbeats in a row; nothing
is routed to it afterwards and every request attached to it gets WorkerLost at once.

Why a reader thread: a token that lands while the event loop is busy (streaming other requests,
parsing, JSON) would be stamped only when the loop gets to it; stamped on arrival, that wait counts
as the router's own (`first_token_send`), and `hops` (workers/phases.py) is the messages' flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from server.config import RouterConfig
from server.metrics import Metrics
from workers import protocol as P

log = logging.getLogger("pdserve.router")


class NoWorker(Exception):
    pass


@dataclass(frozen=True)
class WorkerLost:
    """Delivered to the inbox of every request that depended on a dropped worker."""

    worker_id: str
    reason: str


@dataclass
class WorkerState:
    info: P.Register
    sock: zmq.asyncio.Socket
    last_seen: float  # time.monotonic()
    free_blocks: int
    queue_depth: int = 0
    running: int = 0
    inflight: set[str] = field(default_factory=set)  # request ids routed here and not finished

    @property
    def id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    def load(self) -> tuple[int, int]:
        """Smaller is less loaded: requests the router has in flight here (exact, immediate), then the
        worker's own queue as of its last heartbeat, then more free blocks."""
        return (len(self.inflight) + self.queue_depth, -self.free_blocks)

    def describe(self) -> dict:
        i = self.info
        return {"id": i.worker_id, "role": i.role, "address": i.address, "device": i.device, "dtype": i.dtype,
                "pid": i.pid, "model": i.model, "transport": i.transport, "mode": i.mode,
                "kv_address": i.kv_address, "max_model_len": i.max_model_len, "block_size": i.block_size,
                "num_blocks": i.num_blocks, "free_blocks": self.free_blocks, "queue_depth": self.queue_depth,
                "running": self.running, "in_flight": len(self.inflight),
                "last_heartbeat_s": round(time.monotonic() - self.last_seen, 3)}


class _Reader:
    """The registration socket (PULL), read by a thread: every frame stamped (time.monotonic()) as
    it lands, handed to the event loop in batches."""

    POLL_MS = 50  # wake up this often to notice stop()

    def __init__(self, endpoint: str, loop: asyncio.AbstractEventLoop):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(_bindable(endpoint))
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frames: asyncio.Queue[list[tuple[float, bytes]]] = asyncio.Queue()  # event loop side
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="pool-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(self.POLL_MS):
                    continue
                batch = []
                while len(batch) < 1000:  # bounded: the loop gets the first messages without delay
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch.append((time.monotonic(), frame))
                if batch:
                    self._loop.call_soon_threadsafe(self.frames.put_nowait, batch)
        except RuntimeError:  # the event loop closed under us: nothing is listening any more
            pass
        finally:
            self.sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.term()


def _bindable(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port == 0:
        return f"tcp://{parts.hostname}:*"
    return endpoint


class WorkerPool:
    def __init__(self, cfg: RouterConfig, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.workers: dict[str, WorkerState] = {}
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.address: str | None = None  # the bound registration endpoint
        self.changed = asyncio.Event()  # set on every registration or drop (for waiters)
        # requests failed because their worker was dropped for silence: if that same process comes
        # back (it was slow, not dead) it is told to abort them, so it frees their blocks
        self._orphans: dict[tuple[str, int], set[str]] = {}
        self._reader: _Reader | None = None
        self._unhandled = 0  # messages of the batch being handled still to go
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._reader = _Reader(self.cfg.register, asyncio.get_running_loop())
        self.address = self._reader.address
        self._tasks = [asyncio.create_task(self._receive(), name="pool-receive"),
                       asyncio.create_task(self._sweep(), name="pool-sweep")]
        log.info("workers register at %s", self.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in list(self.workers.values()):
            w.sock.close()
        self.workers.clear()
        if self._reader is not None:
            self._reader.stop()
        self.ctx.term()

    # ---- choice -----------------------------------------------------------------------------------

    def alive(self, role: str, transport: str | None = None) -> list[WorkerState]:
        return [w for w in self.workers.values()
                if w.role == role and (transport is None or w.info.transport == transport)]

    def pick(self, role: str, *, transport: str | None = None, need_blocks: int = 0) -> WorkerState:
        candidates = self.alive(role, transport)
        if not candidates:
            which = f"{role} worker" + (f" with transport {transport}" if transport else "")
            raise NoWorker(f"no {which} is registered; start one (pdserve-worker --role {role} "
                           f"--router {self.address}) or use another policy")
        roomy = [w for w in candidates if w.free_blocks >= need_blocks]
        return min(roomy or candidates, key=WorkerState.load)

    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    # ---- requests ---------------------------------------------------------------------------------

    def open_inbox(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.inboxes[request_id] = q
        return q

    def close_inbox(self, request_id: str) -> None:
        self.inboxes.pop(request_id, None)
        for w in self.workers.values():
            w.inflight.discard(request_id)

    def attach(self, request_id: str, worker: WorkerState) -> None:
        if worker.id not in self.workers:
            raise NoWorker(f"worker {worker.id} was dropped just now; retry the request")
        worker.inflight.add(request_id)

    def detach(self, request_id: str, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.inflight.discard(request_id)

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self.workers

    async def send(self, worker: WorkerState, msg) -> None:
        await worker.sock.send(P.encode(msg))

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        """Wait until predicate(self) holds (re-checked on every registration or drop)."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while not predicate(self):
            self.changed.clear()
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return predicate(self)
        return True

    # ---- the receive task -------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            batch = await self._reader.frames.get()
            for i, (landed, frame) in enumerate(batch):
                self._unhandled = len(batch) - i
                try:
                    msg = P.decode_to_router(frame)
                except P.ProtocolError as e:
                    log.error("dropped a message: %s", e)
                    continue
                try:
                    await self._dispatch(msg, landed)
                except Exception:  # one bad message must not stop the router from hearing its workers
                    log.exception("handling %s failed", type(msg).__name__)
            self._unhandled = 0

    async def _dispatch(self, msg, landed: float) -> None:
        if isinstance(msg, P.Register):
            await self._on_register(msg)
        elif isinstance(msg, P.Heartbeat):
            await self._on_heartbeat(msg)
        elif isinstance(msg, P.Goodbye):
            w = self.workers.get(msg.worker_id)
            if w is not None:
                self._drop(w, f"it exited ({msg.reason})")
        elif isinstance(msg, P.Tokens):
            self._touch(msg.worker_id)
            for out in msg.outputs:
                self._deliver(out.request_id, out, landed)
        else:  # Reserved, PrefillDone, RequestFailed
            self._touch(msg.worker_id)
            self._deliver(msg.request_id, msg, landed)

    def _deliver(self, request_id: str, msg, landed: float) -> None:
        q = self.inboxes.get(request_id)
        if q is not None:
            q.put_nowait((msg, landed))
        else:
            log.debug("message %s for finished request %s", type(msg).__name__, request_id)

    def _touch(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = time.monotonic()

    async def _on_register(self, reg: P.Register) -> None:
        refusal = None
        if reg.version != P.PROTOCOL_VERSION:
            refusal = (f"worker {reg.worker_id} speaks protocol version {reg.version}, this router "
                       f"{P.PROTOCOL_VERSION}; run the same pdserve version on both")
        elif reg.model != self.cfg.model:
            refusal = (f"worker {reg.worker_id} serves model {reg.model!r}, this router {self.cfg.model!r}; "
                       f"start the worker with --model {self.cfg.model}")
        elif reg.role not in P.ROLES:
            refusal = f"worker {reg.worker_id} has unknown role {reg.role!r}"
        old = self.workers.get(reg.worker_id)
        if old is not None and (old.info.pid != reg.pid or old.info.address != reg.address):
            self._drop(old, "a new process registered under its id")
            old = None
        if refusal is not None:
            log.error("refused: %s", refusal)
            sock = self._connect(reg.address)
            await sock.send(P.encode(P.RegisterAck(P.PROTOCOL_VERSION, False, error=refusal)))
            sock.close(linger=1000)
            return
        if old is None:
            w = WorkerState(reg, self._connect(reg.address), time.monotonic(), reg.free_blocks)
            self.workers[reg.worker_id] = w
            for rid in self._orphans.pop((reg.worker_id, reg.pid), ()):
                await w.sock.send(P.encode(P.Abort(rid, "the router dropped this worker for silence and failed "
                                                        "the request")))
            log.info("worker %s registered: %s on %s, control %s%s", reg.worker_id, reg.role, reg.device,
                     reg.address, f", KV {reg.transport}/{reg.mode}" if reg.transport else "")
            self.metrics.workers.labels(reg.role).set(len(self.alive(reg.role)))
            self.changed.set()
        else:
            w = old
            w.last_seen = time.monotonic()
        await w.sock.send(P.encode(P.RegisterAck(P.PROTOCOL_VERSION, True, self.cfg.heartbeat_interval_s)))
        if old is None:
            await self._introduce(w)

    async def _introduce(self, w: WorkerState) -> None:
        """Have every prefill worker shake hands with every decode worker it can send to, as soon as
        both are registered (the handshake then stays out of the first request's TTFT)."""
        if w.role == "decode":
            pairs = [(p, w) for p in self.alive("prefill", w.info.transport) if p.info.mode == w.info.mode]
        elif w.role == "prefill":
            pairs = [(w, d) for d in self.alive("decode", w.info.transport) if d.info.mode == w.info.mode]
        else:
            return
        for p, d in pairs:
            await p.sock.send(P.encode(P.Connect(d.id, d.info.kv_address)))

    async def _on_heartbeat(self, hb: P.Heartbeat) -> None:
        w = self.workers.get(hb.worker_id)
        if w is None:  # we restarted, or dropped it for silence: ask it to register again
            sock = self._connect(hb.address)
            await sock.send(P.encode(P.RegisterAck(P.PROTOCOL_VERSION, False, self.cfg.heartbeat_interval_s,
                                                   error="this router does not know the worker", retry=True)))
            sock.close(linger=1000)
            return
        w.last_seen = time.monotonic()
        w.free_blocks, w.queue_depth, w.running = hb.free_blocks, hb.queue_depth, hb.running
        self.metrics.worker_seen(w.id, w.role, hb.queue_depth, hb.running, hb.free_blocks)

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(address)
        return sock

    # ---- liveness ---------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s / 4)
            if self._unhandled or not self._reader.frames.empty():
                # messages wait to be handled: after a stall of the router itself (CPU starved, a long
                # tokenization) the heartbeats are here, just not read yet; judge after reading them
                continue
            now = time.monotonic()
            for w in list(self.workers.values()):
                silent = now - w.last_seen
                if silent > self.cfg.heartbeat_timeout_s:
                    self._drop(w, f"no heartbeat for {silent:.1f}s (limit {self.cfg.heartbeat_timeout_s:.1f}s)")

    def _drop(self, w: WorkerState, reason: str) -> None:
        if self.workers.get(w.id) is not w:
            return
        del self.workers[w.id]
        w.sock.close()
        log.warning("worker %s (%s) dropped: %s", w.id, w.role, reason)
        self.metrics.workers.labels(w.role).set(len(self.alive(w.role)))
        self.metrics.lost_workers.labels(w.role).inc()
        self.metrics.worker_gone(w.id, w.role)
        for rid in w.inflight:
            self._deliver(rid, WorkerLost(w.id, reason), time.monotonic())
        if w.inflight:
            self._orphans[(w.id, w.info.pid)] = set(w.inflight)
        self.changed.set()
