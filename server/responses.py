"""The OpenAI-compatible API's response bodies: whole responses, stream events (chunks), choices built
token by token, usage, models and /tokenize's answer. What differs between chat and completions (ids,
`object` names, a choice's text and logprobs shapes) is the Api's (server/apis.py)."""

from __future__ import annotations

import time

from pdserve.protocol import control as P
from pdserve.protocol.timings import Timings
from pdserve.server.apis import Api


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens whose KV was reused, not computed
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def choice_body(api: Api, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                token_ids: list[int] | None = None, delta: bool = False, first: bool = False) -> dict:
    """One choice of a response (delta: of a stream event; first: its first event carries the role)."""
    choice = api.choice(index, text, delta, first)
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response_body(api: Api, rid: str, created: int, model: str, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int, timings: Timings) -> dict:
    """completion_tokens: of every choice together (the prompt counts once, as OpenAI counts it)."""
    return {"id": rid, "object": api.object, "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, timings.cached_tokens), "timings": timings.to_dict()}


def chunk_body(api: Api, rid: str, created: int, model: str, choice: dict, null_usage: bool = False) -> dict:
    body = {"id": rid, "object": api.chunk_object, "created": created, "model": model, "choices": [choice]}
    if null_usage:  # stream_options.include_usage: the usage comes in its own last event
        body["usage"] = None
    return body


class ChoiceBuilder:
    """One choice of a response, from its tokens as they come: the whole choice (`body`) or a stream
    event's part (`delta`). `echo`: the prompt's text, put before the completion; with logprobs the
    prompt's tokens come first in them (the first one's logprob null: nothing predicts it)."""

    def __init__(self, api: Api, index: int, text_of, logprobs: bool, with_ids: bool,
                 echo: str | None = None, prompt_ids: list[int] | None = None):
        self.api, self.index, self.with_ids = api, index, with_ids
        self.lp = api.logprobs(text_of) if logprobs else None
        self.echo, self.prompt_ids = echo, prompt_ids
        self.text: list[str] = []
        self.token_ids: list[int] = []  # generated (the prompt's are not counted)
        self.first = True
        self.finish_reason: str | None = None

    def add(self, token_id: int, text: str, logprobs: P.TokenLogprobs | None,
            prompt_logprobs: list[P.TokenLogprobs] | None) -> str:
        """The text this token brings (the echoed prompt first, with token 1)."""
        lead = ""
        if not self.token_ids and self.echo is not None:
            lead = self.echo
            if self.lp is not None:
                known = prompt_logprobs or []  # one per prompt token after the first
                for i, t in enumerate(self.prompt_ids):
                    self.lp.add(t, known[i - 1] if 0 < i <= len(known) else None)
        self.token_ids.append(token_id)
        if self.lp is not None:
            self.lp.add(token_id, logprobs)
        self.text.append(lead + text)
        return lead + text

    def body(self) -> dict:
        return choice_body(self.api, self.index, "".join(self.text), self.finish_reason,
                           self.lp.take() if self.lp else None, self.token_ids if self.with_ids else None)

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None = None) -> dict:
        first, self.first = self.first, False
        return choice_body(self.api, self.index, text, finish_reason, self.lp.take() if self.lp else None,
                           token_ids if self.with_ids else None, delta=True, first=first)


def usage_chunk_body(api: Api, rid: str, created: int, model: str) -> dict:
    """include_usage's last event before [DONE]: no choices; the caller adds `usage` (and `timings`)."""
    return {"id": rid, "object": api.chunk_object, "created": created, "model": model, "choices": []}


def model_card(model: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": model, "object": "model", "created": created, "owned_by": "pdserve"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # vLLM's extension: the context, in tokens
    return card


def models_body(model: str, created: int, max_model_len: int | None = None) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def tokenize_body(ids: list[int], max_model_len: int | None, token_strs: list[str] | None) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def now_s() -> int:
    return int(time.time())
