"""Sampling parameters and their bounds, the one place they are defined.

`Sampling` is what a request asks of the sampler: the HTTP API (server/requests.py) takes its bounds
from the constants here, the wire carries it (control.Generate/Reserve/Prefill, each bound checked at
decode time), and the engine samples by it (workers/engine/request.py, SamplingParams, checks the
same bounds for requests that did not come over the wire).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdserve.protocol.wire import MAX_INT32, TokenId, TokenIds

MAX_SEED = 2**63 - 1  # the engine's generators take a signed 64-bit seed
# temperatures below this sample the top token with probability 1 to float32 precision; dividing
# logits by them overflows to inf (then NaN), so they are greedy (the same cut vLLM makes)
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range, 0..2
MAX_PENALTY = 2.0  # presence and frequency penalties: -2..2 (OpenAI)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty: (0, 2] (vLLM/HF: 1 is off, > 1 discourages repeats)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI chat: 0..20)
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 4096  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64  # bad_words per request, each a few token ids (MAX_BAD_WORD_TOKENS)
MAX_BAD_WORD_TOKENS = 32
MAX_BAD_WORDS_CHARS = 8192  # characters of a request's bad_words together (the router tokenizes each twice)
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range, -100..100
LOGPROB_FLOOR = -9999.0  # a logprob of -inf travels (and is shown) as this, as vLLM does: JSON has no -inf


class Sampling(msgspec.Struct, frozen=True):
    """What one request asks of the sampler, on the wire and in the engine (its SamplingParams). The
    annotations are the bounds, checked when a frame is decoded (and by checked()). Logprobs are of
    the model's raw distribution (before temperature, penalties, top-k/p), as vLLM reports them."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] = 0
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]], msgspec.Meta(max_length=MAX_STOP)] = []
    ignore_eos: bool = False
    presence_penalty: Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] = 0
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # per generated token: None off
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # per prompt token
    # vLLM's: tokens below min_p x the top token's probability are dropped before the draw (0: off)
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # vLLM's: only these token ids may be generated (empty: any)
    allowed_token_ids: TokenIds = []
    # vLLM's bad_words, tokenized by the router: a sequence's last token is banned wherever the output
    # ends with the tokens before it (a one-token word is banned everywhere)
    bad_words_ids: Annotated[list[Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]],
                             msgspec.Meta(max_length=MAX_BAD_WORDS * 2)] = []
    # OpenAI's logit_bias: {token id: -100..100} added to the logits before anything else
    logit_bias: Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-MAX_LOGIT_BIAS_VALUE,
                                                                       le=MAX_LOGIT_BIAS_VALUE)]],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    include_stop_str_in_output: bool = False  # vLLM's: a stop string (or stop token's text) stays in the text
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the output text

    @property
    def greedy(self) -> bool:
        """The top token, always (a temperature below MIN_TEMPERATURE would overflow the logits)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def masked(self) -> bool:
        """The sampler has to mask or bias this request's logits every step (allowed ids, bad words, bias)."""
        return bool(self.allowed_token_ids or self.bad_words_ids or self.logit_bias)

    @property
    def penalized(self) -> bool:
        """The sampler has to build this request's token counts (the common case skips them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, max_model_len: int | None = None, prompt_len: int = 0) -> "Sampling":
        """checked(), and that the prompt and max_tokens fit the model's context (the engine's check)."""
        self.checked()
        # the last generated token is never fed back, so it needs no position of its own
        if max_model_len is not None and prompt_len + self.max_tokens - 1 > max_model_len:
            raise InvalidSampling("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) "
                                  f"exceeds the model's context of {max_model_len} tokens; shorten the prompt or "
                                  "lower max_tokens")
        return self

    def checked(self) -> "Sampling":
        """This struct, after the checks a decoded frame passed already: for one built in code (the HTTP
        API's, the engine's own callers). Raises InvalidSampling naming the field and what it may hold."""
        try:
            msgspec.convert(msgspec.structs.asdict(self), Sampling)  # the bounds of the fields above
        except msgspec.ValidationError as e:
            name = str(e).rpartition("at `$.")[2].split("`")[0].split("[")[0]
            raise InvalidSampling(name, f"`{name}` must be {_allowed(name)}, got {_show(getattr(self, name, None))}") \
                from None
        if any(not s for s in self.stop):
            raise InvalidSampling("stop", "`stop` strings must not be empty")
        if self.min_tokens > self.max_tokens:
            raise InvalidSampling("min_tokens", f"`min_tokens` ({self.min_tokens}) must not exceed `max_tokens` "
                                  f"({self.max_tokens})")
        return self


class InvalidRequest(ValueError):
    """A request the engine cannot take (bad parameters, a prompt it cannot hold); the message says
    which field and what is allowed."""


class InvalidSampling(InvalidRequest):
    """A sampling parameter out of its bounds; `field` names it (the HTTP API's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# what a field means at its edges, beside its bounds in an error message
_NOTES = {"temperature": " (0 = greedy)", "top_k": " (0 = off)", "repetition_penalty": " (1 = off)",
          "presence_penalty": " (0 = off)", "frequency_penalty": " (0 = off)",
          "seed": " (0 .. 2**63-1)", "min_p": " (0 = off)"}


def _allowed(name: str) -> str:
    """A field's bounds in words, read off its annotation (so they are written once, above)."""
    kinds = {f.name: f.type for f in msgspec.inspect.type_info(Sampling).fields}
    t = kinds.get(name)
    if isinstance(t, msgspec.inspect.UnionType):  # X | None
        t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
    if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        kind = "an integer" if isinstance(t, msgspec.inspect.IntType) else "a number"
        low = f"[{_num(t.ge)}" if t.ge is not None else f"({_num(t.gt)}"
        return f"{kind} in {low}, {_num(t.le)}]{_NOTES.get(name, '')}"
    if isinstance(t, msgspec.inspect.ListType):
        item = t.item_type
        each = f" strings, each at most {item.max_length} characters" if isinstance(item, msgspec.inspect.StrType) \
            else f" integers, each in [{item.ge}, {item.le}]"
        return f"a list of at most {t.max_length}{each}"
    return f"a {getattr(t, '__class__', type(t)).__name__.removesuffix('Type').lower()}"


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
