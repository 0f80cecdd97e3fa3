"""The router's HTTP front door: what a request must be before the API reads it, and what a
connection may hold. Nothing on the socket is trusted: not the Host a browser was tricked into
sending, not a body that never ends, not a connection that never speaks.

    install_front_door(app, cfg)   FrontDoor below as the app's outermost middleware, and a client that
                                   leaves mid-upload (ClientGone) answered with one info line
    FrontDoor(app, cfg)            ASGI middleware, outermost: refuses before any route runs
        Content-Length and Transfer-Encoding together    400, connection closed (RFC 9112 6.3)
        a Host name not allowed, without an API key      400 (DNS rebinding: a web page's own name
                                                         pointed at 127.0.0.1 reaches a loopback server)
        a POST body that is not application/json         415 (a page may POST text/plain cross-origin
                                                         without asking; JSON it may not)
    BodyBudget(cfg).read(request)  the body: 413 over --max-body-mb, 503 while --max-bodies-mb of
                                   bodies are being read already, 408 (connection closed) when it takes
                                   longer than --body-timeout; a client that leaves mid-upload: ClientGone
    connection_options(cfg)        uvicorn settings: a connection cap below the file-descriptor limit
                                   (whose soft value is raised to the hard one), headers within
                                   --header-timeout of a connection's first byte or of the last response

Allowed Host names without a key: localhost (and names under .localhost), any IP literal (a page
cannot make a browser send an address as Host for its own name), and --allowed-hosts ('*': any).
With an API key the Host is not checked: a page cannot send the key.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import time

from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect, Request

from pdserve.server.admission import Refused
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.router")

FD_RESERVE = 256  # descriptors kept for everything but HTTP connections: worker sockets, files, pipes
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this (uvicorn's default)
JSON_TYPES = ("application/json",)


class ClientGone(Exception):
    """The client closed its connection while its request was being read."""


class Closing(APIError):
    """An APIError after which the connection is closed (what is left of the request is not read)."""

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={"Connection": "close"})


# ---- the ASGI middleware -------------------------------------------------------------------------


def install_front_door(app, cfg) -> None:
    app.add_middleware(FrontDoor, cfg=cfg)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _e: ClientGone):
        log.info("%s %s: the client disconnected before its request was read whole", request.method, request.url.path)
        return Response(status_code=499)



class FrontDoor:
    def __init__(self, app, cfg):
        self.app = app
        self.check_host = cfg.api_key is None and "*" not in _host_list(cfg.allowed_hosts)
        self.hosts = {"localhost"} | set(_host_list(cfg.allowed_hosts))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        refusal = self.refusal(scope["method"], headers)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code, close = refusal
        extra = {"Connection": "close"} if close else None
        await JSONResponse(APIError(status, message, "invalid_request_error", None, code).body(), status_code=status,
                           headers=extra)(scope, receive, send)

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> tuple[int, str, str, bool] | None:
        """(status, message, code, close the connection) or None: let it in."""
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return (400, "the request has both Content-Length and Transfer-Encoding (ambiguous, RFC 9112 6.3); send "
                    "one of them", "ambiguous_length", True)
        host = headers.get(b"host")
        if self.check_host and host is not None and not self.host_allowed(host.decode("latin-1")):
            return (400, f"Host {host.decode('latin-1')[:100]!r} is not a name this server answers without an API key "
                    f"(a guard against DNS rebinding); call it by localhost or an IP address, or start pdserve with "
                    f"--allowed-hosts NAME or --api-key", "host_not_allowed", False)
        if method == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
            if kind not in JSON_TYPES and not (kind.startswith("application/") and kind.endswith("+json")):
                return (415, f"the body must be JSON sent with `Content-Type: application/json` (got "
                        f"{kind[:100] or 'none'!r}); e.g. curl -H 'Content-Type: application/json' -d ...",
                        "unsupported_media_type", False)
        return None

    def host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        if name in self.hosts or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False


def _host_list(text: str | None) -> list[str]:
    return [h.strip().lower() for h in (text or "").split(",") if h.strip()]


def _host_name(host: str) -> str:
    """A Host header's name without its port: "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host.rstrip(".")


# ---- request bodies ------------------------------------------------------------------------------


class BodyBudget:
    """The bytes of request bodies being read, router-wide, bounded: a hundred unfinished uploads of
    almost --max-body-mb each must not take gigabytes."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.in_flight = 0

    async def read(self, http: Request) -> bytes:
        limit, total = self.cfg.max_body_bytes, self.cfg.max_bodies_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        end = time.monotonic() + self.cfg.body_timeout_s
        stream = http.stream().__aiter__()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, end - time.monotonic()))
                except StopAsyncIteration:
                    return b"".join(chunks)
                except asyncio.TimeoutError:
                    raise Closing(408, f"the request body did not arrive within {self.cfg.body_timeout_s:.0f}s "
                                   f"(--body-timeout); {size} bytes came", "invalid_request_error", None,
                                   "body_timeout") from None
                except ClientDisconnect:
                    raise ClientGone() from None
                if size + len(chunk) > limit:
                    raise _too_large(size + len(chunk), limit)
                if self.in_flight + len(chunk) > total:
                    raise Refused(503, f"{self.in_flight} bytes of request bodies are being read, the most this "
                                  f"server holds at once (--max-bodies-mb); retry after {self.cfg.retry_after_s}s",
                                  "service_unavailable", "bodies_in_flight", self.cfg.retry_after_s)
                self.in_flight += len(chunk)
                size += len(chunk)
                chunks.append(chunk)
        finally:
            self.in_flight -= size


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; this server takes at most {limit} "
                    f"(--max-body-mb)", "invalid_request_error", None, "body_too_large")


# ---- connections (uvicorn) -----------------------------------------------------------------------


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
    return {"http": guarded_protocol(cap, cfg.header_timeout_s), "timeout_keep_alive": KEEP_ALIVE_S,
            "backlog": accept_burst(fd_limit)}


def guarded_protocol(cap: int, header_timeout_s: float):
    """uvicorn's h11 protocol with a connection cap and a header deadline (imported here: only the
    process that serves HTTP needs uvicorn)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        """At `cap` connections a new one closes the longest-idle connection (no request in progress),
        or is itself answered 503 and closed when every one is busy. A connection must send a request's
        headers within header_timeout_s of its first byte (or of its opening): silent ones are closed."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._opened = self.loop.time()
            self._header_timer = None
            self._arm()
            if len(self.connections) > cap:
                idle = [c for c in self.connections if c is not self and isinstance(c, Guarded) and c._idle()]
                if idle:
                    min(idle, key=lambda c: c._opened).transport.close()
                else:
                    transport.write(_BUSY)
                    transport.close()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._idle():
                self._arm()
            super().data_received(data)
            if self._header_timer is not None and not self._idle():
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _idle(self) -> bool:
            """No request in progress: waiting for (the rest of) a request's headers."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._idle() and not self.transport.is_closing():
                log.debug("closing a connection that sent no request headers within %.0fs", header_timeout_s)
                self.transport.close()

    return Guarded


_BUSY_BODY = (b'{"error":{"message":"too many connections, every one busy; retry","type":"service_unavailable",'
              b'"param":null,"code":"too_many_connections"}}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
         b"Content-Length: %d\r\n\r\n" % len(_BUSY_BODY) + _BUSY_BODY)
