"""Request bodies being read: bounded router-wide and per client address, and kept moving, so that
no one client can hold the budget every other client needs.

    peer_of(host)                   the address a client's share is counted under: an IPv4 address, an
                                    IPv6 /64 (one host is usually given a whole /64), "local" without one
    BodyBudget(cfg).read(request)   the body, or one of:
        413                 over --max-body-mb (from Content-Length, or as soon as the stream passes it)
        429 (closed)        the client's address already has its share (--client-share) of
                            --max-bodies-mb being read
        503 (closed)        --max-bodies-mb are being read and no address holds more than this one would
        503 (closed)        this upload was cut to make room for an address holding less (below)
        408 (closed)        past --body-timeout, or a window of rate_window_s (5 s) that brought less
                            than --min-body-rate (a slow body is cut by its rate, not only its total time)
        ClientGone          the client left mid-upload

Fair when full: a chunk that does not fit the router-wide budget takes room from the address holding
the most (its largest upload is cut and answered 503), as long as that address holds more than the
newcomer's would then hold. Many addresses can fill the budget between them, but none can keep out an
address that holds less than it does, and a client with one small body holds least of all.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect, Request

from pdserve.server.admission import Refused
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.router")


class ClientGone(Exception):
    """The client closed its connection while its request was being read."""


class Closing(APIError):
    """An APIError after which the connection is closed (what is left of the request is not read)."""

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={"Connection": "close"})


class Cut(Refused):
    """A Refused (with Retry-After) after which the connection is closed: the body is not read further."""

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status,
                            headers={"Retry-After": str(self.retry_after_s), "Connection": "close"})


def peer_of(host: str | None) -> str:
    """"10.0.0.7" -> itself; "2001:db8::1" -> "2001:db8::/64"; "::ffff:10.0.0.7" -> "10.0.0.7"."""
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return host or "local"  # a Unix socket, or a test client's name
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


class Upload:
    """One body being read: its address, the bytes it holds of the budget, and the future set when it is cut."""

    __slots__ = ("peer", "held", "cut")

    def __init__(self, peer: str):
        self.peer, self.held = peer, 0
        self.cut: asyncio.Future = asyncio.get_running_loop().create_future()


class BodyBudget:
    """The bytes of request bodies being read, router-wide (a hundred unfinished uploads of almost
    --max-body-mb must not take gigabytes) and per client address (one address must not take them all)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.in_flight = 0  # bytes, router-wide
        self.held: dict[str, int] = {}  # address -> bytes of its bodies being read
        self.uploads: dict[str, set[Upload]] = {}  # address -> its bodies being read

    async def read(self, http: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = http.headers.get("content-length")
        declared = int(declared) if declared is not None and declared.isdigit() else None
        if declared is not None and declared > limit:
            raise _too_large(declared, limit)
        upload = Upload(peer_of(http.client.host if http.client else None))
        self.uploads.setdefault(upload.peer, set()).add(upload)
        pace = Pace(self.cfg, declared)
        chunks, size = [], 0
        stream = http.stream().__aiter__()
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait((pending, upload.cut), timeout=pace.wait_s(), return_when=asyncio.FIRST_COMPLETED)
                if upload.cut.done():
                    raise upload.cut.result()
                if not pending.done():
                    pace.check(size)  # 408 when the body is late or too slow
                    continue
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return b"".join(chunks)
                except ClientDisconnect:
                    raise ClientGone() from None
                pending = None
                if size + len(chunk) > limit:
                    raise _too_large(size + len(chunk), limit)
                self._take(upload, len(chunk))
                size += len(chunk)
                chunks.append(chunk)
                pace.check(size)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
            self._give_back(upload)

    def _take(self, upload: Upload, n: int) -> None:
        """Count n more bytes of `upload`, making room if the router's budget is full, or refuse."""
        cfg, retry = self.cfg, self.cfg.retry_after_s
        mine = self.held.get(upload.peer, 0)
        if mine + n > cfg.client_bodies_bytes:
            raise Cut(429, f"this client address ({upload.peer}) has {mine} bytes of request bodies being read, its "
                      f"share of what this server reads at once ({cfg.client_bodies_bytes} bytes: --client-share of "
                      f"--max-bodies-mb); send fewer bodies at once, or retry after {retry}s",
                      "rate_limit_exceeded", "client_bodies_in_flight", retry)
        while self.in_flight + n > cfg.max_bodies_bytes:
            victim = self._largest(upload.peer, mine + n)
            if victim is None:
                raise Cut(503, f"{self.in_flight} bytes of request bodies are being read, the most this server holds "
                          f"at once (--max-bodies-mb), and no client address holds more than yours would; retry after "
                          f"{retry}s", "service_unavailable", "bodies_in_flight", retry)
            log.debug("cutting a %d-byte upload from %s (its address holds %d bytes of bodies) to make room for %s",
                      victim.held, victim.peer, self.held[victim.peer], upload.peer)  # debug: an attacker sets the pace
            self._cut(victim, Cut(503, f"this upload was cut to make room: the server's budget of request bodies "
                                  f"being read (--max-bodies-mb) is full and your address ({victim.peer}) held the "
                                  f"most of it; send fewer bodies at once, or retry after {retry}s",
                                  "service_unavailable", "body_cut_for_room", retry))
        upload.held += n
        self.held[upload.peer] = mine + n
        self.in_flight += n

    def _largest(self, peer: str, would_hold: int) -> Upload | None:
        """The largest upload of the address holding the most, if that address holds more than `would_hold`
        (the newcomer's bytes once its chunk is in)."""
        top = max(self.held, key=self.held.__getitem__, default=None)
        if top is None or top == peer or self.held[top] <= would_hold:
            return None
        return max(self.uploads[top], key=lambda u: u.held)

    def _cut(self, victim: Upload, why: Cut) -> None:
        self._give_back(victim)
        victim.cut.set_result(why)

    def _give_back(self, upload: Upload) -> None:
        """Return the upload's bytes and forget it (once: a cut upload gives back here, then in its reader)."""
        self.in_flight -= upload.held
        left = self.held.get(upload.peer, 0) - upload.held
        upload.held = 0
        mine = self.uploads.get(upload.peer)
        if mine is not None:
            mine.discard(upload)
        if left > 0:
            self.held[upload.peer] = left
        else:
            self.held.pop(upload.peer, None)
            if not mine:
                self.uploads.pop(upload.peer, None)


class Pace:
    """A body's deadlines: the whole of it within --body-timeout, and in each window of rate_window_s
    at least --min-body-rate's worth (or all that is left of a body of known length)."""

    def __init__(self, cfg, declared: int | None):
        now = time.monotonic()
        self.cfg, self.declared = cfg, declared
        self.end = now + cfg.body_timeout_s
        self.window_start = now
        self.window_end = now + cfg.rate_window_s if cfg.min_body_rate else float("inf")
        self.mark = 0  # the body's size when this window began

    def wait_s(self) -> float:
        return max(0.0, min(self.end, self.window_end) - time.monotonic())

    def check(self, size: int) -> None:
        now = time.monotonic()
        if now >= self.end:
            raise Closing(408, f"the request body did not arrive within {self.cfg.body_timeout_s:g}s "
                          f"(--body-timeout); {size} bytes came", "invalid_request_error", None, "body_timeout")
        if now < self.window_end:
            return
        took, got = now - self.window_start, size - self.mark
        need = self.cfg.min_body_rate * took
        if self.declared is not None:
            need = min(need, self.declared - self.mark)
        if got < need:
            raise Closing(408, f"the request body came at {got / took:.0f} bytes/s over {took:.1f}s, slower than "
                          f"this server takes ({self.cfg.min_body_rate} bytes/s, --min-body-rate); send the body "
                          f"at once", "invalid_request_error", None, "body_too_slow")
        self.mark, self.window_start, self.window_end = size, now, now + self.cfg.rate_window_s


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; this server takes at most {limit} "
                    f"(--max-body-mb)", "invalid_request_error", None, "body_too_large")
