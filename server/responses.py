"""The OpenAI-compatible API's response bodies: whole responses, stream events (chunks), choices built
token by token (with OpenAI's logprobs shapes), usage, models and /tokenize's answer."""

from __future__ import annotations

import time
import uuid

from pdserve.protocol import control as P
from pdserve.protocol.timings import Timings


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens whose KV was reused, not computed
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def choice_body(kind: str, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                token_ids: list[int] | None = None, delta: bool = False, first: bool = False) -> dict:
    """One choice of a response (delta: of a stream event; first: its first event carries the role)."""
    if kind == "chat" and delta:
        choice = {"index": index, "delta": {"role": "assistant", "content": text} if first else {"content": text}}
    elif kind == "chat":
        choice = {"index": index, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": index, "text": text}
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response_body(kind: str, rid: str, created: int, model: str, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int, timings: Timings) -> dict:
    """completion_tokens: of every choice together (the prompt counts once, as OpenAI counts it)."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, timings.cached_tokens), "timings": timings.to_dict()}


def chunk_body(kind: str, rid: str, created: int, model: str, choice: dict, null_usage: bool = False) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if null_usage:  # stream_options.include_usage: the usage comes in its own last event
        body["usage"] = None
    return body


class LogprobsBuilder:
    """One choice's `logprobs`, as OpenAI shapes them, built token by token (a stream's events each take
    the part since the last one): chat `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    completions (legacy) `{tokens, token_logprobs, top_logprobs, text_offset}`, where a prompt's first
    token (echo) has null logprobs and each top_logprobs dict holds the chosen token too (as vLLM's).
    `text_of(id)`: a token's text."""

    def __init__(self, kind: str, text_of):
        self.kind, self.text_of = kind, text_of
        self.offset = 0  # completions: characters of the choice's text so far
        self.parts: list = []

    def add(self, token_id: int, lp: P.TokenLogprobs | None) -> None:
        text = self.text_of(token_id)
        if self.kind == "chat":
            self.parts.append({**self._entry(text, lp.logprob),
                               "top_logprobs": [self._entry(self.text_of(i), v)
                                                for i, v in zip(lp.top_ids, lp.top_logprobs)]})
        else:
            top = None
            if lp is not None:
                top = {self.text_of(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
                top.setdefault(text, lp.logprob)
            self.parts.append((text, None if lp is None else lp.logprob, top, self.offset))
            self.offset += len(text)

    def take(self) -> dict | None:
        """What was added since the last take, shaped; None if nothing."""
        parts, self.parts = self.parts, []
        if not parts:
            return None
        if self.kind == "chat":
            return {"content": parts}
        return {"tokens": [p[0] for p in parts], "token_logprobs": [p[1] for p in parts],
                "top_logprobs": [p[2] for p in parts], "text_offset": [p[3] for p in parts]}

    @staticmethod
    def _entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}



class ChoiceBuilder:
    """One choice of a response, from its tokens as they come: the whole choice (`body`) or a stream
    event's part (`delta`). `echo`: the prompt's text, put before the completion; with logprobs the
    prompt's tokens come first in them (the first one's logprob null: nothing predicts it)."""

    def __init__(self, kind: str, index: int, text_of, logprobs: bool, with_ids: bool,
                 echo: str | None = None, prompt_ids: list[int] | None = None):
        self.kind, self.index, self.with_ids = kind, index, with_ids
        self.lp = LogprobsBuilder(kind, text_of) if logprobs else None
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
        return choice_body(self.kind, self.index, "".join(self.text), self.finish_reason,
                           self.lp.take() if self.lp else None, self.token_ids if self.with_ids else None)

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None = None) -> dict:
        first, self.first = self.first, False
        return choice_body(self.kind, self.index, text, finish_reason, self.lp.take() if self.lp else None,
                           token_ids if self.with_ids else None, delta=True, first=first)


def usage_chunk_body(kind: str, rid: str, created: int, model: str) -> dict:
    """include_usage's last event before [DONE]: no choices; the caller adds `usage` (and `timings`)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": []}


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
