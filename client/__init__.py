"""pdserve's Python client: `Client`, `AsyncClient`, the `Timings` of a request, typed errors."""

from client.client import AsyncClient, AsyncCompletionStream, Client, CompletionStream
from client.errors import ClientError, ProtocolError, RequestTimeout, ServerError, ServerUnreachable
from client.timings import Timings
from client.wire import Completion, Delta, Usage

__all__ = [
    "AsyncClient", "AsyncCompletionStream", "Client", "CompletionStream", "ClientError", "ProtocolError",
    "RequestTimeout", "ServerError", "ServerUnreachable", "Timings", "Completion", "Delta", "Usage",
]
