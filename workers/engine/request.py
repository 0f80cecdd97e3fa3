"""A request's state inside one engine, and the sampling parameters it carries."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """Bad parameters; the message says which field and what is allowed."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, max_model_len: int | None = None, prompt_len: int = 0) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        # the last generated token is never fed back, so it needs no position of its own
        if max_model_len is not None and prompt_len + self.max_tokens - 1 > max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the model's "
                f"context of {max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise InvalidRequest(f"at most 16 stop strings, got {len(self.stop)}")
        return self


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""  # detokenized output so far (stop strings cut it)
    # incremental detokenization: output_ids[prefix_offset:read_offset] is the context that
    # the text of the next tokens is measured against
    prefix_offset: int = 0
    read_offset: int = 0
    # engine-side timeline, time.monotonic() seconds
    arrived: float = field(default_factory=time.monotonic)
    prefill_start: float | None = None
    prefill_end: float | None = None
    first_step_start: float | None = None  # first decode step (the one that makes token 2)
    first_step_end: float | None = None
    num_computed: int = 0  # tokens whose K/V sit in the cache
    return_logits: bool = False  # tests and the transfer check: StepOutput carries the logits
    # set when the request was adopted with its KV already in block_ids
    adopted: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens whose position exists: prompt + generated (the last one not yet in the cache)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
