"""The server's timeline of one request, as a typed object: protocol/timings.py's `Timings`, read
from a response's `timings` object with the client's errors (a wrongly typed field is a
ProtocolError naming the request)."""

from __future__ import annotations

from pdserve.client.errors import ProtocolError
from pdserve.protocol import timings as T


class Timings(T.Timings):
    __doc__ = T.Timings.__doc__

    @classmethod
    def from_dict(cls, data: dict | None, request_id: str | None = None) -> "Timings | None":
        try:
            return super().from_dict(data)
        except T.TimingsError as e:
            raise ProtocolError(str(e), request_id) from None
