"""pdserve's Python client: `Client`, `AsyncClient`, the `Timings` of a request, typed errors."""

from pdserve.client.client import AsyncClient, AsyncCompletionStream, Client, CompletionStream
from pdserve.client.errors import ClientError, ProtocolError, RequestTimeout, ServerError, ServerUnreachable
from pdserve.client.timings import Timings
from pdserve.client.wire import Completion, Delta, Usage

__all__ = [
    "AsyncClient", "AsyncCompletionStream", "Client", "CompletionStream", "ClientError", "ProtocolError",
    "RequestTimeout", "ServerError", "ServerUnreachable", "Timings", "Completion", "Delta", "Usage",
]
