"""The router's view of its workers: registration, heartbeats, liveness, and message delivery.

    WorkerPool(cfg, metrics)
      .start() / .stop()          bind the registration endpoint (PULL, a CURVE server when cfg.keys); a
                                  reader thread takes each message off it as it lands, stamps and screens it;
                                  one task handles what passed, one sweeps
      .alive(role)                the live workers of a role: the candidates server/routing.py chooses from
      .send(worker, msg)          PUSH to the worker's control endpoint (a CURVE client of the worker key)
      .open_inbox(request_id)     per-request queue the receive task fills with that request's messages,
                                  as (message, time.monotonic() it landed on the router)
      .attach(request_id, worker) the request depends on that worker: if it is dropped, the inbox gets
                                  WorkerLost; only workers attached to a request can deliver to it
      .accepted(worker, names)    that worker took a request of a prompt of these block names: the KV
                                  index (server/kv_index.py) lists them there; a worker forgotten there
                                  has its entries freed by a task of its own, in slices (reap)

A worker is dropped when it says Goodbye, misses `heartbeat_misses` heartbeats in a row, or its
supervisor saw its process exit (`lost`); nothing is routed to it afterwards and every request
attached to it gets WorkerLost at once.

Identity: a worker id belongs to the incarnation (protocol/control.py) that registered it while that
one lives: a Register of a held id from another incarnation is refused (retry later), and every other
message counts only under the incarnation that holds its worker id.

The register socket is read, stamped and screened by a thread of its own (server/register.py): what
reaches this module's receive task is only messages of live incarnations and, at a bounded rate,
what strangers need an answer to. Liveness is judged from that thread's stamps (`sweep`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdserve.settings.router import RouterConfig
from pdserve.server.metrics import Metrics
from pdserve.server.kv_index import KVIndex
from pdserve.server.register import RegisterReader
from pdserve.protocol import auth
from pdserve.protocol import control as P
from pdserve.protocol.enums import ROLES, Role

log = logging.getLogger("pdserve.router")

MAX_WORKERS = 1024  # live workers; a Register past it is refused (each one costs a socket)
MAX_ORPHANS = 1024  # workers dropped for silence whose requests we remember (to abort them if they return)


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
    incarnation: str
    sock: zmq.asyncio.Socket
    last_seen: float  # time.monotonic()
    free_blocks: int
    queue_depth: int = 0
    running: int = 0
    inflight: set[str] = field(default_factory=set)  # request ids routed here and not finished
    costs: P.KVCosts | None = None  # what prices a request here (its last heartbeat)
    # request id -> prompt tokens routed here expected to be computed, until its first token (KV routing)
    pending: dict[str, int] = field(default_factory=dict)
    chosen: int = 0  # times the KV-aware choice picked it (its ties go round)
    kv_names: int = 0  # block names the router's index holds for it (its reports)

    @property
    def block_root(self) -> bytes | None:
        return self.info.block_root

    @property
    def id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    def can_send_kv_to(self, decode: "WorkerState") -> bool:
        """A prefill worker pushes KV only into a decode worker of its own transport and mode."""
        return (self.role == Role.PREFILL and decode.role == Role.DECODE
                and (self.info.transport, self.info.mode) == (decode.info.transport, decode.info.mode))

    def describe(self, private: bool = True) -> dict:
        """What /health shows; without `private`, no addresses and no PIDs."""
        i = self.info
        out = {"id": i.worker_id, "role": i.role, "device": i.device, "dtype": i.dtype, "model": i.model,
               "transport": i.transport, "mode": i.mode, "max_model_len": i.max_model_len,
               "block_size": i.block_size, "num_blocks": i.num_blocks, "free_blocks": self.free_blocks,
               "queue_depth": self.queue_depth, "running": self.running, "in_flight": len(self.inflight),
               "kv_blocks_indexed": self.kv_names,
               "queued_tokens": self.costs.queued_tokens if self.costs is not None else None,
               "last_heartbeat_s": round(time.monotonic() - self.last_seen, 3)}
        if private:
            out.update(address=i.address, kv_address=i.kv_address, pid=i.pid)
        return out


class WorkerPool:
    def __init__(self, cfg: RouterConfig, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.workers: dict[str, WorkerState] = {}
        self.known: dict[str, str] = {}  # incarnation -> worker id of every live worker (the reader reads it)
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.kv = KVIndex()  # block name -> which worker holds it, in which tier (their KVEvents)
        self.address: str | None = None  # the bound registration endpoint
        self.changed = asyncio.Event()  # set on every registration or drop (for waiters)
        self._forgotten = asyncio.Event()  # set when the KV index has forgotten entries to free
        self.throttle = auth.Throttle(log)
        # requests failed because their worker was dropped for silence: if that same process comes
        # back (it was slow, not dead) it is told to abort them, so it frees their blocks
        self._orphans: dict[tuple[str, str], set[str]] = {}  # (worker id, incarnation) -> request ids
        self._ever: set[str] = set()  # worker ids registered before (a new process under one: a restart)
        self._reader: RegisterReader | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._reader = RegisterReader(self.cfg.register, asyncio.get_running_loop(), self.cfg.keys, self.known,
                               self.metrics, self.throttle)
        self.address = self._reader.address
        self._tasks = [asyncio.create_task(self._receive(), name="pool-receive"),
                       asyncio.create_task(self._sweep(), name="pool-sweep"),
                       asyncio.create_task(self._reap(), name="pool-reap")]
        log.info("workers register at %s (%s)", self.address,
                 "CURVE: only the deployment's worker key" if self.cfg.keys else "no authentication")

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in list(self.workers.values()):
            w.sock.close()
        self.workers.clear()
        self.known.clear()
        if self._reader is not None:
            self._reader.stop()
        self.ctx.term()

    # ---- the registry -----------------------------------------------------------------------------

    def alive(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]

    def shortfall(self, expected: dict[str, int] | None) -> dict[str, int]:
        """role -> how many workers fewer than `expected` are live (roles at or above their count left out)."""
        live = {role: len(self.alive(role)) for role in (expected or {})}
        return {role: n - live[role] for role, n in (expected or {}).items() if live[role] < n}

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
            w.pending.pop(request_id, None)

    def attach(self, request_id: str, worker: WorkerState) -> None:
        if worker.id not in self.workers:
            raise NoWorker(f"worker {worker.id} was dropped just now; retry the request")
        worker.inflight.add(request_id)

    def detach(self, request_id: str, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.inflight.discard(request_id)

    def accepted(self, worker: WorkerState, names: list[bytes]) -> None:
        """`worker` took a request of a prompt of these block names: the KV index lists them there (only
        while that incarnation lives: a dropped one's names are gone)."""
        if names and self.workers.get(worker.id) is worker:
            self.kv.accepted(worker.id, names)
            worker.kv_names = self.kv.names_of(worker.id)

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self.workers

    async def send(self, worker: WorkerState, msg) -> None:
        await worker.sock.send(P.from_router(worker.incarnation, msg))

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
            for landed, env in batch:
                try:
                    await self._dispatch(env, landed)
                except Exception:  # one bad message must not stop the router from hearing its workers
                    log.exception("handling %s failed", type(env.msg).__name__)

    async def _dispatch(self, env: P.FromWorker, landed: float) -> None:
        msg, inc = env.msg, env.incarnation
        if isinstance(msg, P.Register):
            await self._on_register(inc, msg, landed)
            return
        w = self.workers.get(msg.worker_id)
        if w is None or w.incarnation != inc:  # dropped between the reader's screen and now; or a stranger
            if isinstance(msg, P.Heartbeat):  # we restarted, or dropped it for silence: register again
                await self._answer_stranger(msg.address, inc, P.RegisterAck(
                    P.PROTOCOL_VERSION, False, self.cfg.heartbeat_interval_s,
                    error="this router does not know this worker process", retry=True))
            return
        w.last_seen = max(w.last_seen, landed)
        if isinstance(msg, P.Heartbeat):
            w.free_blocks, w.queue_depth, w.running = msg.free_blocks, msg.queue_depth, msg.running
            w.costs = msg.costs
            self.metrics.worker_seen(w.id, w.role, msg.queue_depth, msg.running, msg.free_blocks, w.info.num_blocks)
            if msg.cache is not None:
                self.metrics.observe_kv_tiers(w.id, w.role, msg.cache.as_stats())
            if msg.faults is not None:
                f = msg.faults
                self.metrics.observe_faults(w.id, w.role, f.fenced_waits, f.fenced_blocks, f.integrity_failures)
        elif isinstance(msg, P.KVEvents):
            self.kv.apply(w.id, msg)
            w.kv_names = self.kv.names_of(w.id)
            self._reap_forgotten()
        elif isinstance(msg, P.Goodbye):
            self._drop(w, f"it exited ({msg.reason})", logging.INFO)  # it said so: a crash is in its own log
        elif isinstance(msg, P.Tokens):
            for out in msg.outputs:
                self._deliver(w, out.request_id, out, landed)
        else:  # Reserved, PrefillDone, RequestFailed
            self._deliver(w, msg.request_id, msg, landed)

    def _deliver(self, w: WorkerState, request_id: str, msg, landed: float) -> None:
        q = self.inboxes.get(request_id)
        if q is not None and request_id in w.inflight:
            w.pending.pop(request_id, None)  # its prefill is over (or failed): no longer ahead of others
            q.put_nowait((msg, landed))
        elif q is not None:  # a worker writing to a request that is not routed to it
            self.metrics.control_dropped.labels("not_routed").inc()
            self.throttle("not_routed", logging.WARNING, "dropped a %s from %s for request %s, which is not routed "
                          "to it", type(msg).__name__, w.id, request_id)
        else:
            log.debug("message %s for finished request %s", type(msg).__name__, request_id)

    async def _on_register(self, inc: str, reg: P.Register, landed: float) -> None:
        refusal = None
        old = self.workers.get(reg.worker_id)
        if reg.version != P.PROTOCOL_VERSION:
            refusal = (f"worker {reg.worker_id} speaks protocol version {reg.version}, this router "
                       f"{P.PROTOCOL_VERSION}; run the same pdserve version on both")
        elif reg.model != self.cfg.model:
            refusal = (f"worker {reg.worker_id} serves model {reg.model!r}, this router {self.cfg.model!r}; "
                       f"start the worker with --model {self.cfg.model}")
        elif reg.role not in ROLES:
            refusal = f"worker {reg.worker_id} has unknown role {reg.role!r}"
        elif old is None and len(self.workers) >= MAX_WORKERS:
            refusal = f"this router has {MAX_WORKERS} workers already; worker {reg.worker_id} is not taken"
        if refusal is not None:
            self.metrics.control_dropped.labels("refused").inc()
            self.throttle("refused", logging.ERROR, "refused: %s", refusal)
            await self._answer_stranger(reg.address, inc, P.RegisterAck(P.PROTOCOL_VERSION, False, error=refusal))
            return
        if old is not None and old.incarnation != inc:
            held = (f"worker id {reg.worker_id} is held by a live worker process (pid {old.info.pid}, heard "
                    f"{time.monotonic() - old.last_seen:.1f}s ago); give this one another --worker-id, or wait: "
                    f"the id is free {self.cfg.heartbeat_timeout_s:.1f}s after that process goes silent")
            self.metrics.control_dropped.labels("id_held").inc()
            self.throttle("id_held", logging.WARNING, "refused a registration: %s", held)
            await self._answer_stranger(reg.address, inc, P.RegisterAck(P.PROTOCOL_VERSION, False, error=held,
                                                                        retry=True))
            return
        if old is None:
            if reg.worker_id in self._ever:  # a new process under an id we had: a restart
                self.metrics.restarts.labels(reg.role).inc()
            elif len(self._ever) < 16 * MAX_WORKERS:  # ids, not processes; bounded all the same
                self._ever.add(reg.worker_id)
            w = WorkerState(reg, inc, self._connect(reg.address), landed, reg.free_blocks)
            self.kv.forget(reg.worker_id)  # a new incarnation: what an earlier one held is gone
            if reg.block_root is not None:
                self.kv.register(reg.worker_id)
            self._reap_forgotten()
            self.workers[reg.worker_id] = w
            self.known[inc] = reg.worker_id
            for rid in self._orphans.pop((reg.worker_id, inc), ()):
                await self.send(w, P.Abort(rid, "the router dropped this worker for silence and failed the request"))
            log.info("worker %s registered: %s on %s, control %s%s", reg.worker_id, reg.role, reg.device,
                     reg.address, f", KV {reg.transport}/{reg.mode}" if reg.transport else "")
            self.metrics.workers.labels(reg.role).set(len(self.alive(reg.role)))
            self.metrics.worker_registered(reg.worker_id, reg.role, reg.num_blocks, reg.free_blocks)
            self.changed.set()
        else:
            w = old
            w.last_seen = max(w.last_seen, landed)
        await self.send(w, P.RegisterAck(P.PROTOCOL_VERSION, True, self.cfg.heartbeat_interval_s))
        if old is None:
            await self._introduce(w)

    async def _answer_stranger(self, address: str, inc: str, ack: P.RegisterAck) -> None:
        """One message to a process that is not (or no longer) a registered worker, on a socket of its
        own; the reader lets such messages through at a bounded rate, so these sockets stay few."""
        sock = self._connect(address)
        await sock.send(P.from_router(inc, ack))
        sock.close(linger=500)

    async def _introduce(self, w: WorkerState) -> None:
        """Have every prefill worker shake hands with every decode worker it can send to, as soon as
        both are registered (the handshake then stays out of the first request's TTFT)."""
        pairs = [(p, w) for p in self.alive(Role.PREFILL)] + [(w, d) for d in self.alive(Role.DECODE)]
        for p, d in pairs:  # w as the decode worker, then as the prefill worker (one of them can be it)
            if p.can_send_kv_to(d):
                await self.send(p, P.Connect(d.id, d.info.kv_address))

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.cfg.keys is not None:  # only the holder of the worker key's secret completes the handshake
            auth.connect_curve(sock, self.cfg.keys.router, self.cfg.keys.worker_public)
        sock.connect(address)
        return sock

    # ---- liveness ---------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s / 4)
            self.sweep()

    def sweep(self) -> None:
        """Drop every worker the reader has not heard from for longer than the heartbeat timeout, judged
        at the time up to which the reader has read everything (after a stall of the router itself,
        the heartbeats are in the socket, just not read yet: judge after reading them)."""
        heard = self._reader.heard
        horizon = self._reader.caught_up_at
        for w in list(self.workers.values()):
            last = max(w.last_seen, heard.get(w.incarnation, 0.0))
            silent = horizon - last
            if silent > self.cfg.heartbeat_timeout_s:
                self._drop(w, f"no heartbeat for {silent:.1f}s (limit {self.cfg.heartbeat_timeout_s:.1f}s)")
        for inc in [i for i in heard if i not in self.known]:  # dropped meanwhile
            heard.pop(inc, None)

    def lost(self, worker_id: str, pid: int, reason: str) -> None:
        """The process `pid` that holds `worker_id` is gone (pdserve's supervisor saw it exit): drop it
        now rather than at the heartbeat timeout. A later incarnation under the same id is untouched."""
        w = self.workers.get(worker_id)
        if w is not None and w.info.pid == pid:
            self._drop(w, reason)

    def _drop(self, w: WorkerState, reason: str, level: int = logging.WARNING) -> None:
        if self.workers.get(w.id) is not w:
            return
        del self.workers[w.id]
        self.known.pop(w.incarnation, None)
        self.kv.forget(w.id)
        self._reap_forgotten()
        w.sock.close()
        log.log(level, "worker %s (%s) dropped: %s", w.id, w.role, reason)
        self.metrics.workers.labels(w.role).set(len(self.alive(w.role)))
        self.metrics.lost_workers.labels(w.role).inc()
        self.metrics.worker_gone(w.id, w.role)
        for rid in w.inflight:
            self._deliver_lost(rid, WorkerLost(w.id, reason))
        if w.inflight:
            self._orphans[(w.id, w.incarnation)] = set(w.inflight)
            while len(self._orphans) > MAX_ORPHANS:  # the oldest first: it is the least likely to come back
                del self._orphans[next(iter(self._orphans))]
        self.changed.set()

    # ---- the KV index's forgotten entries ---------------------------------------------------------

    def _reap_forgotten(self) -> None:
        if self.kv.dying:
            self._forgotten.set()

    async def _reap(self) -> None:
        """Free what the KV index forgot (a dropped or restarted worker's millions of names) a slice at a
        time, yielding between slices: /health and every request's tokens go on meanwhile."""
        while True:
            await self._forgotten.wait()
            self._forgotten.clear()
            while self.kv.reap():
                await asyncio.sleep(0)

    def _deliver_lost(self, request_id: str, lost: WorkerLost) -> None:
        q = self.inboxes.get(request_id)
        if q is not None:
            q.put_nowait((lost, time.monotonic()))
