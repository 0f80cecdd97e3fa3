"""A request as the router runs it: a Job goes in, Token and Done events come out.

    Job                             one sequence to generate: its id, prompt token ids, sampling, the
                                    policy it asked for, its clock (server/timeline.py)
    Token / Done                    what a plan's run yields: each token as it lands, then the end (finish
                                    reason, timings, every token id)
    fan_out(job, n)                 the n sequences of one request (`n` choices), each a Job of its own
    TokenStream(job, policy, metrics)
      .add(out, landed) -> Token    a worker's token as it reaches the router: the clock's stamps, TTFT and
                                    inter-token metrics
      .done(out, timings) -> Done
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import msgspec

from pdserve.protocol import control as P
from pdserve.protocol.enums import Policy
from pdserve.protocol.sampling import MAX_SEED, Sampling
from pdserve.protocol.timings import Timings
from pdserve.server.metrics import Metrics
from pdserve.server.timeline import Clock


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    policy: str | None  # as the request asked (None: the router's --policy); its plan resolves it
    clock: Clock = field(default_factory=Clock.start)
    auto: str | None = None  # policy auto: why its plan took the policy it did (timings.route.auto)


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str
    last: bool  # a Done follows at once (streaming puts both in one event)
    logprobs: P.TokenLogprobs | None = None  # when the request asked (Sampling.logprobs)
    prompt_logprobs: list[P.TokenLogprobs] | None = None  # token 1, when it asked (Sampling.prompt_logprobs)


@dataclass(frozen=True)
class Done:
    finish_reason: str
    timings: Timings
    token_ids: list[int]


def fan_out(job: Job, n: int) -> list[Job]:
    """The n sequences of one request: ids `<id>-<i>`, sequence i seeded with seed + i (wrapping within
    0..2**63-1) when a seed is given, so each choice differs and the whole is reproducible; prompt
    logprobs asked of sequence 0 only (the prompt is the same: Dispatcher.execute_all shares them)."""
    if n == 1:
        return [job]
    s = job.sampling

    def sampling(i: int) -> Sampling:
        out = s if s.seed is None else msgspec.structs.replace(s, seed=(s.seed + i) % (MAX_SEED + 1))
        return out if i == 0 or s.prompt_logprobs is None else msgspec.structs.replace(out, prompt_logprobs=None)

    return [Job(f"{job.request_id}-{i}", job.prompt_ids, sampling(i), job.policy, dataclasses.replace(job.clock))
            for i in range(n)]


class TokenStream:
    """Tokens of one request as they reach the router: stamps, inter-token latency, the last message."""

    def __init__(self, job: Job, policy: Policy, metrics: Metrics):
        self.job, self.policy, self.metrics = job, policy, metrics
        self.token_ids: list[int] = []
        self.last: P.TokenOut | None = None

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def add(self, out: P.TokenOut, landed: float) -> Token:
        """`landed`: when its message was read off the router's socket. Token 1's moment of handing
        to the response (the end of TTFT) is now: the caller yields the Token at once."""
        now = time.monotonic()
        clock = self.job.clock
        if clock.first_token is None:
            clock.token1_landed, clock.first_token = landed, now
            self.metrics.first_token(self.policy, len(self.job.prompt_ids))
        else:
            self.metrics.next_token(self.policy, now - clock.last_token)
        clock.last_token = now
        self.token_ids.append(out.token_id)
        self.last = out
        return Token(out.token_id, out.text, out.finished, out.logprobs, out.prompt_logprobs)

    def done(self, out: P.TokenOut, t: Timings) -> Done:
        return Done(out.finish_reason or "stop", t, list(self.token_ids))
