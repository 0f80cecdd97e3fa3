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

What a body may hold and how fast it must come: server/bodies.py; what a connection may hold, and the
descriptors kept for the workers: server/connections.py.

Allowed Host names without a key: localhost (and names under .localhost), any IP literal (a page
cannot make a browser send an address as Host for its own name), and --allowed-hosts ('*': any).
With an API key the Host is not checked: a page cannot send the key.
"""

from __future__ import annotations

import ipaddress
import logging

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from pdserve.server.bodies import ClientGone
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.router")

JSON_TYPES = ("application/json",)


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
