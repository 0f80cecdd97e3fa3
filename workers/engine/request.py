"""A request's state inside one worker, its state ladder, and the sampling parameters it carries.

One owner: the engine's `requests` dict holds every request this worker knows, from the moment its
message is taken until it finishes; its `status` is the one record of where it stands, and it moves
only through the named methods below, each of which checks where it comes from (an illegal move
raises IllegalTransition naming the request and both states). Torch-free: testable alone.

The ladder, per role (each arrow is one named method below; every state but CANCELLING may also
finish(): an abort or a failure):

    colocated  WAITING -start_prefill-> PREFILLING -start_running-> RUNNING -finish-> FINISHED
    prefill    WAITING -start_prefill-> PREFILLING -start_sending-> SENDING -release-> FINISHED
    decode     WAITING -reserve-> RESERVED -start_receiving-> RECEIVING -start_running-> RUNNING -finish-> FINISHED
               RESERVED | RECEIVING -start_running-> RUNNING         (the KV landed; the Begin may go unseen)
               RESERVED | RECEIVING -release-> FINISHED              (the KV will not come)
               RESERVED | RECEIVING -cancel-> CANCELLING -release-> FINISHED   (aborted, a write in flight)
    preemption PREFILLING | RUNNING -preempt-> PREEMPTED -start_prefill-> PREFILLING   (colocated, decode)

    WAITING     no KV blocks yet; waits for its turn: the scheduler's (colocated), the prefill queue's
                (prefill worker), or room to reserve (decode worker)
    PREFILLING  blocks for its prompt; prompt positions being computed, in one step or over several chunks
    SENDING     prefill worker: prompt done, token 1 sampled; its KV is moving to a decode worker's blocks,
                ours are held until release()
    RESERVED    decode worker: blocks reserved for its prompt's KV, the sender has not begun
    RECEIVING   decode worker: the sender began writing into those blocks
    CANCELLING  decode worker: aborted while a write may still land; blocks held until the KV receiver
                says none can, then release()
    RUNNING     decoding, a token a step
    PREEMPTED   its blocks went back to make room; waits at the scheduler's front to be recomputed
    FINISHED    blocks freed, gone from the engine's dict; finish_reason says why (error: `error` says what)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

SEED_LIMIT = 2**63  # seeds are 0 .. 2**63 - 1 (what msgpack and the HTTP API carry as a signed int64)


class InvalidRequest(ValueError):
    """Bad parameters; the message says which field and what is allowed."""


class IllegalTransition(RuntimeError):
    """A request was asked to move along its ladder from a state that does not lead there (a bug in
    the caller's bookkeeping, not in the request)."""


@dataclass
class SamplingParams:
    """What one request asks of the sampler. The bounds are protocol/control.py's (one place for the
    HTTP API, the wire and here). Logprobs are of the model's raw distribution (before temperature,
    penalties, top-k/p), as vLLM reports them by default."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often each token was generated
    repetition_penalty: float = 1.0  # vLLM/HF: tokens of the prompt or the output, logit / r if > 0 else * r
    min_tokens: int = 0  # EOS and stop_token_ids masked, stop strings not checked, until this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # sampling one of these stops ("stop")
    logprobs: int | None = None  # each generated token's logprob and this many top alternatives; None: off
    prompt_logprobs: int | None = None  # the same for each prompt token (from the prefill's logits)

    @property
    def penalized(self) -> bool:
        """The sampler has to build this request's token counts (the common case skips them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, max_model_len: int | None = None, prompt_len: int = 0) -> "SamplingParams":
        from protocol import sampling as bounds

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        # the last generated token is never fed back, so it needs no position of its own
        if max_model_len is not None and prompt_len + self.max_tokens - 1 > max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the model's "
                f"context of {max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        if not (0.0 <= self.temperature <= bounds.MAX_TEMPERATURE):
            raise InvalidRequest(f"temperature must be in [0, {bounds.MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT):
            raise InvalidRequest(f"seed must be an integer in 0..2**63-1, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings")
        if len(self.stop) > bounds.MAX_STOP:
            raise InvalidRequest(f"at most {bounds.MAX_STOP} stop strings, got {len(self.stop)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -bounds.MAX_PENALTY <= getattr(self, name) <= bounds.MAX_PENALTY:
                raise InvalidRequest(f"{name} must be in [-{bounds.MAX_PENALTY:g}, {bounds.MAX_PENALTY:g}], "
                                     f"got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= bounds.MAX_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be in (0, {bounds.MAX_REPETITION_PENALTY:g}] (1 is off), "
                                 f"got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), "
                                 f"got {self.min_tokens!r}")
        if len(self.stop_token_ids) > bounds.MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {bounds.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= bounds.MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer from 0 to {bounds.MAX_LOGPROBS} (or unset), got {k!r}")
        return self


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    SENDING = "sending"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    CANCELLING = "cancelling"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


S = Status
# what each named move may start from (the whole ladder, in one place)
MOVES: dict[str, tuple[Status, frozenset[Status]]] = {
    "start_prefill": (S.PREFILLING, frozenset({S.WAITING, S.PREEMPTED})),
    "start_sending": (S.SENDING, frozenset({S.PREFILLING})),
    "reserve": (S.RESERVED, frozenset({S.WAITING})),
    "start_receiving": (S.RECEIVING, frozenset({S.RESERVED})),
    "start_running": (S.RUNNING, frozenset({S.PREFILLING, S.RESERVED, S.RECEIVING})),
    "preempt": (S.PREEMPTED, frozenset({S.PREFILLING, S.RUNNING})),
    "cancel": (S.CANCELLING, frozenset({S.RESERVED, S.RECEIVING})),
    # abort or failure: anywhere but CANCELLING, whose blocks a late write may still reach
    "finish": (S.FINISHED, frozenset(Status) - {S.FINISHED, S.CANCELLING}),
    # the blocks held for a transfer go back: it is over (sent, failed, or the receiver let go)
    "release": (S.FINISHED, frozenset({S.SENDING, S.RESERVED, S.RECEIVING, S.CANCELLING})),
}


@dataclass(frozen=True)
class KVTarget:
    """Prefill worker: where a request's KV goes (the decode worker's reserved blocks)."""

    worker_id: str
    address: str  # that worker's KV receiver
    block_ids: list[int]  # its reserved blocks for our blocks from skip_tokens // block_size on
    skip_tokens: int = 0  # leading prompt tokens whose KV it holds already (a multiple of the block size)


@dataclass(eq=False)  # a request is itself, not its fields: queues find and remove it by identity
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING  # moved only by the methods below
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "sent" (prefill worker)
    error: str | None = None  # finish_reason "error": what failed, naming the request
    text: str = ""  # detokenized output so far (stop strings cut it)
    # incremental detokenization: output_ids[prefix_offset:read_offset] is the context that
    # the text of the next tokens is measured against
    prefix_offset: int = 0
    read_offset: int = 0
    num_computed: int = 0  # tokens whose K/V sit in the cache
    return_logits: bool = False  # tests and the transfer check: StepOutput carries the logits
    prompt_logprobs: list = field(default_factory=list)  # [P.TokenLogprobs] of prompt tokens 1.., when asked
    first_logprobs: object | None = None  # P.TokenLogprobs of token 1, when asked (a prefill worker reports it)
    adopted: bool = False  # decode worker: its prompt KV came from a prefill worker
    deadline: float | None = None  # time.monotonic(): past it, this worker stops waiting on its behalf
    send_to: KVTarget | None = None  # prefill worker: where its KV goes
    # prefix cache (prefix_cache.py): names of its full blocks, how many of block_ids are named there,
    # and how many prompt tokens came from KV this worker already held (not computed for it)
    block_names: list[bytes] = field(default_factory=list, repr=False)
    named_blocks: int = 0
    cached_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of those, reloaded per tier ("host", "disk")
    reload_s: float | None = None  # how long those reloads took
    # timeline, time.monotonic() seconds of this process; the roles turn it into P.Timeline
    arrived: float = field(default_factory=time.monotonic)  # its message reached the worker's socket
    taken: float | None = None  # the worker's loop handled that message
    prefill_start: float | None = None
    prefill_end: float | None = None
    landed: float | None = None  # decode: the KV receiver reported the KV in
    adopted_at: float | None = None  # decode: adopt() returned token 1
    token1_sent: float | None = None  # token 1's message handed to the router socket
    first_step_start: float | None = None  # first decode step (the one that makes token 2)
    first_step_end: float | None = None

    # ---- the ladder ----------------------------------------------------------------------------

    def start_prefill(self) -> None:
        self._move("start_prefill")

    def start_sending(self) -> None:
        self._move("start_sending")

    def reserve(self) -> None:
        self._move("reserve")

    def start_receiving(self) -> None:
        self._move("start_receiving")

    def start_running(self) -> None:
        self._move("start_running")

    def preempt(self) -> None:
        self._move("preempt")

    def cancel(self) -> None:
        self._move("cancel")

    def finish(self, reason: str, error: str | None = None) -> None:
        self._move("finish")
        self.finish_reason, self.error = reason, error

    def release(self) -> None:
        reason = "sent" if self.status is Status.SENDING else "abort"
        self._move("release")
        self.finish_reason = reason

    def take_over(self, bare: "Request") -> None:
        """Stand in for the bare reservation made under this id before the request itself was
        known (Engine.reserve(id, n), then adopt(request)): its blocks and its state."""
        if self.status is not Status.WAITING or bare.request_id != self.request_id:
            raise IllegalTransition(f"request {self.request_id} ({self.status.value}) cannot take over the "
                                    f"reservation of {bare.request_id}; pass a new Request with its id")
        self.block_ids, self.status = bare.block_ids, bare.status
        bare.block_ids = []

    def _move(self, name: str) -> None:
        to, sources = MOVES[name]
        if self.status not in sources:
            allowed = ", ".join(sorted(s.value for s in sources))
            raise IllegalTransition(f"request {self.request_id}: cannot {name.replace('_', ' ')} while "
                                    f"{self.status.value} (to {to.value} only from: {allowed})")
        self.status = to

    # ---- tokens --------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens whose position exists: prompt + generated (the last one not yet in the cache)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a chunk of a long prompt, every step)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
