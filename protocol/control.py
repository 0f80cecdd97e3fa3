"""Every control-plane message between the router and the workers: typed structs, msgpack, one version.

Sockets (ZMQ, each side binds the one socket it receives on):
    router  PULL  --register endpoint    every worker -> router message
    worker  PULL  --control endpoint     every router -> worker message
    each side PUSHes to the other's endpoint (the router learns a worker's endpoint from Register)

Worker -> router
    Register      on start, and again whenever the router says it does not know us (RegisterAck ok=False)
    Heartbeat     every interval: free KV blocks, queue depth; the router drops a worker after 3 misses
    KVEvents      block names its KV tiers gained and lost (bounded; after a heartbeat, when any changed)
    Goodbye       clean exit: the router stops routing to it at once
    Reserved      decode: blocks reserved for a request, and the KV receiver address to send them to
    PrefillDone   prefill: first token (its logprobs and the prompt's, when asked), prefill and transfer
                  timings, bytes moved
    Tokens        colocated and decode: one step's new tokens, with their logprobs when asked (the last one of
                  a request carries its timeline)
    RequestFailed any role: a request could not go on (kind says why); its blocks are already freed

Router -> worker
    RegisterAck   accepted (with the heartbeat interval to use), refused (version or model mismatch: exit),
                  or retry (the router does not know this incarnation, or another live one holds the id)
    Generate      colocated: run this request to completion
    Reserve       decode: reserve blocks for the prompt's KV, wait for it until the deadline
    Prefill       prefill: prefill, push the KV into the decode worker's reserved blocks, report
    Connect       prefill: shake hands with a decode worker's KV receiver now, not in a request's TTFT
    Abort         forget a request: free its blocks, cancel its transfer; no-op if unknown

Never pickle: every frame is msgpack of one of the structs below, decoded against the union
of the direction it travels, so an unknown or malformed message is an error, not code to run.
Every number and list is bounded at decode time (msgspec constraints): a value torch or the
engine could not take is refused with the frame, before any code sees it.

Identity: each worker process draws a random incarnation id when it starts. Every frame travels in
an envelope that carries it: FromWorker(incarnation, message) to the router, FromRouter(incarnation
of the addressee, message) to a worker. The router accepts a worker's messages only under the
incarnation that registered its id, and refuses a Register for an id a live incarnation holds;
a worker drops anything addressed to another incarnation. (The sockets themselves are CURVE,
protocol/auth.py: only the router's key reaches a worker's control socket.)
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

import msgspec

from pdserve.protocol.blocks import NAME_BYTES
from pdserve.protocol.enums import TIERS, FailureKind, Mode, Role, Transport
from pdserve.protocol.sampling import LOGPROB_FLOOR, MAX_LOGPROBS, Sampling
# PROTOCOL_VERSION, ProtocolError and encode: the control side reads them through this module
from pdserve.protocol.wire import (MAX_INT32, MAX_PROMPT_TOKENS, PROTOCOL_VERSION, Address, BlockIds, Count, Id,  # noqa: F401
                                   ProtocolError, Seconds, Text, TokenId, TokenIds, encode, short)

def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold num_tokens (at least one); the router counts a reservation as the engine's pool does."""
    return max(1, math.ceil(num_tokens / block_size))


Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
BlockName = Annotated[bytes, msgspec.Meta(min_length=NAME_BYTES, max_length=NAME_BYTES)]
# a KV tier below a worker's own pool (protocol.enums.Tier: the one list); every per-tier figure is keyed by it
TierName = Literal[TIERS]
KVTier = Literal[("gpu", *TIERS)]  # where a block name is held; "gpu": the worker's own KV pool (a GPU or the CPU)
PerTier = msgspec.Meta(max_length=len(TIERS))  # a dict keyed by TierName holds one entry per tier at most
MAX_KV_NAMES = 4096  # block names in one KVEvents (64 KiB of names): more wait for the next one


Logprob = Annotated[float, msgspec.Meta(ge=LOGPROB_FLOOR, le=0.0)]


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position's log-probabilities (natural log, of the model's raw distribution: before
    temperature, penalties, top-k/p), what OpenAI's `logprobs` report."""

    logprob: Logprob  # of the token at this position (the one sampled, or the prompt's)
    top_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LOGPROBS)] = []  # most likely first
    top_logprobs: Annotated[list[Logprob], msgspec.Meta(max_length=MAX_LOGPROBS)] = []


# a prompt's logprobs: one per prompt token after the first (which nothing predicts)
PromptLogprobs = Annotated[list[TokenLogprobs], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]


StampName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Stamp = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]  # time.monotonic() seconds


