"""What can go wrong talking to a server, as typed errors that say what to do.

    ClientError          base class; carries the request id when one is known
    ServerUnreachable    no connection (refused, DNS, connect timeout)
    ServerError          the server answered an error (OpenAI error object or a non-2xx status)
    RequestTimeout       connected, but the answer did not come in time
    ProtocolError        the answer is not what the OpenAI API (or pdserve's timings schema) says
"""

from __future__ import annotations


class ClientError(Exception):
    def __init__(self, message: str, request_id: str | None = None):
        self.request_id = request_id
        suffix = f" (request {request_id})" if request_id else ""
        super().__init__(message + suffix)


class ServerUnreachable(ClientError):
    def __init__(self, base_url: str, cause: Exception):
        self.base_url = base_url
        self.cause = cause
        super().__init__(
            f"cannot reach the server at {base_url}: {cause.__class__.__name__}: {cause or 'no detail'}; "
            "is it running? (start it with `pdserve --model <name> --port <port>`, or pass the right --base-url)"
        )


class ServerError(ClientError):
    """The server said no. `status` is the HTTP status; the rest comes from the error object."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, request_id: str | None = None):
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        detail = f"HTTP {status}" + (f" {type}" if type else "") + (f" (param {param})" if param else "")
        super().__init__(f"server error, {detail}: {message}", request_id)


class RequestTimeout(ClientError):
    def __init__(self, url: str, timeout_s: float | None, cause: Exception, request_id: str | None = None):
        self.cause = cause
        super().__init__(
            f"no answer from {url} within {timeout_s} s ({cause.__class__.__name__}); the server may be "
            "overloaded: raise the client timeout or lower the load",
            request_id,
        )


class ProtocolError(ClientError):
    pass
