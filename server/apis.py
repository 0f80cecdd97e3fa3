"""The two OpenAI APIs the router answers, one object each: CHAT (/v1/chat/completions) and COMPLETIONS
(/v1/completions). The route picks one and passes it along (server/app.py, server/sse.py,
server/responses.py); what differs between the two is asked of it.

    api.request                  the request body's model (server/requests.py)
    api.prompt_field             the field the prompt comes in, as errors name it: messages | prompt
    api.new_id()                 a response's id: chatcmpl-<hex> | cmpl-<hex>
    api.object                   a whole response's `object`: chat.completion | text_completion
    api.chunk_object             a stream event's `object`: chat.completion.chunk | text_completion
    api.default_max_tokens(cfg)  max_tokens when the request leaves it out
    api.prompt_size(prompt)      (characters, tokenizing work) of a prompt to tokenize; None: token ids
    api.echoes(req)              the prompt's text comes first in each choice (completions' `echo`)
    api.choice(index, text, delta, first)
                                 a choice's index and text: `message` (chat), `delta` (chat's stream
                                 events; the first carries the role) or `text` (completions)
    api.logprobs(text_of)        a builder of one choice's `logprobs`, in this API's shape
"""

from __future__ import annotations

import uuid

from pdserve.protocol import control as P
from pdserve.server.requests import ChatRequest, CompletionRequest
from pdserve.settings.router import RouterConfig

MESSAGE_CHARS = 64  # what one chat message costs the template and tokenizer beyond its text, roughly


class LogprobsBuilder:
    """One choice's `logprobs`, built token by token (a stream's events each take the part since the
    last one). `text_of(id)`: a token's text."""

    def __init__(self, text_of):
        self.text_of = text_of
        self.parts: list = []

    def add(self, token_id: int, lp: P.TokenLogprobs | None) -> None:
        raise NotImplementedError

    def take(self) -> dict | None:
        """What was added since the last take, shaped; None if nothing."""
        parts, self.parts = self.parts, []
        return self._shaped(parts) if parts else None

    def _shaped(self, parts: list) -> dict:
        raise NotImplementedError


class ChatLogprobs(LogprobsBuilder):
    """Chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`."""

    def add(self, token_id: int, lp: P.TokenLogprobs | None) -> None:
        text = self.text_of(token_id)
        self.parts.append({**self._entry(text, lp.logprob),
                           "top_logprobs": [self._entry(self.text_of(i), v)
                                            for i, v in zip(lp.top_ids, lp.top_logprobs)]})

    def _shaped(self, parts: list) -> dict:
        return {"content": parts}

    @staticmethod
    def _entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionLogprobs(LogprobsBuilder):
    """Completions' (legacy) `{tokens, token_logprobs, top_logprobs, text_offset}`, where a prompt's first
    token (echo) has null logprobs and each top_logprobs dict holds the chosen token too (as vLLM's)."""

    def __init__(self, text_of):
        super().__init__(text_of)
        self.offset = 0  # characters of the choice's text so far

    def add(self, token_id: int, lp: P.TokenLogprobs | None) -> None:
        text = self.text_of(token_id)
        top = None
        if lp is not None:
            top = {self.text_of(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(text, lp.logprob)
        self.parts.append((text, None if lp is None else lp.logprob, top, self.offset))
        self.offset += len(text)

    def _shaped(self, parts: list) -> dict:
        return {"tokens": [p[0] for p in parts], "token_logprobs": [p[1] for p in parts],
                "top_logprobs": [p[2] for p in parts], "text_offset": [p[3] for p in parts]}


class Api:
    """What one of the two APIs does its own way; CHAT and COMPLETIONS are the only instances."""

    request: type[ChatRequest] | type[CompletionRequest]
    prompt_field: str
    id_prefix: str
    object: str
    chunk_object: str

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def default_max_tokens(self, cfg: RouterConfig) -> int:
        raise NotImplementedError

    def prompt_size(self, prompt) -> tuple[int, int] | None:
        raise NotImplementedError

    def echoes(self, req) -> bool:
        raise NotImplementedError

    def choice(self, index: int, text: str, delta: bool, first: bool) -> dict:
        raise NotImplementedError

    def logprobs(self, text_of) -> LogprobsBuilder:
        raise NotImplementedError


class ChatApi(Api):
    request = ChatRequest
    prompt_field = "messages"
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def default_max_tokens(self, cfg: RouterConfig) -> int:
        return cfg.default_chat_max_tokens

    def prompt_size(self, prompt: list[dict]) -> tuple[int, int]:
        chars = sum(len(m["content"]) for m in prompt)
        return chars, chars + MESSAGE_CHARS * len(prompt)

    def echoes(self, req: ChatRequest) -> bool:
        return False

    def choice(self, index: int, text: str, delta: bool, first: bool) -> dict:
        if delta:
            return {"index": index, "delta": {"role": "assistant", "content": text} if first else {"content": text}}
        return {"index": index, "message": {"role": "assistant", "content": text}}

    def logprobs(self, text_of) -> LogprobsBuilder:
        return ChatLogprobs(text_of)


class CompletionsApi(Api):
    request = CompletionRequest
    prompt_field = "prompt"
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def default_max_tokens(self, cfg: RouterConfig) -> int:
        return cfg.default_max_tokens

    def prompt_size(self, prompt: str | list[int]) -> tuple[int, int] | None:
        return (len(prompt), len(prompt)) if isinstance(prompt, str) else None

    def echoes(self, req: CompletionRequest) -> bool:
        return req.echo

    def choice(self, index: int, text: str, delta: bool, first: bool) -> dict:
        return {"index": index, "text": text}

    def logprobs(self, text_of) -> LogprobsBuilder:
        return CompletionLogprobs(text_of)


CHAT = ChatApi()
COMPLETIONS = CompletionsApi()