class Timeline(msgspec.Struct, frozen=True):
    """What one worker measured of a request: its stamps by name (workers/engine/request.py's Stamps:
    time.monotonic() seconds of that worker's clock; those it did not set are absent). The router subtracts
    a stamp only from another of the same worker (the pairs are the phases of protocol/phases.py), so the
    hosts' clocks need not agree."""

    stamps: Annotated[dict[StampName, Stamp], msgspec.Meta(max_length=32)] = {}
    cached_tokens: Count | None = None  # prompt tokens whose KV this worker reused (its prefix cache)
    tier_tokens: Annotated[dict[TierName, Count], PerTier] = {}  # ... of them, reloaded from each tier below the pool
    reload_ms: float | None = None  # how long those reloads took


# ---- worker -> router ------------------------------------------------------------------------


class Register(msgspec.Struct, tag="register", frozen=True):
    version: int
    worker_id: Id
    role: Role
    address: Address  # this worker's control endpoint (router PUSHes here)
    model: Address
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    num_blocks: Count  # blocks requests can get (the pool may hold a few more for the engine itself)
    free_blocks: Count
    device: Annotated[str, msgspec.Meta(max_length=64)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    pid: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
    transport: Transport | None = None  # prefill and decode
    mode: Mode | None = None
    kv_address: Address | None = None  # decode: where senders reach its KV receiver
    block_root: BlockName | None = None  # the parent name of its first blocks (protocol/blocks.py)


class TierFigures(msgspec.Struct, frozen=True):
    """One KV tier below the GPU pool on one worker (bytes; the *_bytes totals are cumulative)."""

    usage_bytes: Count = 0  # held now
    capacity_bytes: Count = 0
    offload_bytes: Count = 0  # written into it
    reload_bytes: Count = 0  # read back from it into the GPU pool


class CacheFigures(msgspec.Struct, frozen=True):
    """The prefix cache on one worker, cumulative since the process started (a lost heartbeat loses
    nothing): prompt tokens looked up, and of those, found in each tier."""

    queried_tokens: Count = 0
    gpu_hit_tokens: Count = 0
    tier_hit_tokens: Annotated[dict[TierName, Count], PerTier] = {}  # reloaded from each tier below the pool
    tiers: Annotated[dict[TierName, TierFigures], PerTier] = {}  # the tiers below the pool this worker has

    def hit_tokens(self) -> int:
        """Prompt tokens found in any tier (not recomputed)."""
        return self.gpu_hit_tokens + sum(self.tier_hit_tokens.values())

    def as_stats(self) -> dict:
        """The shape server/metrics.py's observe_kv_tiers() takes."""
        tiers = {name: msgspec.structs.asdict(t) for name, t in self.tiers.items()}
        # "device": the worker's own KV pool, on a GPU or the CPU (timings.reused_tokens names it so too)
        hits = {"device": self.gpu_hit_tokens, **{t: n for t, n in self.tier_hit_tokens.items() if t in tiers}}
        return {"prefix_cache_queries": self.queried_tokens, "prefix_cache_hits": hits, "tiers": tiers}


class FaultFigures(msgspec.Struct, frozen=True):
    """A decode worker's fences and integrity checks (its KV receiver), cumulative since it started."""

    fenced_waits: Count = 0  # transfers given up on whose blocks waited for the sender's fence
    fenced_blocks: Count = 0  # blocks held by a fence now
    integrity_failures: Count = 0  # arrivals refused: a block differed from the sender's checksum


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    worker_id: Id
    address: Address
    free_blocks: Count
    queue_depth: Count  # requests waiting on this worker (not yet running)
    running: Count  # requests running (decoding) on this worker
    sent_at: float  # time.time()
    cache: CacheFigures | None = None  # its prefix cache and KV tiers
    faults: FaultFigures | None = None  # decode workers: fences and integrity checks
    costs: KVCosts | None = None  # what prices a request here (KV-aware routing)


class KVCosts(msgspec.Struct, frozen=True):
    """What a worker measured that prices a request there (server/kv_route.py): its prefill speed, each
    tier's reload bandwidth, the KV bytes per token, and the prompt tokens waiting to be prefilled."""

    bytes_per_token: Count = 0
    prefill_ms_per_token: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] | None = None  # None: none measured yet
    prefill_ms_fixed: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # what any prefill costs besides
    # GB/s each tier below the pool reloads at, as measured (a tier not measured yet is absent)
    tier_gbps: Annotated[dict[TierName, Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]], PerTier] = {}
    queued_tokens: Count = 0


class TierNames(msgspec.Struct, frozen=True, array_like=True):
    tier: KVTier
    names: Annotated[list[BlockName], msgspec.Meta(max_length=MAX_KV_NAMES)]


class KVEvents(msgspec.Struct, tag="kv_events", frozen=True):
    """Block names a worker's tiers gained and lost since its last KVEvents (server/kv_index.py keeps
    them). `seq` counts from 0 per incarnation: a gap means some were lost (the router forgets this
    worker's names: misses, never wrong answers); `reset`: forget what it reported before, a full
    report follows (the first of an incarnation, and a periodic resync)."""

    worker_id: Id
    seq: Count
    reset: bool = False
    stored: Annotated[list[TierNames], msgspec.Meta(max_length=1 + len(TIERS))] = []
    removed: Annotated[list[TierNames], msgspec.Meta(max_length=1 + len(TIERS))] = []


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    worker_id: Id
    reason: Text


