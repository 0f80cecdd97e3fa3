"""The OpenAI HTTP API on the wire: request bodies, responses, SSE events, error objects.

No I/O here: `Client` and `AsyncClient` (client/client.py) move bytes, this module gives them
meaning, so the sync and async paths cannot drift apart.

    completion_body / chat_body   build a request body (None-valued options are left out)
    parse_response                a non-streaming JSON body -> Completion
    SSEDecoder                    text lines -> the `data:` payload of each complete event
    StreamState                   one streamed response: event payloads -> Delta, then Completion
    error_from_response           an error body (OpenAI error object, FastAPI detail, text) -> ServerError
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.client.errors import ProtocolError, ServerError
from pdserve.client.timings import Timings

DONE = "[DONE]"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens: prompt tokens whose KV was reused

    @classmethod
    def from_dict(cls, data: dict | None) -> "Usage | None":
        if not isinstance(data, dict):
            return None
        details = data.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(data.get("prompt_tokens"), data.get("completion_tokens"), data.get("total_tokens"), cached)


@dataclass(frozen=True)
class Completion:
    id: str | None
    model: str | None
    text: str
    finish_reason: str | None
    usage: Usage | None
    timings: Timings | None


@dataclass(frozen=True)
class Delta:
    """One streamed event of a choice."""

    text: str
    arrival: float  # time.perf_counter() seconds when the event was read off the socket
    is_token: bool  # carries a generated token (not a role header, not a bare end marker)
    finish_reason: str | None = None


def _options(**options) -> dict:
    return {k: v for k, v in options.items() if v is not None}


def completion_body(model: str | None, prompt: str | list[int], *, stream: bool, policy: str | None = None,
                    extra: dict | None = None, **options) -> dict:
    body = _options(model=model, prompt=prompt, stream=stream, policy=policy, **options)
    body.update(extra or {})
    return body


def chat_body(model: str | None, messages: str | list[dict], *, stream: bool, policy: str | None = None,
              extra: dict | None = None, **options) -> dict:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = _options(model=model, messages=messages, stream=stream, policy=policy, **options)
    body.update(extra or {})
    return body


def _first_choice(data: dict, request_id: str | None) -> dict | None:
    choices = data.get("choices")
    if choices is None or choices == []:
        return None
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ProtocolError(f"`choices` must be a list of objects, got {choices!r}", request_id)
    return choices[0]


def _raise_if_error(data: dict, status: int, request_id: str | None) -> None:
    if "error" in data and data["error"]:
        raise _server_error(status, data["error"], request_id or data.get("id"))


def parse_response(data: object, chat: bool, request_id: str | None = None) -> Completion:
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a JSON object, got {type(data).__name__}", request_id)
    _raise_if_error(data, 200, request_id)
    rid = data.get("id") or request_id
    choice = _first_choice(data, rid)
    if choice is None:
        raise ProtocolError("the response has no choices", rid)
    if chat:
        message = choice.get("message") or {}
        text = message.get("content") or ""
    else:
        text = choice.get("text") or ""
    return Completion(
        id=rid,
        model=data.get("model"),
        text=text,
        finish_reason=choice.get("finish_reason"),
        usage=Usage.from_dict(data.get("usage")),
        timings=Timings.from_dict(data.get("timings"), rid),
    )


class SSEDecoder:
    """Feeds on lines (without their newline); returns an event's data when a blank line ends it."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line == "":
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: carry nothing we use

    def flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


class StreamState:
    """Accumulates one streamed completion (or chat completion)."""

    def __init__(self, chat: bool, request_id: str | None = None):
        self.chat = chat
        self.id = request_id
        self.model: str | None = None
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self.done = False  # saw [DONE]
        self.token_events = 0
        self._sse = SSEDecoder()

    def feed_line(self, line: str, arrival: float) -> Delta | None:
        """One line of the HTTP body; a delta when it completes an event that carries one."""
        payload = self._sse.feed(line)
        return None if payload is None else self.feed(payload, arrival)

    def feed_end(self, arrival: float) -> Delta | None:
        """The body ended: an event left without its closing blank line."""
        payload = self._sse.flush()
        return None if payload is None else self.feed(payload, arrival)

    def feed(self, payload: str, arrival: float) -> Delta | None:
        if payload.strip() == DONE:
            self.done = True
            return None
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as e:
            raise ProtocolError(f"an SSE event is not JSON ({e}): {payload[:200]!r}", self.id) from e
        if not isinstance(data, dict):
            raise ProtocolError(f"an SSE event is not a JSON object: {payload[:200]!r}", self.id)
        _raise_if_error(data, 200, self.id)
        self.id = data.get("id") or self.id
        self.model = data.get("model") or self.model
        if data.get("usage"):
            self.usage = Usage.from_dict(data["usage"])
        if data.get("timings") is not None:
            self.timings = Timings.from_dict(data["timings"], self.id)
        choice = _first_choice(data, self.id)
        if choice is None:  # e.g. a usage-only event
            return None
        finish = choice.get("finish_reason")
        if finish:
            self.finish_reason = finish
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            role_only = "role" in delta and not text
            is_token = text is not None and not role_only and not (text == "" and finish)
            text = text or ""
        else:
            text = choice.get("text") or ""
            # a token may decode to "" (half of a UTF-8 character); an empty event with finish_reason
            # is a bare end marker unless usage counts one more token than the events carried
            is_token = bool(text) or not finish or (
                self.usage is not None and (self.usage.completion_tokens or 0) > self.token_events)
        self.token_events += is_token
        self.parts.append(text)
        return Delta(text=text, arrival=arrival, is_token=is_token, finish_reason=finish)

    def result(self) -> Completion:
        return Completion(
            id=self.id,
            model=self.model,
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            usage=self.usage,
            timings=self.timings,
        )


def _server_error(status: int, error: object, request_id: str | None) -> ServerError:
    if isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, int) and status == 200:
            status = code
        return ServerError(status, str(error.get("message") or error), error.get("type"), error.get("param"),
                           code, request_id)
    return ServerError(status, str(error), request_id=request_id)


def error_from_response(status: int, text: str, request_id: str | None) -> ServerError:
    """The error a non-2xx answer means: an OpenAI error object, a FastAPI `detail`, or plain text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return ServerError(status, text.strip()[:500] or "(empty body)", request_id=request_id)
    if isinstance(data, dict) and data.get("error"):
        return _server_error(status, data["error"], request_id)
    if isinstance(data, dict) and "detail" in data:
        return ServerError(status, json.dumps(data["detail"])[:1000], request_id=request_id)
    return ServerError(status, text.strip()[:500], request_id=request_id)
