"""The router's HTTP API (FastAPI): OpenAI-compatible completions and chat, models, health, metrics.

    POST /v1/completions        prompt -> text (stream: SSE, server/sse.py; the last event carries usage, timings)
    POST /v1/chat/completions   messages -> assistant message
    GET  /v1/models             the one model served; GET /v1/models/{id}: that model, or 404
    POST /tokenize              vLLM's: a prompt or chat messages -> token ids (and count, context)
    POST /detokenize            vLLM's: token ids -> text
    GET  /version               pdserve's version
    GET  /openapi.json          the API, request bodies included
    GET  /docs                  the API on one HTML page (endpoints, request fields, vLLM's fields)
    GET  /health                200 when some policy can be served, 503 otherwise; lists the workers
                                (their addresses and PIDs only to a caller holding the API key)
    GET  /metrics               Prometheus

With an API key (RouterConfig.api_key) every endpoint but /health takes only `Authorization: Bearer
<key>` (401 otherwise); /metrics too unless RouterConfig.public_metrics. A request's `x-request-id`
comes back on its response, else completions carry their id there (server/request_id.py). Bodies
over max_body_bytes get 413 before they are read whole; large bodies are parsed, and long prompts tokenized, on a small thread pool of their own, so the event loop keeps
streaming tokens and answering /health; a prompt that cannot fit the context (more characters than
the context's tokens could hold) is refused before it is tokenized.

The router talks to workers over ZMQ only (server/pool.py); the pool starts and stops with the app.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.protocol.sampling import MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from pdserve.server import responses
from pdserve.server.admission import AdmittedStream, Tickets, workers_pace
from pdserve.server.api_docs import docs_page, openapi_body
from pdserve.server.apis import CHAT, COMPLETIONS, MESSAGE_CHARS, Api
from pdserve.server.body import parse_body
from pdserve.server.dispatch import Dispatcher
from pdserve.server.errors import APIError, bad_request, unknown_model
from pdserve.server.bodies import BodyBudget
from pdserve.server.guard import install_front_door
from pdserve.server.job import Done, Job, Token, fan_out
from pdserve.server.metrics import CONTENT_TYPE, Metrics
from pdserve.server.pacing import Pacer
from pdserve.server.pool import WorkerPool
from pdserve.server.request_id import RequestIdHeader
from pdserve.server.requests import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve.server.routing import Planner
from pdserve.server.sse import completion_events
from pdserve.server.timeline import Clock
from pdserve.server.tokenizer import PromptEncoder
from pdserve.settings.router import RouterConfig

log = logging.getLogger("pdserve.router")

LONG_TEXT_CHARS = 8192  # longer prompts are tokenized off the event loop
LONG_BODY_BYTES = 64 * 1024  # larger bodies are parsed off the event loop
DETOKENIZE_MAX = 131072  # /detokenize's bound on ids while no worker has said its context
OFF_LOOP_THREADS = 2  # parsing and tokenizing threads: bounds the memory hostile bodies can take at once


class Router:
    """Everything one router holds: config, tokenizer, worker pool, planner, dispatcher, metrics."""

    def __init__(self, cfg: RouterConfig, tokenizer):
        self.cfg = cfg
        self.encoder = PromptEncoder(tokenizer, cfg.chat_special_tokens)
        # fields refused by their length before the body is walked (server/body.py); the models say the rest
        self.field_sizes = {
            "allowed_token_ids": (self.encoder.vocab_size, "holds {n} ids; at most the vocabulary's {most}"),
            "logit_bias": (MAX_LOGIT_BIAS, "biases {n} tokens; at most {most}"),
            "bad_words": (MAX_BAD_WORDS, "holds {n} words; at most {most}"),
            "bad_words.chars": (MAX_BAD_WORDS_CHARS, "holds {n} characters; at most {most}"),
            "stop_token_ids": (MAX_STOP_TOKEN_IDS, "holds {n} ids; at most {most}")}
        self.metrics = Metrics(cfg.served_name)
        self.pool = WorkerPool(cfg, self.metrics)
        self.dispatcher = Dispatcher(cfg, self.pool, self.metrics)
        self.planner = Planner(cfg, self.pool, self.dispatcher.admission, self.metrics)
        self.created = responses.now_s()
        self._work = ThreadPoolExecutor(OFF_LOOP_THREADS, thread_name_prefix="parse")
        self.heavy = Pacer()  # big bodies' parsing: one at a time, at most a share of the router's time
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs (at most the vocabulary)
        self.bodies = BodyBudget(cfg)
        self.supervisor = None  # pdserve's Launcher when it started the workers: its trouble() shows on /health

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.dispatcher.close()
        await self.pool.stop()
        self._work.shutdown(wait=False, cancel_futures=True)

    # ---- access -----------------------------------------------------------------------------------

    def authorized(self, http: Request) -> bool:
        """No key configured, or the request carries it (compared in constant time)."""
        if self.cfg.api_key is None:
            return True
        scheme, _, token = http.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.cfg.api_key.encode())

    def require_key(self, http: Request) -> None:
        if not self.authorized(http):
            raise APIError(401, "this server needs an API key: send `Authorization: Bearer <key>` (the key pdserve "
                           "was started with, --api-key or PDSERVE_API_KEY)", "invalid_request_error", None,
                           "invalid_api_key")

    async def read_body(self, http: Request) -> bytes:
        """The body: 413 as soon as it is known to exceed the limit, 429 over its address's share of the
        bodies in flight, 503 over the router's budget, 408 past the body timeout or under the minimum
        rate (server/bodies.py)."""
        return await self.bodies.read(http)

    # ---- one request ------------------------------------------------------------------------------

    async def prepare(self, api: Api, req: CompletionRequest | ChatRequest, request_id: str,
                      clock: Clock) -> Job:
        req.check()
        self._check_model(req.model)
        prompt = req.prompt_input()
        param = api.prompt_field
        context = self.pool.max_model_len()
        size = api.prompt_size(prompt)
        if size is None:  # token ids
            ids = self.encoder.check_ids(prompt)
        else:
            chars, work = size
            self._check_fits(chars, context, param)
            ids = await self._off_loop(lambda p: req.encode(self.encoder, p), prompt, work)
        # truncate_prompt_tokens; the token ids the request names checked, its bad words tokenized
        ids = await self._off_loop(lambda i: req.prepared_ids(i, context, self.encoder), ids, req.named_size())
        if not ids:
            raise bad_request(f"`{param}` encodes to no tokens; send some text", param, "empty_prompt")
        n = len(ids)
        max_tokens = req.max_tokens
        if context is not None:
            if n >= context:
                raise bad_request(f"the prompt is {n} tokens; the model's context is {context} tokens, and at least "
                                  f"one must be left for the answer; shorten the prompt", param,
                                  "context_length_exceeded")
            if max_tokens is not None and n + max_tokens > context:
                raise bad_request(f"`max_tokens` is {max_tokens}, but the prompt already takes {n} of the model's "
                                  f"{context} tokens of context; ask for at most {context - n}", "max_tokens",
                                  "context_length_exceeded")
        if max_tokens is None:
            default = api.default_max_tokens(self.cfg)
            max_tokens = default if context is None else min(default, context - n)
        clock.prepared = time.monotonic()  # the end of the `parse` phase
        return Job(request_id, ids, req.sampling(max_tokens), req.policy, clock)

    def _check_fits(self, chars: int, context: int | None, param: str) -> None:
        """A prompt of more characters than `context` tokens can hold cannot fit: refuse it untokenized
        (tokenizing megabytes takes seconds and hundreds of MB)."""
        if context is not None and chars > context * self.encoder.max_chars_per_token:
            raise bad_request(f"the prompt is {chars} characters, more than the model's context of {context} tokens "
                              f"can hold; shorten the prompt", param, "context_length_exceeded")

    async def _off_loop(self, fn, arg, size: int, threshold: int = LONG_TEXT_CHARS):
        """Parse or tokenize big input on the router's own threads: the event loop keeps streaming
        other requests' tokens, and at most OFF_LOOP_THREADS such jobs hold memory at once."""
        if size < threshold:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self._work, fn, arg)

    async def handle(self, api: Api, http: Request) -> Response:
        clock = Clock.start()  # arrival: parsing and tokenizing count as the router's queue time
        self.require_key(http)
        cls = api.request
        raw = await self.read_body(http)
        parse = (lambda body: parse_body(body, cls, self.field_sizes))
        req = parse(raw) if len(raw) < LONG_BODY_BYTES else await self.heavy.run(self._work, parse, raw)
        rid = api.new_id()
        http.state.request_id = rid  # the response's x-request-id (server/request_id.py)
        job = await self.prepare(api, req, rid, clock)
        plans = self.planner.plan_all(fan_out(job, req.n))
        tickets = Tickets([p.ticket for p in plans])
        choices = self._choices(api, req, job)
        if req.stream:
            events = completion_events(api, req.response_id(rid), self.cfg.served_name, len(job.prompt_ids),
                                       req.stream_options, choices, workers_pace(self.dispatcher.execute_all(plans)))
            return AdmittedStream(events, tickets, self.cfg.send_timeout_s,
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        dones: list[Done | None] = [None] * len(plans)

        async def collect() -> None:
            async for i, event in self.dispatcher.execute_all(plans):
                if isinstance(event, Token):
                    choices[i].add(event.token_id, event.text, event.logprobs, event.prompt_logprobs)
                else:
                    dones[i] = event
                    choices[i].finish_reason = event.finish_reason

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            tickets.release()
            gone.cancel()
            if not work.done():  # the client left (or we are cancelled): stop its workers
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                log.info("request %s: the client disconnected; aborted", rid)
        if work.cancelled():
            return Response(status_code=499)
        work.result()  # raises the request's APIError, if any
        return JSONResponse(responses.response_body(
            api, req.response_id(rid), responses.now_s(), self.cfg.served_name, [c.body() for c in choices],
            len(job.prompt_ids), sum(len(d.token_ids) for d in dones), dones[0].timings))

    def _choices(self, api: Api, req: CompletionRequest | ChatRequest, job: Job) -> list[responses.ChoiceBuilder]:
        """One builder per choice: logprobs if asked, the prompt's text first if echoed (completions)."""
        logprobs = job.sampling.logprobs is not None
        echo = None
        if api.echoes(req):
            prompt = req.prompt_input()
            echo = prompt if isinstance(prompt, str) else self.encoder.decode(job.prompt_ids)
        return [responses.ChoiceBuilder(api, i, self._token_text, logprobs, req.return_token_ids, echo, job.prompt_ids)
                for i in range(req.n)]

    def _token_text(self, token_id: int) -> str:
        """A token's text as logprobs show it (vLLM's: the token decoded alone), remembered."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.encoder.decode([token_id])
        return text

    # ---- read-only endpoints ----------------------------------------------------------------------

    async def tokenize(self, http: Request) -> JSONResponse:
        self.require_key(http)
        raw = await self.read_body(http)
        req = await self._off_loop(lambda body: parse_body(body, TokenizeRequest), raw, len(raw), LONG_BODY_BYTES)
        self._check_model(req.model)
        prompt = req.prompt_input()
        context = self.pool.max_model_len()
        if isinstance(prompt, str):
            self._check_fits(len(prompt), context, "prompt")
            ids = await self._off_loop(lambda p: self.encoder.text(p, req.add_special_tokens), prompt, len(prompt))
        else:
            chars = sum(len(m["content"]) for m in prompt)
            self._check_fits(chars, context, "messages")
            ids = await self._off_loop(lambda m: self.encoder.chat(m, req.add_generation_prompt), prompt,
                                       chars + MESSAGE_CHARS * len(prompt))
        strs = self.encoder.token_strs(ids) if req.return_token_strs else None
        return JSONResponse(responses.tokenize_body(ids, context, strs))

    async def detokenize(self, http: Request) -> JSONResponse:
        self.require_key(http)
        raw = await self.read_body(http)
        req = await self._off_loop(lambda body: parse_body(body, DetokenizeRequest), raw, len(raw),
                                   LONG_BODY_BYTES)
        self._check_model(req.model)
        ids = req.check()
        context = self.pool.max_model_len() or DETOKENIZE_MAX
        if len(ids) > context:  # no sequence this server makes or takes is longer
            raise bad_request(f"`tokens` has {len(ids)} ids; the model's context is {context} tokens", "tokens",
                              "context_length_exceeded")
        ids = self.encoder.check_ids(ids, "tokens")
        loop = asyncio.get_running_loop()  # decoded and encoded on the router's threads, whatever the size
        body = await loop.run_in_executor(self._work, lambda: JSONResponse({"prompt": self.encoder.decode(ids)}))
        return body

    def _check_model(self, model: str | None) -> None:
        """The served name (--served-model-name) or, when that differs, the model itself; null: this one."""
        if model is not None and model not in (self.cfg.served_name, self.cfg.model):
            raise unknown_model(model, self.cfg.served_name)

    def health(self, private: bool) -> JSONResponse:
        """`private` (no API key configured, or the caller holds it): worker addresses and PIDs too."""
        policies = self.planner.servable_now()
        ok = any(policies.values())
        short = self.pool.shortfall(self.cfg.expected_workers)
        draining = self.dispatcher.admission.draining
        status = "draining" if draining else "unavailable" if not ok else "degraded" if short else "ok"
        body = {"status": status, "model": self.cfg.served_name, "policy": self.cfg.policy,
                "policies": policies, "workers": [w.describe(private) for w in self.pool.workers.values()]}
        trouble = self.supervisor.trouble() if self.supervisor is not None else {}
        if status == "ok" and trouble:
            status = "degraded"
        if short:  # still serving (200), with fewer workers than configured
            body["missing"] = short
            body["message"] = "fewer workers than configured: " + ", ".join(
                f"{role} {n} missing of {self.cfg.expected_workers[role]}" for role, n in short.items())
        if trouble:  # a worker that cannot be restarted, or supervision itself failing (and retrying)
            body["supervision"] = trouble
            body["message"] = "; ".join(([body["message"]] if "message" in body else []) + [
                f"{who}: {why}" for who, why in trouble.items()])
        body["status"] = status
        if private:
            body["register"] = self.pool.address
        if not ok:
            body["message"] = "no worker can serve requests yet; start workers with --router " + (
                self.pool.address if private else "<the router's register endpoint>")
        if draining:  # 503: a load balancer stops sending here
            ok, body["message"] = False, "shutting down: in-flight requests finish, new ones get 503"
        return JSONResponse(body, status_code=200 if ok else 503)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def _disconnected(http: Request) -> None:
    """Returns when the client has gone (the body is read already: the next ASGI message is the
    disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(cfg: RouterConfig, tokenizer) -> FastAPI:
    router = Router(cfg, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    # FastAPI's docs pages are off (they load scripts from a CDN): /docs is our own page, /openapi.json is
    # served below, behind the key
    app = FastAPI(title="pdserve", version=_version(), lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.add_middleware(RequestIdHeader)
    install_front_door(app, cfg)  # outermost: Host, content type and framing before anything else
    completion_body, completion_schemas = openapi_body(CompletionRequest)
    chat_body, chat_schemas = openapi_body(ChatRequest)
    tokenize_body, tokenize_schemas = openapi_body(TokenizeRequest)
    detokenize_body, detokenize_schemas = openapi_body(DetokenizeRequest)
    schemas = completion_schemas | chat_schemas | tokenize_schemas | detokenize_schemas
    app.state.router = router

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        hint = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 404:
            hint += ("; endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
                     "/version, /health, /metrics, /openapi.json, /docs")
        return APIError(e.status_code, hint, "invalid_request_error", None, None).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", None,
                        "internal_error").response()

    @app.post("/v1/completions", openapi_extra=completion_body)
    async def completions(request: Request):
        return await router.handle(COMPLETIONS, request)

    @app.post("/v1/chat/completions", openapi_extra=chat_body)
    async def chat_completions(request: Request):
        return await router.handle(CHAT, request)

    @app.get("/v1/models")
    async def models(request: Request):
        router.require_key(request)
        return responses.models_body(cfg.served_name, router.created, router.pool.max_model_len())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        router.require_key(request)
        router._check_model(model_id)
        return responses.model_card(cfg.served_name, router.created, router.pool.max_model_len())

    @app.post("/tokenize", openapi_extra=tokenize_body)
    async def tokenize(request: Request):
        return await router.tokenize(request)

    @app.post("/detokenize", openapi_extra=detokenize_body)
    async def detokenize(request: Request):
        return await router.detokenize(request)

    @app.get("/version")
    async def version(request: Request):
        router.require_key(request)
        return {"version": _version()}

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):  # behind the key, as /openapi.json
        router.require_key(request)
        return HTMLResponse(docs_page("pdserve", _version(), {"/v1/completions": CompletionRequest,
                                                              "/v1/chat/completions": ChatRequest}))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        router.require_key(request)
        doc = app.openapi()  # built once and cached by FastAPI; the bodies' schemas joined in once
        doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return JSONResponse(doc)

    @app.get("/health")
    async def health(request: Request):
        return router.health(private=router.authorized(request))

    @app.get("/metrics")
    async def metrics(request: Request):
        if not cfg.public_metrics:
            router.require_key(request)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app
