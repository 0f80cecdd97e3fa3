"""A request's state inside one worker and its state ladder (its sampling parameters: protocol/sampling.py).

One owner: the engine's `requests` dict holds every request this worker knows, from the moment its
message is taken until it finishes; its `status` is the one record of where it stands, and it moves
only through the named methods below, each of which checks where it comes from (an illegal move
raises IllegalTransition naming the request and both states). Its timeline here is one record beside
it, Stamps (the engine's step stamps it through stamp_start/stamp_end at the bottom, the roles the
rest). Torch-free: testable alone.

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

# a request's sampling parameters are the wire's struct, defined once with their bounds (protocol/sampling.py)
from pdserve.protocol.sampling import InvalidRequest, Sampling as SamplingParams  # noqa: F401  (InvalidRequest: for callers)

PENDING = -1  # an output token chosen on the device and not yet read back (overlap.py)


class IllegalTransition(RuntimeError):
    """A request was asked to move along its ladder from a state that does not lead there (a bug in
    the caller's bookkeeping, not in the request)."""


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
    dst_blocks: list[int]  # its reserved blocks for our blocks from skip_tokens // block_size on (Prefill.dst_blocks)
    skip_tokens: int = 0  # leading prompt tokens whose KV it holds already (a multiple of the block size)


@dataclass
class Stamps:
    """When things happened to one request on this worker: time.monotonic() seconds of this process, None
    where its path here has no such moment. They go to the router by name (roles/base.py: P.Timeline),
    which subtracts one of them from another of the same worker, never from another process's: the
    phases of protocol/phases.py name the pairs. A new stamp is a field here and the line that sets it."""

    arrived: float = field(default_factory=time.monotonic)  # its message reached the worker's socket
    taken: float | None = None  # the worker's loop handled that message
    prefill_start: float | None = None
    prefill_end: float | None = None  # its prompt computed and token 1 sampled
    kv_delivered: float | None = None  # prefill: its KV in the decode worker's blocks, as this sender saw it
    kv_received: float | None = None  # decode: the KV receiver reported the KV in
    token1: float | None = None  # token 1 exists here: sampled at prefill end, or (decode) adopted with the KV
    token1_sent: float | None = None  # token 1's message handed to the router socket
    first_step_start: float | None = None  # first decode step (the one that makes token 2)
    first_step_end: float | None = None

    def named(self) -> dict[str, float]:
        """The stamps set, by name (the wire's Timeline.stamps)."""
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(eq=False)  # a request is itself, not its fields: queues find and remove it by identity
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    table_row: object | None = field(default=None, repr=False)  # step_inputs.block_row's NumPy mirror of block_ids
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
    stamps: Stamps = field(default_factory=Stamps)  # its timeline on this worker
    # the sampler's tensors for it (sampler.py: RowState: its bias and masks, penalty counts, generator),
    # built at its first token and kept: rebuilding a mask from Python ints each step cost 60k+ ids a step
    sampler_state: object | None = field(default=None, repr=False)

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


def decode_row(req: Request, n: int) -> bool:
    """(req, n) of a step is a decode row: one position of a request that has computed before (its last
    token's), not a prompt chunk."""
    return n == 1 and req.num_computed > 0


# ---- the engine's stamps: one pair for every way a step runs (synchronous, overlapped, prefill only) --


def stamp_start(work: list[tuple[Request, int]]) -> float:
    """Stamp a step's start on the requests whose prefill or first decode step it is (a token still on
    the device counts in output_ids: overlap.PENDING)."""
    start = time.monotonic()
    for r, _ in work:
        s = r.stamps
        if not r.output_ids:
            s.prefill_start = s.prefill_start or start
        elif len(r.output_ids) == 1 and s.first_step_start is None:
            s.first_step_start = start
    return start


def stamp_end(done: list[Request], start: float, end: float) -> None:
    """Stamp the end of the step that began at `start` on the requests it made a token for: token 1
    (the prefill is over; an adopted request's came with its KV) or token 2 (their first decode step)."""
    for r in done:
        s = r.stamps
        if s.prefill_end is None and not r.adopted:
            s.prefill_end = s.token1 = end
        elif s.first_step_start == start:
            s.first_step_end = end
