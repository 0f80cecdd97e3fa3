"""`x-request-id` on responses, as vLLM and OpenAI send it: the caller's own `x-request-id` echoed back,
else the id pdserve gave the request (the body's `id`, set by the handler in `request.state.request_id`).

The caller's value is only echoed, never used as pdserve's request id (two callers could send the same
one, and workers key their state by it). A pure ASGI middleware: it wraps `send` only, so the handlers'
own reads of `receive` (disconnect detection) see every message.
"""

from __future__ import annotations

from pdserve.server.errors import bad_request

HEADER = b"x-request-id"
MAX_CHARS = 256


class RequestIdHeader:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == HEADER), None)
        if given is not None and (len(given) > MAX_CHARS or not all(0x21 <= b <= 0x7E for b in given)):
            response = bad_request(f"the `x-request-id` header must be 1 to {MAX_CHARS} printable ASCII characters "
                                   "without spaces; send a shorter id or leave the header out", "x-request-id",
                                   "invalid_request_id").response()
            return await response(scope, receive, send)
        state = scope.setdefault("state", {})

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                rid = given if given else state.get("request_id", "").encode()
                if rid:
                    message = {**message, "headers": [*message.get("headers", []), (HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
