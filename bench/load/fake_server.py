"""A stand-in OpenAI-compatible server with no model, for testing the client and the load generator.

It answers /v1/models, /v1/completions and /v1/chat/completions (streaming and not) with
" tok0 tok1 ..." and pdserve's `timings` object. Time is simulated with sleeps: prefills run one at a
time (one "GPU"), so requests queue behind each other; a prefill takes prefill_ms_per_request +
prefill_ms_per_token * prompt tokens, so the server serves 1 / that many requests a second (each prefill
starts when the one before it ended, on the GPU's clock: a loaded machine's late wake-ups do not add up)
and its queue (and TTFT) grows without bound past that rate; each token then takes `itl_ms`;
`disaggregated` requests add a KV transfer. Prompt tokens are counted as whitespace-separated words
(a chat prompt: every message's role and content, in order).

With `prefix_cache_block` > 0 it keeps a prefix cache as a server would: the prompt in blocks of that
many words, each block known by its words and its parent's (a chain), so a prompt that repeats an
earlier one's first k whole blocks has k x block cached tokens, reported as
usage.prompt_tokens_details.cached_tokens and timings.cached_tokens, and its prefill pays only for
the rest. With `cold_requests` > 0 the first that many requests to arrive each wait `cold_ms` more before
their prefill (without holding up the others), as a server's first requests pay for lazy start-up
work. With `api_key` set, every /v1 route wants `Authorization: Bearer <key>` (401 otherwise).

    with FakeServer(FakeConfig(itl_ms=2)) as srv:
        Client(srv.base_url).complete("hi")
    python -m pdserve.bench.load.fake_server --port 0     # prints "fake server ready: <url>", like pdserve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

POLICIES = ("colocated", "disaggregated", "auto")


@dataclass
class FakeConfig:
    model: str = "fake-model"
    prefill_ms_per_token: float = 0.01
    prefill_ms_per_request: float = 0.0
    itl_ms: float = 2.0
    transfer_ms_per_token: float = 0.002
    kv_bytes_per_token: int = 57_344
    default_policy: str = "colocated"
    emit_timings: bool = True
    prefix_cache_block: int = 0  # words per cached block; 0: no prefix cache
    api_key: str | None = None
    cold_requests: int = 0  # the first this many requests to arrive are slow by cold_ms
    cold_ms: float = 0.0


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


class PrefixCache:
    """Chained block keys seen so far (unbounded: the fake serves tests and short runs)."""

    def __init__(self, block: int):
        self.block = block
        self.seen: set[int] = set()

    def _keys(self, words: list[str]) -> list[int]:
        keys, parent = [], 0
        for i in range(len(words) // self.block):
            parent = hash((parent, tuple(words[i * self.block:(i + 1) * self.block])))
            keys.append(parent)
        return keys

    def lookup_and_insert(self, words: list[str]) -> int:
        """Cached leading words of this prompt; then its whole blocks are cached too."""
        keys = self._keys(words)
        hits = next((i for i, k in enumerate(keys) if k not in self.seen), len(keys))
        self.seen.update(keys)
        return hits * self.block


class CountedStream(StreamingResponse):
    """A streamed answer counted in `live` while Starlette serves it: from its start until it ended or was dropped.
    Counted here, not by a try/finally in the body's generator: a client that disconnects while an event is
    being sent leaves the generator suspended at its yield, and its finally would run only once the garbage
    collector found it (on an idle server, maybe never): /health would report the dropped stream in flight."""

    def __init__(self, content, live: list[int], **kwargs):
        super().__init__(content, **kwargs)
        self.live = live

    async def __call__(self, scope, receive, send) -> None:
        self.live[0] += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.live[0] -= 1


def make_app(cfg: FakeConfig, bodies: list | None = None) -> FastAPI:
    """`bodies`, when given, collects every request body (tests check what the client sent)."""
    app = FastAPI()
    gpu = asyncio.Lock()
    gpu_free_at = [0.0]  # perf_counter() when the GPU's last prefill ends, on the GPU's own clock (prefill())
    cache = PrefixCache(cfg.prefix_cache_block) if cfg.prefix_cache_block > 0 else None
    arrivals = [0]  # completion requests seen (the first cfg.cold_requests are slow)
    streaming = [0]  # streamed answers not yet ended (or dropped): /health's in_flight, as pdserve's workers

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if cfg.api_key is not None and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse({"error": {"message": "missing or wrong API key: send Authorization: Bearer <key>",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "workers": [{"id": "fake-colocated-0", "in_flight": streaming[0]}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list", "messages")
            prompt = " ".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return _error(400, "prompt must be a string", "prompt")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        policy = body.get("policy") or cfg.default_policy
        if policy not in POLICIES:
            return _error(400, f"policy must be one of {POLICIES}, got {policy!r}", "policy")
        if policy == "auto":
            policy = "colocated"
        n_prompt = len(prompt.split())
        arrived = time.perf_counter()
        cached: list[int | None] = [None]
        arrivals[0] += 1
        cold = arrivals[0] <= cfg.cold_requests

        async def prefill() -> dict:
            if cold:
                await asyncio.sleep(cfg.cold_ms / 1e3)
            queued = time.perf_counter()
            async with gpu:
                # a prefill starts when the one before it ended (or when it came, if later), not when this event
                # loop got round to it: a busy loop (a loaded machine) delays answers but costs no capacity, so the
                # server serves exactly 1 / (prefill time) requests a second however late each sleep wakes
                started = max(queued, gpu_free_at[0])
                if cache is not None:
                    cached[0] = cache.lookup_and_insert(prompt.split())
                computed = n_prompt - (cached[0] or 0)
                gpu_free_at[0] = started + (cfg.prefill_ms_per_request + cfg.prefill_ms_per_token * computed) / 1e3
                await asyncio.sleep(max(0.0, gpu_free_at[0] - time.perf_counter()))
            ended = time.perf_counter()
            t = {"policy": policy, "queue_ms": (started - arrived) * 1e3, "prefill_ms": (ended - started) * 1e3,
                 "cached_tokens": cached[0],
                 "reused_tokens": None if cached[0] is None else {"device": cached[0], "host": 0, "disk": 0},
                 "transfer_ms": None, "transfer_exposed_ms": None, "kv_bytes": 0, "transport": None,
                 "mode": None, "prefill_worker": None, "decode_worker": None, "worker": "fake-colocated-0",
                 "prompt_tokens": n_prompt}
            if policy == "disaggregated":
                transfer = cfg.transfer_ms_per_token * n_prompt
                await asyncio.sleep(transfer / 1e3)
                t.update(transfer_ms=transfer, transfer_exposed_ms=transfer,
                         kv_bytes=cfg.kv_bytes_per_token * n_prompt, transport="fake", mode="bulk",
                         prefill_worker="fake-prefill-0", decode_worker="fake-decode-0", worker="fake-decode-0")
            return t

        def finish(t: dict, first: float, step_ms: float | None, n_out: int) -> dict:
            end = time.perf_counter()
            decode_s = end - first
            t.update(first_decode_step_ms=step_ms, ttft_ms=(first - arrived) * 1e3, e2e_ms=(end - arrived) * 1e3,
                     decode_tokens_per_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None,
                     completion_tokens=n_out)
            return t

        def usage(n_out: int) -> dict:
            out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
            if cached[0] is not None:
                out["prompt_tokens_details"] = {"cached_tokens": cached[0]}
            return out

        words = [f" tok{i}" for i in range(max_tokens)]
        headers = {"x-request-id": rid}

        if not body.get("stream"):
            t = await prefill()
            first = time.perf_counter()
            await asyncio.sleep(cfg.itl_ms * (max_tokens - 1) / 1e3)
            t = finish(t, first, cfg.itl_ms if max_tokens > 1 else None, max_tokens)
            choice = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(words)}
            else:
                choice["text"] = "".join(words)
            out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "model": cfg.model,
                   "choices": [choice], "usage": usage(max_tokens)}
            if cfg.emit_timings:
                out["timings"] = t
            return JSONResponse(out, headers=headers)

        def event(text: str, finish_reason: str | None, extra: dict | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish_reason}
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": cfg.model, "choices": [choice], **(extra or {})}
            return f"data: {json.dumps(data)}\n\n"

        async def answer():
            t = await prefill()
            if chat:
                yield event("", None, role=True)
            first = time.perf_counter()
            yield event(words[0], None)
            step_ms = None
            for i in range(1, max_tokens):
                step_start = time.perf_counter()
                await asyncio.sleep(cfg.itl_ms / 1e3)
                if i == 1:
                    step_ms = (time.perf_counter() - step_start) * 1e3
                yield event(words[i], None)
            extra = {"usage": usage(max_tokens)}
            if cfg.emit_timings:
                extra["timings"] = finish(t, first, step_ms, max_tokens)
            yield event("", "length", extra)
            yield "data: [DONE]\n\n"

        return CountedStream(answer(), streaming, media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Runs the app with uvicorn in a background thread of this process."""

    def __init__(self, cfg: FakeConfig | None = None, port: int | None = None):
        self.cfg = cfg or FakeConfig()
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []
        self._server = uvicorn.Server(uvicorn.Config(make_app(self.cfg, self.bodies), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the fake server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a model-free OpenAI-compatible server that reports pdserve timings")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--itl-ms", type=float, default=FakeConfig.itl_ms)
    p.add_argument("--prefill-ms-per-token", type=float, default=FakeConfig.prefill_ms_per_token)
    p.add_argument("--prefill-ms-per-request", type=float, default=FakeConfig.prefill_ms_per_request)
    p.add_argument("--transfer-ms-per-token", type=float, default=FakeConfig.transfer_ms_per_token)
    p.add_argument("--model", default=FakeConfig.model)
    p.add_argument("--prefix-cache-block", type=int, default=0, help="words per prefix-cache block (0: no cache)")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 routes")
    args = p.parse_args(argv)
    cfg = FakeConfig(model=args.model, itl_ms=args.itl_ms, prefill_ms_per_token=args.prefill_ms_per_token,
                     prefill_ms_per_request=args.prefill_ms_per_request,
                     transfer_ms_per_token=args.transfer_ms_per_token, prefix_cache_block=args.prefix_cache_block,
                     api_key=args.api_key)
    with FakeServer(cfg, port=args.port or None) as srv:
        print(f"fake server ready: {srv.base_url}", flush=True)
        threading.Event().wait()  # until a signal ends the process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
