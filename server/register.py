"""The router's register socket (PULL), read, stamped and screened by a thread of its own.

    RegisterReader(endpoint, loop, keys, known, metrics, throttle)
      .address        the bound endpoint
      .frames         asyncio.Queue of batches [(landed, FromWorker)] for the pool's receive task
      .known          incarnation -> worker id of every live worker (written by the pool, on the loop)
      .heard          incarnation -> time.monotonic() its latest message landed (live workers only)
      .caught_up_at   every frame that was waiting at this time has been read
      .stop()

With keys the socket is a CURVE server: its Gate (answered on this thread) lets in only the
deployment's worker key, so junk from anyone else dies in libzmq's handshake, logged (throttled).

Why a thread: a token that lands while the event loop is busy (streaming other requests, parsing,
JSON) would be stamped only when the loop gets to it; stamped on arrival, that wait counts as the
router's own (`first_token_send`), and `hops` (protocol/phases.py) is the messages' flight. The same
thread screens what lands, so a flood never reaches the event loop (and /health): frames that do not
decode, and messages of unknown incarnations, are counted (pdserve_control_dropped) and dropped here,
logged at most once per interval per kind; what a stranger needs an answer to (a Register, a
Heartbeat of a worker the router forgot) passes at a bounded rate; nothing is kept per unknown peer.

Liveness is judged from this thread's stamps, not from how far the loop got: libzmq serves the
connections with pending frames in turn, one frame each, so once a batch of READ_BATCH reads (more
than there are connections) or an empty socket has been seen, every worker that had sent something
before the batch began has been heard (`caught_up_at`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from urllib.parse import urlsplit

import zmq

from pdserve.server.metrics import Metrics
from pdserve.protocol import auth
from pdserve.settings import keys
from pdserve.protocol import control as P

MAX_REGISTER_FRAME = 4 * 2**20  # bytes; the largest real message (a step's Tokens) is a few KB
STRANGER_RATE, STRANGER_BURST = 20.0, 50  # answers a second to unknown incarnations (Register, Heartbeat)
READ_BATCH = 1000  # frames per hand-off to the loop: the first ones get there without delay


class RegisterReader:
    """The registration socket (PULL), read and screened by a thread: every frame stamped
    (time.monotonic()) as it lands; what passes goes to the event loop in batches."""

    POLL_MS = 50  # wake up this often to notice stop()

    def __init__(self, endpoint: str, loop: asyncio.AbstractEventLoop, keys: keys.RouterKeys | None,
                 known: dict[str, str], metrics: Metrics, throttle: auth.Throttle):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REGISTER_FRAME)  # a bigger frame drops its connection
        self.gate = self.watch = None
        if keys is not None:
            self.gate = auth.Gate(self.ctx, keys.gate(), "register socket", throttle)
            auth.serve_curve(self.sock, keys.router)
            self.watch = auth.HandshakeWatch(self.sock, server=True)
        self.sock.bind(_bindable(endpoint))
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frames: asyncio.Queue[list[tuple[float, P.FromWorker]]] = asyncio.Queue()  # event loop side
        self.known = known  # incarnation -> worker id, written by the loop only
        self.heard: dict[str, float] = {}  # incarnation -> when its latest message landed (this thread)
        self.caught_up_at = time.monotonic()  # every frame pending at this time has been read
        self._strangers = auth.TokenBucket(STRANGER_RATE, STRANGER_BURST)
        self._metrics, self._throttle = metrics, throttle
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="pool-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poller = auth.poller(self.sock, self.gate, self.watch)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                ready = dict(poller.poll(self.POLL_MS))
                if self.gate is not None and self.gate.sock in ready:
                    self.gate.answer()
                if self.watch is not None and self.watch.sock in ready:
                    for why in self.watch.failures():
                        self._drop("handshake", "register socket: %s", why, kind=why)  # a fixed set of texts
                batch = self._read_batch() if self.sock in ready else []
                self.caught_up_at = started
                if batch:
                    self._loop.call_soon_threadsafe(self.frames.put_nowait, batch)
        except RuntimeError:  # the event loop closed under us: nothing is listening any more
            pass
        finally:
            for extra in (self.watch, self.gate):
                if extra is not None:
                    extra.close()
            self.sock.close()

    def _read_batch(self) -> list[tuple[float, P.FromWorker]]:
        batch = []
        for _ in range(READ_BATCH):
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            landed = time.monotonic()
            try:
                env = P.decode_to_router(frame)
            except P.ProtocolError as e:
                self._drop("junk", "dropped a frame on the register socket: %s", e)
                continue
            if self._admit(env, landed):
                batch.append((landed, env))
        return batch

    def _admit(self, env: P.FromWorker, landed: float) -> bool:
        """Does this message go to the loop? Known incarnations' do; strangers' only what needs an answer."""
        msg = env.msg
        owner = self.known.get(env.incarnation)
        if owner is not None:
            if owner != msg.worker_id:
                self._drop("impostor", "dropped a %s naming worker %s under the incarnation of %s",
                           type(msg).__name__, msg.worker_id, owner)
                return False
            self.heard[env.incarnation] = landed
            return True
        if isinstance(msg, (P.Register, P.Heartbeat)):
            if self._strangers.take():
                return True
            self._drop("rate_limited", "dropped a %s from an unknown worker incarnation (over %.0f a second)",
                       type(msg).__name__, STRANGER_RATE)
            return False
        self._drop("stranger", "dropped a %s naming worker %s from an unknown incarnation (not registered, or "
                   "dropped already)", type(msg).__name__, msg.worker_id)
        return False

    def _drop(self, reason: str, text: str, *args, kind: str | None = None) -> None:
        self._metrics.control_dropped.labels(reason).inc()
        self._throttle(kind or reason, logging.WARNING, text, *args)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.term()


def _bindable(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port == 0:
        return f"tcp://{parts.hostname}:*"
    return endpoint
