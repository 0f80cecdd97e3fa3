"""What HTTP connections may hold: how many, how many per client address, which file descriptors, and
how long a client that does not read may keep its answer waiting (uvicorn's h11 protocol, guarded).

    connection_options(cfg)   uvicorn.Config's keyword arguments: the guarded protocol below, the
                              keep-alive and the listen backlog; the soft open-file limit is raised to
                              the hard one first
    ConnectionTable(limits)   the bookkeeping (no sockets): who gets in, and who gives way

A new connection is, in this order:
    refused (503) when its descriptor is in the reserve, and the connection that would give way to it
        at the cap (below) closed so that the next one fits: the last FD_RESERVE + 4 accept bursts of the open-file limit are kept for ZeroMQ
        (a worker connecting or reconnecting takes descriptors, and libzmq aborts the whole process
        when accept() finds none) and for files and pipes
    let in past its address's share (--client-share of --max-connections) by closing that address's
        idlest connection, or refused (429) when none is idle
    let in past --max-connections by closing the idlest connection, else the newest connection of the
        address holding the most connections if it holds more than the newcomer's would; else refused (503)
The idlest: a connection the server is closing whose client is not taking the rest, else the one
idle longest, at least IDLE_GRACE_S (a new connection's request may be on its way, unread).
A connection must send a request's headers within --header-timeout of its first byte (or of its last
response); one whose client takes no byte of what is written to it for --send-timeout (a streamed or a
whole answer, or a refusal) is aborted, and its descriptor and buffered answer freed.
"""

from __future__ import annotations

import logging
import resource
import socket
import struct
from dataclasses import dataclass

from pdserve.server.bodies import peer_of

log = logging.getLogger("pdserve.router")

