"""Python clients for pdserve, or any OpenAI-compatible server.

    with Client("http://127.0.0.1:8000") as c:
        out = c.complete("Hello", max_tokens=16, policy="disaggregated")
        print(out.text, out.timings.ttft_ms)
        with c.stream_complete("Hello", max_tokens=16) as s:
            for delta in s:
                print(delta.text, end="")
        print(s.result.timings)

    async with AsyncClient() as c:
        async with c.stream_complete("Hello", max_tokens=16) as s:
            async for delta in s:
                ...

`AsyncClient` is the same with `async with` / `await` / `async for`. `api_key=` is sent as
`Authorization: Bearer <key>` (a server started with --api-key). Each client owns one httpx
connection pool, closed when the client closes. `model=None` asks the server's /v1/models once
and uses the first model it lists.
"""

from __future__ import annotations

import contextlib
import time

import httpx

from pdserve.client.errors import ClientError, ProtocolError, RequestTimeout, ServerUnreachable
from pdserve.client.wire import Completion, StreamState, chat_body, completion_body, \
    error_from_response, parse_response

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"


@contextlib.contextmanager
def _translated(base_url: str, url: str, timeout_s: float | None):
    """httpx's transport errors -> our typed errors (a plain `with`, so async code can use it too)."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise ServerUnreachable(base_url, e) from e
    except httpx.TimeoutException as e:
        raise RequestTimeout(url, timeout_s, e) from e
    except httpx.RemoteProtocolError as e:
        raise ProtocolError(f"the server at {url} broke the connection mid-answer: {e}") from e
    except httpx.TransportError as e:
        raise ClientError(f"network error talking to {url}: {e.__class__.__name__}: {e}") from e


def _timeout(timeout_s: float | None) -> httpx.Timeout:
    # connecting is quick or never; a long prompt under load may take minutes to answer
    connect = 10.0 if timeout_s is None else min(10.0, timeout_s)
    return httpx.Timeout(timeout_s, connect=connect)


def _limits(max_connections: int | None) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)


def _headers(api_key: str | None, headers: dict[str, str] | None) -> dict[str, str]:
    """The headers every request carries: `headers`, and the API key as a bearer token."""
    return {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _request_id(response: httpx.Response) -> str | None:
    return response.headers.get("x-request-id")


def _models(data: object) -> list[str]:
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ProtocolError(f"{MODELS} should answer {{'data': [...]}}, got {str(data)[:200]}")
    return [m["id"] for m in data["data"] if isinstance(m, dict) and "id" in m]


class _Base:
    def __init__(self, base_url: str, model: str | None, timeout_s: float | None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _no_model_error(self) -> ProtocolError:
        return ProtocolError(f"the server at {self.base_url} lists no models; pass model= (--model)")


class CompletionStream:
    """A streamed answer: iterate for `Delta`s; `result` holds the whole `Completion` at the end."""

    def __init__(self, client: "Client", path: str, body: dict, chat: bool):
        self._client, self._path, self._body, self._chat = client, path, body, chat
        self._gen = None
        self._state: StreamState | None = None

    def __iter__(self):
        if self._gen is None:
            self._gen = self._events()
        return self._gen

    def _events(self):
        c = self._client
        url = c._url(self._path)
        body = {"model": c.resolve_model(), **self._body}
        with _translated(c.base_url, url, c.timeout_s), c._http.stream("POST", url, json=body) as resp:
            rid = _request_id(resp)
            if resp.status_code >= 400:
                resp.read()
                raise error_from_response(resp.status_code, resp.text, rid)
            state = self._state = StreamState(self._chat, rid)
            for line in resp.iter_lines():
                delta = state.feed_line(line, time.perf_counter())
                if delta is not None:
                    yield delta
                if state.done:
                    break
            delta = state.feed_end(time.perf_counter())
            if delta is not None:
                yield delta

    @property
    def result(self) -> Completion:
        if self._state is None:
            raise RuntimeError("iterate the stream before reading its result")
        return self._state.result()

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()

    def __enter__(self) -> "CompletionStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client(_Base):
    def __init__(self, base_url: str = DEFAULT_BASE_URL, model: str | None = None, timeout_s: float | None = 600.0,
                 max_connections: int | None = 16, api_key: str | None = None):
        super().__init__(base_url, model, timeout_s)
        self._http = httpx.Client(timeout=_timeout(timeout_s), limits=_limits(max_connections),
                                  headers=_headers(api_key, None))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get_json(self, path: str):
        url = self._url(path)
        with _translated(self.base_url, url, self.timeout_s):
            resp = self._http.get(url)
        if resp.status_code >= 400:
            raise error_from_response(resp.status_code, resp.text, _request_id(resp))
        return resp.json()

    def models(self) -> list[str]:
        return _models(self._get_json(MODELS))

    def resolve_model(self) -> str:
        if self.model is None:
            names = self.models()
            if not names:
                raise self._no_model_error()
            self.model = names[0]
        return self.model

    def _post(self, path: str, body: dict, chat: bool) -> Completion:
        url = self._url(path)
        with _translated(self.base_url, url, self.timeout_s):
            resp = self._http.post(url, json=body)
        rid = _request_id(resp)
        if resp.status_code >= 400:
            raise error_from_response(resp.status_code, resp.text, rid)
        return parse_response(resp.json(), chat, rid)

    def complete(self, prompt: str | list[int], *, policy: str | None = None, extra: dict | None = None,
                 **options) -> Completion:
        return self._post(COMPLETIONS, completion_body(self.resolve_model(), prompt, stream=False, policy=policy,
                                                       extra=extra, **options), chat=False)

    def chat(self, messages: str | list[dict], *, policy: str | None = None, extra: dict | None = None,
             **options) -> Completion:
        return self._post(CHAT, chat_body(self.resolve_model(), messages, stream=False, policy=policy,
                                          extra=extra, **options), chat=True)

    def stream_complete(self, prompt: str | list[int], *, policy: str | None = None, extra: dict | None = None,
                        **options) -> CompletionStream:
        body = completion_body(None, prompt, stream=True, policy=policy, extra=extra, **options)
        return CompletionStream(self, COMPLETIONS, body, chat=False)

    def stream_chat(self, messages: str | list[dict], *, policy: str | None = None, extra: dict | None = None,
                    **options) -> CompletionStream:
        body = chat_body(None, messages, stream=True, policy=policy, extra=extra, **options)
        return CompletionStream(self, CHAT, body, chat=True)


class AsyncCompletionStream:
    """The async twin of CompletionStream: `async for delta in stream`, then `stream.result`."""

    def __init__(self, client: "AsyncClient", path: str, body: dict, chat: bool):
        self._client, self._path, self._body, self._chat = client, path, body, chat
        self._gen = None
        self._state: StreamState | None = None

    def __aiter__(self):
        if self._gen is None:
            self._gen = self._events()
        return self._gen

    async def _events(self):
        c = self._client
        url = c._url(self._path)
        body = {"model": await c.resolve_model(), **self._body}
        with _translated(c.base_url, url, c.timeout_s):
            async with c._http.stream("POST", url, json=body) as resp:
                rid = _request_id(resp)
                if resp.status_code >= 400:
                    await resp.aread()
                    raise error_from_response(resp.status_code, resp.text, rid)
                state = self._state = StreamState(self._chat, rid)
                async for line in resp.aiter_lines():
                    delta = state.feed_line(line, time.perf_counter())
                    if delta is not None:
                        yield delta
                    if state.done:
                        break
                delta = state.feed_end(time.perf_counter())
                if delta is not None:
                    yield delta

    @property
    def result(self) -> Completion:
        if self._state is None:
            raise RuntimeError("iterate the stream before reading its result")
        return self._state.result()

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()

    async def __aenter__(self) -> "AsyncCompletionStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient(_Base):
    def __init__(self, base_url: str = DEFAULT_BASE_URL, model: str | None = None, timeout_s: float | None = 600.0,
                 max_connections: int | None = None, headers: dict[str, str] | None = None, api_key: str | None = None):
        super().__init__(base_url, model, timeout_s)
        # headers go with every request (api_key: as `Authorization: Bearer <key>`)
        self._http = httpx.AsyncClient(timeout=_timeout(timeout_s), limits=_limits(max_connections),
                                       headers=_headers(api_key, headers))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _get_json(self, path: str):
        url = self._url(path)
        with _translated(self.base_url, url, self.timeout_s):
            resp = await self._http.get(url)
        if resp.status_code >= 400:
            raise error_from_response(resp.status_code, resp.text, _request_id(resp))
        return resp.json()

    async def models(self) -> list[str]:
        return _models(await self._get_json(MODELS))

    async def health(self) -> dict:
        """GET /health's body, whatever its status (503 while no worker can serve, or draining)."""
        url = self._url("/health")
        with _translated(self.base_url, url, self.timeout_s):
            resp = await self._http.get(url)
        return resp.json()

    async def resolve_model(self) -> str:
        if self.model is None:
            names = await self.models()
            if not names:
                raise self._no_model_error()
            self.model = names[0]
        return self.model

    async def _post(self, path: str, body: dict, chat: bool) -> Completion:
        url = self._url(path)
        with _translated(self.base_url, url, self.timeout_s):
            resp = await self._http.post(url, json=body)
        rid = _request_id(resp)
        if resp.status_code >= 400:
            raise error_from_response(resp.status_code, resp.text, rid)
        return parse_response(resp.json(), chat, rid)

    async def complete(self, prompt: str | list[int], *, policy: str | None = None, extra: dict | None = None,
                       **options) -> Completion:
        body = completion_body(await self.resolve_model(), prompt, stream=False, policy=policy, extra=extra,
                               **options)
        return await self._post(COMPLETIONS, body, chat=False)

    async def chat(self, messages: str | list[dict], *, policy: str | None = None, extra: dict | None = None,
                   **options) -> Completion:
        body = chat_body(await self.resolve_model(), messages, stream=False, policy=policy, extra=extra, **options)
        return await self._post(CHAT, body, chat=True)

    def stream_complete(self, prompt: str | list[int], *, policy: str | None = None,
                        extra: dict | None = None, **options) -> AsyncCompletionStream:
        body = completion_body(None, prompt, stream=True, policy=policy, extra=extra, **options)
        return AsyncCompletionStream(self, COMPLETIONS, body, chat=False)

    def stream_chat(self, messages: str | list[dict], *, policy: str | None = None,
                    extra: dict | None = None, **options) -> AsyncCompletionStream:
        body = chat_body(None, messages, stream=True, policy=policy, extra=extra, **options)
        return AsyncCompletionStream(self, CHAT, body, chat=True)