class Reserved(msgspec.Struct, tag="reserved", frozen=True):
    worker_id: Id
    request_id: Id
    dst_blocks: BlockIds  # the blocks a transfer fills (Prefill.dst_blocks): those after the cached_tokens held here
    kv_address: Address
    cached_tokens: Count = 0  # leading prompt tokens whose KV is already here (its prefix cache)


class PrefillDone(msgspec.Struct, tag="prefill_done", frozen=True):
    worker_id: Id
    request_id: Id
    first_token: TokenId
    timeline: Timeline
    transfer_ms: float  # first copy issued -> last copy complete (sender's clock)
    kv_bytes: Count
    copies: Count
    first_logprobs: TokenLogprobs | None = None  # token 1's, when the request asked (Sampling.logprobs)
    prompt_logprobs: PromptLogprobs | None = None  # when it asked (Sampling.prompt_logprobs)


class TokenOut(msgspec.Struct, frozen=True):
    request_id: Id
    token_id: TokenId
    text: Text
    finished: bool = False
    finish_reason: Annotated[str, msgspec.Meta(max_length=32)] | None = None
    timeline: Timeline | None = None  # on the last token of a request
    logprobs: TokenLogprobs | None = None  # when the request asked (None for token 1 of a disaggregated
    # request on its decode worker: PrefillDone carries it)
    prompt_logprobs: PromptLogprobs | None = None  # colocated, with token 1, when the request asked


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    worker_id: Id
    outputs: Annotated[list[TokenOut], msgspec.Meta(max_length=1 << 16)]


class RequestFailed(msgspec.Struct, tag="request_failed", frozen=True):
    worker_id: Id
    request_id: Id
    kind: FailureKind
    error: Text


# ---- router -> worker ------------------------------------------------------------------------


class RegisterAck(msgspec.Struct, tag="register_ack", frozen=True):
    version: int
    ok: bool
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 1.0
    error: Text | None = None
    retry: bool = False  # ok=False: True = register again (router restarted, id busy), False = refused, exit


class Generate(msgspec.Struct, tag="generate", frozen=True):
    request_id: Id
    prompt_ids: TokenIds
    sampling: Sampling


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    request_id: Id
    prompt_ids: TokenIds  # decode keeps the prompt to continue it (adopt)
    sampling: Sampling
    deadline_s: Seconds  # from receipt: blocks come back if the KV has not landed by then


class Prefill(msgspec.Struct, tag="prefill", frozen=True):
    request_id: Id
    prompt_ids: TokenIds
    sampling: Sampling
    decode_worker: Id
    kv_address: Address  # the decode worker's KV receiver
    dst_blocks: BlockIds  # for our blocks from skip_tokens // block_size on
    deadline_s: Seconds  # from receipt: give up (and free the blocks) if not transferred by then
    skip_tokens: Count = 0  # leading prompt tokens the decode worker holds already: not sent


class Connect(msgspec.Struct, tag="connect", frozen=True):
    decode_worker: Id
    kv_address: Address


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: Id
    reason: Text


ToRouter = Union[Register, Heartbeat, KVEvents, Goodbye, Reserved, PrefillDone, Tokens, RequestFailed]
ToWorker = Union[RegisterAck, Generate, Reserve, Prefill, Connect, Abort]


# ---- envelopes: every frame, each direction ------------------------------------------------------


class FromWorker(msgspec.Struct, frozen=True):
    incarnation: Incarnation  # the sending process's, drawn at its start
    msg: ToRouter


class FromRouter(msgspec.Struct, frozen=True):
    incarnation: Incarnation  # the addressee's: a worker drops frames meant for another process
    msg: ToWorker


_to_router = msgspec.msgpack.Decoder(FromWorker)
_to_worker = msgspec.msgpack.Decoder(FromRouter)


def from_worker(incarnation: str, msg: ToRouter) -> bytes:
    return encode(FromWorker(incarnation, msg))


def from_router(incarnation: str, msg: ToWorker) -> bytes:
    return encode(FromRouter(incarnation, msg))


def decode_to_router(frame: bytes) -> FromWorker:
    try:
        return _to_router.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError (a bound, a type) is one too
        raise ProtocolError(f"bad worker->router frame ({len(frame)} bytes): {short(e)}; "
                            f"is the worker running pdserve protocol version {PROTOCOL_VERSION}?") from None


def decode_to_worker(frame: bytes) -> FromRouter:
    try:
        return _to_worker.decode(frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad router->worker frame ({len(frame)} bytes): {short(e)}; "
                            f"is the router running pdserve protocol version {PROTOCOL_VERSION}?") from None
