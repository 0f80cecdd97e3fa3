"""Sampling parameters and their bounds, the one place they are defined.

`Sampling` is what a request asks of the sampler: the HTTP API (server/schemas.py) takes its bounds
from the constants here, the wire carries it (control.Generate/Reserve/Prefill, each bound checked at
decode time), and the engine samples by it (workers/engine/request.py, SamplingParams, checks the
same bounds for requests that did not come over the wire).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.wire import MAX_INT32, TokenId

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
LOGPROB_FLOOR = -9999.0  # a logprob of -inf travels (and is shown) as this, as vLLM does: JSON has no -inf


class Sampling(msgspec.Struct, frozen=True):
    """Sampling parameters on the wire (mirrors workers.engine.request.SamplingParams)."""

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

    def to_params(self):
        from workers.engine.request import SamplingParams

        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(max_tokens=self.max_tokens, temperature=temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop), ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                              stop_token_ids=list(self.stop_token_ids), logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs)
