"""The OpenAI-compatible API's request bodies (pydantic, strict types); server/body.py parses and checks a
body before it gets here, server/responses.py shapes the answers.

Request models convert themselves: `.sampling(...)` gives the wire Sampling, `.prompt_input()`
the text, token ids or chat messages to tokenize. Bad input raises APIError (400) naming the field.

Every number is inside the control protocol's bounds (protocol/sampling.py defines them once, for this
API, the wire and the engine: seed 0..2**63-1, temperature 0..2, penalties, top_k and max_tokens below
2**31, at most 16 stop strings of 4096 characters, 20 top logprobs), so nothing reaches msgpack or
torch that they would fail on; a temperature under MIN_TEMPERATURE samples greedily.
pdserve's own field: `policy` (colocated | disaggregated | auto); the others are OpenAI's and vLLM's
(server/fields.py says which, and what each does here). Sampling defaults to
greedy (temperature 0) unless the request says otherwise. `n` > 1: choice i samples with seed + i
when a seed is given.

Nothing is silently ignored: a field no model here declares is refused (400, naming it), and so is a
field OpenAI or vLLM defines that pdserve does not implement (server/fields.py, one row a field:
`tools`, `response_format`, `best_of`, guided decoding, ...) unless it holds its neutral value
(`best_of: 1`, `tools: []`), which changes nothing and is what many clients send by default.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from pdserve.server.body import show
from pdserve.server.errors import bad_request
from pdserve.protocol.enums import POLICIES
from pdserve.protocol.sampling import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS, MAX_LOGIT_BIAS,
                                       MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidSampling,
                                       Sampling)
from pdserve.protocol.wire import MAX_INT32, MAX_PROMPT_TOKENS

MAX_N = 16  # choices per request: each is a sequence of its own on the workers
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' `logprobs` (OpenAI's legacy bound); chat's top_logprobs: MAX_LOGPROBS
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: ASCII digits ("²" is a digit to str.isdigit, not to int)


class StreamOptions(BaseModel):
    """OpenAI's: `include_usage` adds a last event before [DONE] with empty `choices` and the usage (and
    pdserve's timings); the other events then carry `"usage": null`. vLLM's `continuous_usage_stats`:
    every event carries the usage so far instead (and include_usage, unless given, is then true)."""
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: bool = False

    def usage_event(self) -> bool:
        return self.include_usage if self.include_usage is not None else self.continuous_usage_stats


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = Field(0, description="pdserve (and vLLM): sample from the k most likely tokens; 0: off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="pdserve (and vLLM): generate max_tokens tokens, past the "
                             "end-of-sequence token")
    policy: str | None = Field(None, description="pdserve: colocated | disaggregated | auto (prompts shorter "
                               "than the router's threshold stay colocated); default: the router's --policy")
    return_token_ids: bool = Field(False, description="pdserve: each choice (or stream event) carries its "
                                   "token ids")
    user: str | None = Field(None, description="OpenAI's end-user tag: accepted, changes nothing")
    n: int = Field(1, description=f"choices to generate (1..{MAX_N}); with a seed, choice i samples with seed + i")
    presence_penalty: float = Field(0.0, description="OpenAI: -2..2, minus this from the logit of every token "
                                    "generated so far")
    frequency_penalty: float = Field(0.0, description="OpenAI: -2..2, minus this times how often each token was "
                                     "generated so far")
    repetition_penalty: float = Field(1.0, description=f"vLLM: (0, {MAX_REPETITION_PENALTY:g}], tokens of the "
                                      "prompt or the output: logit / r if positive, * r if not; 1: off")
    min_tokens: int = Field(0, description="vLLM: EOS and stop_token_ids cannot end the answer before this many "
                            "tokens (stop strings are not checked either)")
    stop_token_ids: list[int] | None = Field(None, description="vLLM: generating one of these token ids stops "
                                             "(finish_reason stop; its text stays unless it is a special token)")
    min_p: float = Field(0.0, description="vLLM: 0..1, drop tokens less likely than min_p x the top token's "
                         "probability; 0: off")
    logit_bias: dict[str, float] | None = Field(None, description="OpenAI: {token id: -100..100} added to its logit")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM: only these token ids may be generated")
    bad_words: list[str] | None = Field(None, description="vLLM: words that must not be generated (as written "
                                        "and with a leading space)")
    include_stop_str_in_output: bool = Field(False, description="vLLM: the stop string that ended the answer stays "
                                             "in its text")
    skip_special_tokens: bool = Field(True, description="vLLM: leave special tokens' text out of the answer")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM: keep only the prompt's last N tokens (-1: as "
                                               "many as the context holds)")
    add_special_tokens: bool | None = Field(None, description="vLLM: the tokenizer's special tokens (BOS) around "
                                            "the prompt; default: true for completions, false for chat")
    request_id: str | None = Field(None, description="vLLM: the response's id becomes cmpl-<id> / chatcmpl-<id>")
    safety_identifier: str | None = Field(None, description="OpenAI's end-user tag: accepted, changes nothing")
    _bad_words_ids: list[list[int]] = PrivateAttr(default_factory=list)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError(f"`stop` must be a string or a list of strings, got {show(v)}")

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("`stream_options` applies only to streamed responses: set `stream` to true or "
                              "leave `stream_options` out", "stream_options")
        if self.policy is not None and self.policy not in POLICIES:
            raise bad_request(f"unknown policy {self.policy!r}; `policy` must be one of {', '.join(POLICIES)}",
                              "policy", "invalid_policy")
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"`n` must be between 1 and {MAX_N} (choices per request), got {self.n}", "n")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and self.stream_options.include_usage is False:
            raise bad_request("`stream_options.continuous_usage_stats` puts the usage in every event and needs "
                              "`include_usage` true (or left out)", "stream_options.continuous_usage_stats")
        if self.top_k == -1:  # vLLM's spelling of "off"
            self.top_k = 0
        if self.request_id is not None and not _REQUEST_ID.fullmatch(self.request_id):
            raise bad_request(f"`request_id` must be 1 to 128 characters of A-Z a-z 0-9 . _ : -, got "
                              f"{show(self.request_id)}", "request_id")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            raise bad_request(f"`truncate_prompt_tokens` must be at least 1 (or -1: the context), got "
                              f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if self.bad_words is not None and (len(self.bad_words) > MAX_BAD_WORDS or not all(self.bad_words)):
            raise bad_request(f"`bad_words` takes at most {MAX_BAD_WORDS} non-empty words", "bad_words")
        if self.bad_words is not None and sum(map(len, self.bad_words)) > MAX_BAD_WORDS_CHARS:
            raise bad_request(f"`bad_words` holds {sum(map(len, self.bad_words))} characters; at most "
                              f"{MAX_BAD_WORDS_CHARS} in all (each word at most {MAX_BAD_WORD_TOKENS} tokens)",
                              "bad_words")
        self._check_logit_bias()
        # every sampling bound, as the wire and the engine check it (protocol/sampling.py); max_tokens
        # may still be unset here (then up to the model's context, known once the prompt is tokenized)
        self._sampling(self.max_tokens if self.max_tokens is not None else MAX_INT32)

    def _check_logit_bias(self) -> None:
        """At most MAX_LOGIT_BIAS keys, each a token id in ASCII digits (the vocabulary: prepared_ids),
        each value within -100..100; the 400 names the key at fault."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"`logit_bias` biases {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
        for key, value in bias.items():
            if not _TOKEN_ID.fullmatch(key) or int(key) > MAX_INT32:
                raise bad_request(f"`logit_bias` keys must be token ids written in digits 0-9 (at most 10 of "
                                  f"them), got the key {show(key)}", "logit_bias")
            if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
                raise bad_request(f"`logit_bias` values must be in [{-MAX_LOGIT_BIAS_VALUE:g}, "
                                  f"{MAX_LOGIT_BIAS_VALUE:g}], got {value:g} for the key {show(key)}", "logit_bias")

    def named_size(self) -> int:
        """What prepared_ids() reads beside the prompt: characters of bad words (two spellings each) and
        token ids (the router checks them off the event loop when there are many)."""
        return (2 * sum(map(len, self.bad_words or [])) + len(self.allowed_token_ids or [])
                + len(self.logit_bias or {}))

    def response_id(self, rid: str) -> str:
        """The id the response shows: pdserve's own (`rid`, unique: workers key their state by it), or the
        caller's `request_id` under the same prefix."""
        return rid if self.request_id is None else f"{rid.split('-')[0]}-{self.request_id}"

    def encode(self, encoder, prompt) -> list[int]:
        """The prompt's token ids with this request's tokenizer options (chat: through the template)."""
        if isinstance(prompt, str):
            return encoder.text(prompt, self.add_special_tokens is not False)
        return encoder.chat(prompt, **self.template_options())

    def template_options(self) -> dict:
        return {"add_special_tokens": bool(self.add_special_tokens)}

    def prepared_ids(self, ids: list[int], context: int | None, encoder) -> list[int]:
        """The prompt after truncate_prompt_tokens; the token ids this request names (allowed_token_ids,
        logit_bias) checked against the vocabulary, and its bad words tokenized."""
        keep = self.truncate_prompt_tokens
        if keep == -1 and context is not None:
            keep = context - 1  # at least one token of the context is left for the answer
        if keep is not None and keep > 0 and len(ids) > keep:
            ids = ids[-keep:]
        allowed = self.allowed_token_ids or []
        if len(allowed) > encoder.vocab_size:
            raise bad_request(f"`allowed_token_ids` holds {len(allowed)} ids; at most the vocabulary's "
                              f"{encoder.vocab_size}", "allowed_token_ids")
        encoder.check_ids(allowed, "allowed_token_ids")
        encoder.check_ids([int(k) for k in self.logit_bias or {}], "logit_bias")
        words = []
        for i, w in enumerate(self.bad_words or []):  # as written and after a space: the two spellings in text
            for spelling in dict.fromkeys((w, " " + w.lstrip())):  # each once (" Paris" is both)
                word = encoder.text(spelling, False)
                if len(word) > MAX_BAD_WORD_TOKENS:
                    raise bad_request(f"`bad_words[{i}]` is {len(word)} tokens ({show(spelling)}); a bad word "
                                      f"may be at most {MAX_BAD_WORD_TOKENS}", "bad_words")
                if word and word not in words:
                    words.append(word)
        self._bad_words_ids = words
        return ids

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top logprobs per generated token, per prompt token); None: not asked."""
        return None, None

    def sampling(self, max_tokens: int) -> Sampling:
        if self.min_tokens > max_tokens:
            raise bad_request(f"`min_tokens` ({self.min_tokens}) must not exceed the {max_tokens} tokens this "
                              f"request may generate; lower it or raise `max_tokens`", "min_tokens")
        return self._sampling(max_tokens)

    def _sampling(self, max_tokens: int) -> Sampling:
        logprobs, prompt_logprobs = self.logprob_counts()
        try:
            return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos,
                            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                            stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, min_p=self.min_p,
                            allowed_token_ids=list(self.allowed_token_ids or []), bad_words_ids=self._bad_words_ids,
                            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},  # checked
                            include_stop_str_in_output=self.include_stop_str_in_output,
                            skip_special_tokens=self.skip_special_tokens).checked()
        except InvalidSampling as e:
            raise bad_request(str(e), e.field) from None


class CompletionRequest(_Common):
    endpoint: ClassVar[str] = "completions"  # its row of server/fields.py
    prompt: Any = None
    logprobs: int | None = Field(None, description=f"OpenAI's legacy format: the chosen token's logprob and the "
                                 f"top 0..{MAX_COMPLETION_LOGPROBS} alternatives of each token")
    echo: bool = Field(False, description="the prompt before the completion in `text` (with `logprobs`: the "
                       "prompt tokens' too, the first one's null)")

    def check(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS} (top alternatives per "
                              f"token), got {self.logprobs}", "logprobs")
        self.check_common()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

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
            if len(p) > MAX_PROMPT_TOKENS:
                raise bad_request(f"`prompt` holds {len(p)} token ids; at most {MAX_PROMPT_TOKENS}", "prompt",
                                  "context_length_exceeded")
            return p
        if isinstance(p, list) and all(isinstance(t, (str, list)) for t in p):
            raise bad_request(f"`prompt` holds {len(p)} prompts; pdserve takes one prompt per request "
                              f"(send them as separate requests)", "prompt")
        raise bad_request(f"`prompt` must be a string or a list of token ids, got {show(p)}", "prompt",
                          "invalid_type")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

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
                          f"{{\"type\": \"text\", \"text\": ...}} parts, got {show(c)}",
                          f"messages.{index}.content", "invalid_type")


class ChatRequest(_Common):
    endpoint: ClassVar[str] = "chat"
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = Field(False, description="each generated token's logprob (choices[i].logprobs.content)")
    top_logprobs: int | None = Field(None, description=f"with `logprobs`: the 0..{MAX_LOGPROBS} most likely "
                                     "alternatives of each token too")
    add_generation_prompt: bool = Field(True, description="vLLM: the template ends with the assistant's turn")
    continue_final_message: bool = Field(False, description="vLLM: the last message stays open and the answer "
                                         "continues it (with add_generation_prompt false)")

    def template_options(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "add_special_tokens": bool(self.add_special_tokens)}

    def check(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("`continue_final_message` continues the last message, `add_generation_prompt` starts "
                              "a new one: set `add_generation_prompt` to false", "continue_final_message")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None:  # before the sampling bounds, which name it `logprobs`
            if not self.logprobs:
                raise bad_request("`top_logprobs` needs `logprobs: true`; set it, or leave `top_logprobs` out",
                                  "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"`top_logprobs` must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                                  "top_logprobs")
        self.check_common()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` (text) or chat `messages` (through the chat template), not both."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: the tokenizer's BOS/EOS, as /v1/completions adds them
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn, as chat requests do
    return_token_strs: bool = False

    def prompt_input(self) -> str | list[dict]:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either `prompt` (text) or `messages` (a chat), not both or neither",
                              "prompt" if self.prompt is not None else "messages", "missing_field")
        if self.prompt is not None:
            return self.prompt
        return ChatRequest(messages=self.messages).prompt_input()


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids -> text."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]

    def check(self) -> list[int]:
        if len(self.tokens) > MAX_PROMPT_TOKENS:
            raise bad_request(f"`tokens` holds {len(self.tokens)} ids; at most {MAX_PROMPT_TOKENS}", "tokens",
                              "context_length_exceeded")
        return self.tokens
