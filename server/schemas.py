"""The OpenAI-compatible API's shapes: request bodies (pydantic, strict types) and response bodies.

Request models convert themselves: `.sampling(...)` gives the wire Sampling, `.prompt_input()`
the text, token ids or chat messages to tokenize. Bad input raises APIError (400) naming the field.
pdserve extensions: `policy` (colocated | disaggregated | auto), `top_k`, `ignore_eos`,
`return_token_ids`. Sampling defaults to greedy (temperature 0) unless the request says otherwise.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from server.errors import APIError, bad_request
from workers.protocol import Sampling

POLICIES = ("colocated", "disaggregated", "auto")
MAX_STOP = 16


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object, "
                          f"e.g. {{\"prompt\": \"Hello\", \"max_tokens\": 16}}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return bad_request(f"`{param}` is required", param=param, code="missing_field")
    if err["type"] == "value_error":
        return bad_request(msg, param=param)
    given = err.get("input")
    return bad_request(f"`{param}`: {msg[0].lower() + msg[1:]}, got {_show(given)}", param=param, code="invalid_type")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "literal"}


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False
    policy: str | None = None
    return_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError(f"`stop` must be a string or a list of strings, got {_show(v)}")

    def check_common(self) -> None:
        if self.n != 1:
            raise bad_request(f"`n` must be 1 (pdserve returns one choice per request), got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise bad_request(f"`{name}` is not supported by pdserve; leave it out or set it to 0", name)
        if self.logit_bias:
            raise bad_request("`logit_bias` is not supported by pdserve; leave it out", "logit_bias")
        if self.policy is not None and self.policy not in POLICIES:
            raise bad_request(f"unknown policy {self.policy!r}; `policy` must be one of {', '.join(POLICIES)}",
                              "policy", "invalid_policy")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise bad_request(f"`max_tokens` must be a positive integer, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad_request(f"`temperature` must be between 0 and 2 (0 = greedy), got {self.temperature}",
                              "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise bad_request(f"`top_p` must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise bad_request(f"`top_k` must be >= 0 (0 turns it off), got {self.top_k}", "top_k")
        if self.seed is not None and self.seed < 0:
            raise bad_request(f"`seed` must be a non-negative integer, got {self.seed}", "seed")
        stops = self.stop_list()
        if any(not s for s in stops):
            raise bad_request("`stop` strings must not be empty", "stop")
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} `stop` strings, got {len(stops)}", "stop")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int) -> Sampling:
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: Any = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("`echo` is not supported by pdserve; leave it out", "echo")
        if self.logprobs is not None:
            raise bad_request("`logprobs` is not supported by pdserve; leave it out", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("`best_of` must be 1 or left out", "best_of")
        if self.suffix is not None:
            raise bad_request("`suffix` is not supported by pdserve; leave it out", "suffix")

    def prompt_input(self) -> str | list[int]:
        """The prompt as text or token ids; one prompt per request."""
        p = self.prompt
        if p is None:
            raise bad_request("`prompt` is required: a string (or a list of token ids)", "prompt", "missing_field")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise bad_request("`prompt` is empty; send at least one character of text", "prompt", "empty_prompt")
            return p
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not p:
                raise bad_request("`prompt` is an empty list of token ids; send at least one token", "prompt",
                                  "empty_prompt")
            return p
        if isinstance(p, list) and all(isinstance(t, (str, list)) for t in p):
            raise bad_request(f"`prompt` holds {len(p)} prompts; pdserve takes one prompt per request "
                              f"(send them as separate requests)", "prompt")
        raise bad_request(f"`prompt` must be a string or a list of token ids, got {_show(p)}", "prompt",
                          "invalid_type")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    def text(self, index: int) -> str:
        c = self.content
        if isinstance(c, str):
            return c
        if isinstance(c, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                       and isinstance(part.get("text"), str) for part in c):
            return "".join(part["text"] for part in c)
        raise bad_request(f"`messages.{index}.content` must be a string or a list of "
                          f"{{\"type\": \"text\", \"text\": ...}} parts, got {_show(c)}",
                          f"messages.{index}.content", "invalid_type")


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False

    def check(self) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        self.check_common()
        if self.logprobs:
            raise bad_request("`logprobs` is not supported by pdserve; leave it out", "logprobs")

    def prompt_input(self) -> list[dict]:
        if not self.messages:
            raise bad_request("`messages` is empty; send at least one message, e.g. "
                              "[{\"role\": \"user\", \"content\": \"Hello\"}]", "messages", "empty_prompt")
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        if not any(m["content"] for m in out):
            raise bad_request("every message's content is empty; say something", "messages", "empty_prompt")
        return out


# ---- responses -----------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int, timings: dict,
                  token_ids: list[int] | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens), "timings": timings}


def chunk_body(kind: str, rid: str, created: int, model: str, text: str, first: bool,
               finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict:
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "pdserve"}]}


def now_s() -> int:
    return int(time.time())
