"""Who may talk to whom on the control plane: CURVE key pairs, the ZAP gate, handshake failures, throttled logs.
(The deployment's key files: settings/keys.py.)

A deployment is one router and its workers. Two CURVE key pairs (ZeroMQ's Curve25519) per deployment:

    router key   the router's own; workers take orders only from its public key
    worker key   shared by every worker; the router lets in only its public key, and so does a decode
                 worker's KV receiver (prefill workers are its clients)

Sockets (server = the side that binds; its Gate answers libzmq's ZAP requests):
    router   register PULL          server, router key; Gate lets in the worker key
    worker   control PULL           server, worker key; Gate lets in the router key only
    decode   KV receiver ROUTER     server, worker key; Gate lets in the worker key
    decode   --kv-plaintext ROUTER  PLAIN server (no encryption); Gate lets in a password that is a token
                                    the receiver handed out over the CURVE channel, refuses any other at
                                    the handshake, before a byte of a message is read
    clients  router -> worker PUSH, worker -> router PUSH, prefill -> decode DEALER: each checks the
             server's public key in the handshake, so a process without the matching secret key cannot
             pose as the router or a worker, and everything after the handshake is encrypted

Rules for every loop that reads a socket: a failure of someone else's making (a refused key, a junk
frame) is counted and logged through a Throttle (one line per kind per interval, with how many it left
out), and no state is kept per unknown peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("pdserve.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks every CURVE server socket of a context
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)  # z85, 40 bytes; never in a repr or a log

    @classmethod
    def generate(cls) -> "KeyPair":
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


# ---- sockets ------------------------------------------------------------------------------------


def serve_curve(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make `sock` a CURVE server (before bind); its context needs a Gate first."""
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True


def serve_tokens(sock: zmq.Socket, domain: bytes) -> None:
    """Make `sock` a PLAIN server (before bind) whose clients need a token the context's Gate knows
    (Gate.tokens): libzmq holds every connection at its handshake until the Gate answers, and drops it
    on a refusal, so a peer without a token never gets a message frame read."""
    sock.plain_server = True
    sock.zap_domain = domain


def connect_token(sock: zmq.Socket, token: bytes) -> None:
    """Make `sock` a PLAIN client (before connect) presenting `token` (sent in clear: a bearer secret)."""
    sock.plain_username = b"token"
    sock.plain_password = token


def connect_curve(sock: zmq.Socket, pair: KeyPair, server_public: bytes) -> None:
    """Make `sock` a CURVE client (before connect) of the server holding `server_public`'s secret."""
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_serverkey = server_public


class Gate:
    """The ZAP handler of one ZMQ context: a CURVE client gets in if its public key is in `allowed`
    (the name becomes the connection's User-Id); a PLAIN client (serve_tokens) if `tokens(password)`
    holds (its User-Id: the token in hex); any other is refused and logged (throttled).

    Bind it before the context's server sockets; answer it from the thread that polls them
    (poll `gate.sock`, call `answer()` when readable): libzmq holds a handshake until the answer."""

    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str], where: str, throttle: "Throttle"):
        self.allowed, self.where, self.throttle = dict(allowed), where, throttle
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0
        self.tokens: Callable[[bytes], bool] | None = None  # PLAIN: is this password a live token?

    def answer(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 6:  # not a ZAP request; a REP socket must still answer to go on
                self.sock.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, _domain, address, _identity, mechanism, *creds = frames
            if mechanism == b"PLAIN":
                token = creds[1] if len(creds) == 2 else b""
                if self.tokens is not None and token and self.tokens(token):
                    self.sock.send_multipart([version, request_id, b"200", b"OK", token.hex().encode(), b""])
                    continue
                why = "its token is not one this worker handed out (or one it has forgotten)"
            else:
                key = z85.encode(creds[0]) if mechanism == b"CURVE" and creds and len(creds[0]) == 32 else None
                name = self.allowed.get(key) if key is not None else None
                if name is not None:
                    self.sock.send_multipart([version, request_id, b"200", b"OK", name.encode(), b""])
                    continue
                names = " or ".join(self.allowed.values())
                why = (f"its CURVE key {key.decode()} is not one this socket accepts ({names} key of this deployment)"
                       if key else f"it offers {mechanism.decode(errors='replace')}, not CURVE")
            self.refused += 1
            who = address.decode(errors="replace") or "a local peer"
            self.throttle("refused", logging.WARNING, "%s: refused a connection from %s: %s", self.where, who, why)
            self.sock.send_multipart([version, request_id, b"400", b"key not allowed", b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)


class HandshakeWatch:
    """A socket's failed CURVE handshakes (a monitor socket: poll `.sock`, read `failures()`)."""

    def __init__(self, sock: zmq.Socket, server: bool):
        self.server = server
        self._watched = sock
        self.sock = sock.get_monitor_socket(HANDSHAKE_FAILURES)

    def failures(self) -> list[str]:
        out = []
        while True:
            try:
                if not self.sock.poll(0):
                    return out
                event = recv_monitor_message(self.sock, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return out
            why = describe_failure(int(event["event"]), int(event["value"]), self.server)
            if why is not None:
                out.append(why)

    def close(self) -> None:
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)


def poller(sock: zmq.Socket, gate: "Gate | None", watch: "HandshakeWatch | None") -> zmq.Poller:
    """A poller for `sock` and, where they exist, its ZAP gate and handshake watch: a reader thread
    answers all three from one wait."""
    out = zmq.Poller()
    out.register(sock, zmq.POLLIN)
    for extra in (gate, watch):
        if extra is not None:
            out.register(extra.sock, zmq.POLLIN)
    return out


def describe_failure(event: int, value: int, server: bool) -> str | None:
    """What a failed handshake means, in words; None where the Gate has said it already (server side)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None if server else (f"the other side refused this process's CURVE key (ZAP status {value}): this "
                                    "process does not hold the key of this deployment that it accepts")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return ("a peer without CURVE (plain ZMQ) was refused: not a pdserve process of this deployment, or one "
                "started without its keys" if server else "the two sides disagree on CURVE: one of them runs "
                "without keys, or the other side is not a pdserve process")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return ("a peer encrypted for another server key: its copy of this side's public key is not this "
                "deployment's" if server else "the other side could not prove it holds the secret key it should")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and server:
        return ("a peer broke off the CURVE handshake: it does not hold this deployment's keys (or does not use "
                "CURVE), or it disconnected")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not server:
        return ("the other side dropped the CURVE handshake: its key is not the public key this process has "
                "for it (keys from another `pdserve keygen`?), one of the two runs without keys, or it is not a "
                "pdserve process")
    return f"a CURVE handshake failed (event {event:#x}, code {value:#x})"


# ---- throttled logging --------------------------------------------------------------------------


class Throttle:
    """Counts events by kind and logs the first of a kind at once, then at most one line per
    `every_s` seconds, saying how many it left out. Kinds are fixed strings, never peer names,
    so its state is bounded whoever sends what."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.logger, self.every_s = logger, every_s
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, kind: str, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            last = self._last.get(kind)
            if last is not None and now - last < self.every_s:
                self._skipped[kind] += 1
                return
            skipped = self._skipped.pop(kind, 0)
            self._last[kind] = now
        if skipped:
            msg += f" (and {skipped} more like it in the last {now - last:.0f} s)"
        self.logger.log(level, msg, *args)


class TokenBucket:
    """At most `rate` events a second on average, `burst` at once (what the router answers unknown peers with)."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, float(burst)
        self._tokens, self._at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