FD_RESERVE = 256  # descriptors kept for everything but HTTP connections: worker sockets, files, pipes
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this (uvicorn's default)
FD_WARN_EVERY_S = 10.0  # a refusal for want of descriptors is logged at most this often
IDLE_GRACE_S = 0.5  # a connection is closed to make room only once idle this long: a new one may have sent
# its request already, still unread (seen: a burst of 16 connections made before any of their data was read)
SWEEPS_PER_TIMEOUT = 4  # how often, per --send-timeout, connections are checked for a client not reading


@dataclass(frozen=True)
class Limits:
    cap: int  # connections open at most
    per_peer: int  # of them, from one client address
    fd_line: int  # a connection whose descriptor is this or higher is refused: the rest is the reserve
    header_timeout_s: float
    send_timeout_s: float


# ---- the open-file limit -------------------------------------------------------------------------


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def accept_burst(fd_limit: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go before any of
    them is seen: 64 under a 1024-descriptor limit, 512 from 8192 up."""
    return max(16, min(512, fd_limit // 16))


def fd_line(fd_limit: int) -> int:
    """The lowest descriptor HTTP may not keep. accept() returns the lowest free descriptor, so a
    connection given this one means every one below is taken: above it stay FD_RESERVE, plus 4 accept
    bursts (asyncio accepts the next burst before the last one's connections are seen: measured, 2-3
    bursts in flight under a flood)."""
    return fd_limit - FD_RESERVE - 4 * accept_burst(fd_limit)


def connection_cap(wanted: int, fd_limit: int) -> int:
    """4 bursts stay free besides FD_RESERVE: the connections closed to make room close a loop turn or
    two later (measured: 1100 silent connections under a 1024 limit peak at 700-830 descriptors, none refused)."""
    return max(8, min(wanted, fd_limit - FD_RESERVE - 4 * accept_burst(fd_limit)))


def connection_options(cfg) -> dict:
    """uvicorn.Config's keyword arguments for the guarded HTTP/1.1 protocol."""
    fd_limit = raise_fd_limit()
    cap = connection_cap(cfg.max_connections, fd_limit)
    if cap < cfg.max_connections:
        log.warning("--max-connections %d is over what the open-file limit allows; capped at %d",
                    cfg.max_connections, cap)
    limits = Limits(cap, max(1, int(cfg.client_share * cap)), fd_line(fd_limit), cfg.header_timeout_s,
                    cfg.send_timeout_s)
    return {"http": guarded_protocol(limits), "timeout_keep_alive": KEEP_ALIVE_S, "backlog": accept_burst(fd_limit)}


# ---- who gets in (bookkeeping) -------------------------------------------------------------------


class ConnectionTable:
    """The connections let in, by client address. A connection (`conn`) needs .peer, .opened, .idle()
    (no request in progress), .idle_since (when it opened or last answered, loop time) and .stuck()
    (being closed, its client not taking the rest)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.live: set = set()
        self.by_peer: dict[str, set] = {}
        self.fd_warned_at = float("-inf")  # loop time a refusal in the descriptor reserve was last logged

    def admit(self, conn, now: float) -> tuple[object | None, str | None]:
        """(the connection to close for it, or None; None) once it is let in, or (None, the refusal's code)."""
        mine = self.by_peer.get(conn.peer, set())
        victim = None
        if len(mine) + 1 > self.limits.per_peer:
            victim = self.idlest(now, mine)
            if victim is None:
                return None, "client_connections"
        elif len(self.live) + 1 > self.limits.cap:
            victim = self.room_for(conn.peer, now)
            if victim is None:
                return None, "too_many_connections"
        if victim is not None:
            self.forget(victim)
        self.by_peer.setdefault(conn.peer, set()).add(conn)
        self.live.add(conn)
        return victim, None

    def room_for(self, peer: str, now: float):
        """The connection that gives way to a newcomer from `peer`: the idlest, else the newest of the
        address holding the most when it holds more than the newcomer's would (with it); else None."""
        idle = self.idlest(now)
        if idle is not None:
            return idle
        top = max(self.by_peer.values(), key=len, default=set())
        would_hold = len(self.by_peer.get(peer, ())) + 1
        return max(top, key=lambda c: c.opened) if len(top) > would_hold else None

    def idlest(self, now: float, among=None):
        """A stuck connection, else the one idle longest (at least IDLE_GRACE_S); None when none is."""
        best, best_key = None, None
        for c in self.live if among is None else among:
            stuck = c.stuck()
            if stuck or (c.idle() and now - c.idle_since >= IDLE_GRACE_S):
                key = (not stuck, c.idle_since)
                if best_key is None or key < best_key:
                    best, best_key = c, key
        return best

    def forget(self, conn) -> None:
        self.live.discard(conn)
        mine = self.by_peer.get(conn.peer)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self.by_peer[conn.peer]


# ---- the protocol (uvicorn) ----------------------------------------------------------------------


def guarded_protocol(limits: Limits):
    """uvicorn's h11 protocol under `limits` (imported here: only the process that serves HTTP needs
    uvicorn). Each call makes a class of its own, with its own table: one per server."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    table = ConnectionTable(limits)
    sweep = Sweep(limits.send_timeout_s)

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.opened = self.idle_since = self.loop.time()
            self.peer = peer_of(self.client[0] if self.client else None)
            self._header_timer = None
            self._unsent: tuple[int, float] | None = None  # (bytes written, not taken; since when)
            sweep.start(self.loop, self.connections)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.fileno() >= limits.fd_line:  # every descriptor below is taken
                return self._refuse_for_descriptors(sock.fileno())
            victim, refusal = table.admit(self, self.opened)
            if victim is not None:
                victim.drop()
            if refusal is not None:
                return _refuse(transport, _PEER_BUSY if refusal == "client_connections" else _BUSY)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.idle():
                self._arm()
            super().data_received(data)
            if self._header_timer is not None and not self.idle():
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            table.forget(self)
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self.idle_since = self.loop.time()
            super().on_response_complete()

        def idle(self) -> bool:
            """No request in progress, and not closing: waiting for (the rest of) a request's headers."""
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def stuck(self) -> bool:
            return self.transport.is_closing() and self.transport.get_write_buffer_size() > 0

        def drop(self) -> None:
            """Close it to make room; when its client is not taking what was written, at once and with a
            reset, so that neither this process nor the kernel keeps the rest."""
            table.forget(self)
            if self.transport.get_write_buffer_size():
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()
            else:
                self.transport.close()

        def check_unsent(self, now: float) -> None:
            """Abort when what was written to the client has not shrunk for --send-timeout."""
            size = self.transport.get_write_buffer_size()
            if size == 0:
                self._unsent = None
            elif self._unsent is None or size < self._unsent[0]:
                self._unsent = (size, now)
            elif now - self._unsent[1] >= limits.send_timeout_s:
                log.info("aborting a connection from %s: its client took none of %d bytes written to it for %.0fs "
                         "(--send-timeout)", self.peer, size, limits.send_timeout_s)
                self.drop()
            else:
                self._unsent = (size, self._unsent[1])  # more written, none taken: still waiting since then

        def _refuse_for_descriptors(self, fd: int) -> None:
            """Refused (its descriptor is freed), and the connection that would give way to it at the cap
            closes, so that the next one is given a descriptor below the line. HTTP never keeps one above
            it: a connection let in there would leave a hole below that the next accept() fills unchecked."""
            victim = table.room_for(self.peer, self.opened)
            if victim is not None:
                victim.drop()
            if self.opened - table.fd_warned_at >= FD_WARN_EVERY_S:  # once per FD_WARN_EVERY_S in a flood
                table.fd_warned_at = self.opened
                log.warning("refusing HTTP connections: descriptor %d is in the reserve kept for the workers' "
                            "sockets (open-file limit %d); raise `ulimit -n`", fd,
                            resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            _refuse(self.transport, _OUT_OF_FDS)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.idle() and not self.transport.is_closing():
                log.debug("closing a connection that sent no request headers within %.0fs", limits.header_timeout_s)
                self.transport.close()

    return Guarded


class Sweep:
    """A timer, while connections are open, that has each check what its client has not taken."""

    def __init__(self, send_timeout_s: float):
        self.period_s = send_timeout_s / SWEEPS_PER_TIMEOUT
        self.timer = None

    def start(self, loop, connections: set) -> None:
        if self.timer is None:
            self.timer = loop.call_later(self.period_s, self._tick, loop, connections)

    def _tick(self, loop, connections: set) -> None:
        self.timer = None
        now = loop.time()
        for c in list(connections):  # uvicorn's set of this server's connections: each a Guarded
            c.check_unsent(now)
        if connections:
            self.start(loop, connections)


def _refuse(transport, answer: bytes) -> None:
    transport.write(answer)
    transport.close()


def _answer(status: str, code: str, message: str, retry_after_s: int = 1) -> bytes:
    body = (b'{"error":{"message":"%s","type":"service_unavailable","param":null,"code":"%s"}}'
            % (message.encode(), code.encode()))
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: %d\r\n"
            b"Content-Length: %d\r\n\r\n" % (status.encode(), retry_after_s, len(body)) + body)


_BUSY = _answer("503 Service Unavailable", "too_many_connections", "too many connections, every one busy; retry")
_PEER_BUSY = _answer("429 Too Many Requests", "client_connections",
                     "your address has its share of this server's connections open (--client-share of "
                     "--max-connections), every one busy; use fewer at once, or retry")
_OUT_OF_FDS = _answer("503 Service Unavailable", "out_of_descriptors",
                      "this server is near its open-file limit; retry")
