"""Every control-plane message between the router and the workers: typed structs, msgpack, one version.

Sockets (ZMQ, each side binds the one socket it receives on):
    router  PULL  --register endpoint    every worker -> router message
    worker  PULL  --control endpoint     every router -> worker message
    each side PUSHes to the other's endpoint (the router learns a worker's endpoint from Register)

Worker -> router
    Register      on start, and again whenever the router says it does not know us (RegisterAck ok=False)
    Heartbeat     every interval: free KV blocks, queue depth; the router drops a worker after 3 misses
    Goodbye       clean exit: the router stops routing to it at once
    Reserved      decode: blocks reserved for a request, and the KV receiver address to send them to
    PrefillDone   prefill: first token, prefill and transfer timings, bytes moved
    Tokens        colocated and decode: one step's new tokens (the last one of a request carries its timeline)
    RequestFailed any role: a request could not go on (kind says why); its blocks are already freed

Router -> worker
    RegisterAck   accepted (with the heartbeat interval to use) or refused (version or model mismatch)
    Generate      colocated: run this request to completion
    Reserve       decode: reserve blocks for the prompt's KV, wait for it until the deadline
    Prefill       prefill: prefill, push the KV into the decode worker's reserved blocks, report
    Connect       prefill: shake hands with a decode worker's KV receiver now, not in a request's TTFT
    Abort         forget a request: free its blocks, cancel its transfer; no-op if unknown

Never pickle: every frame is msgpack of one of the structs below, decoded against the union
of the direction it travels, so an unknown or malformed message is an error, not code to run.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 2  # 2: Timeline's inbox, pickup and emit stamps (the TTFT phases)
ROLES = ("prefill", "decode", "colocated")
# Register.transport and .mode take these (workers/transfer/base.py implements them; a test holds the
# two lists equal); here so the router, torch-free, can name them
TRANSPORTS = ("ipc", "nixl", "zmq")
MODES = ("bulk", "layer")


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol (or of this direction)."""


class Sampling(msgspec.Struct, frozen=True):
    """Sampling parameters on the wire (mirrors workers.engine.request.SamplingParams)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False

    def to_params(self):
        from workers.engine.request import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop), ignore_eos=self.ignore_eos)


class Timeline(msgspec.Struct, frozen=True):
    """Durations one worker measured on its own clock (ms); None where that worker did not do the part.
    The router turns them into the phases of workers/phases.py."""

    inbox_ms: float | None = None  # request in this worker's socket (inbox thread's stamp) -> the loop took it
    wait_ms: float | None = None  # the loop took it -> prefill start (queue on this worker)
    prefill_ms: float | None = None
    pickup_ms: float | None = None  # decode: the KV receiver reported the KV in -> adopt() returned token 1
    emit_ms: float | None = None  # token 1 made (prefill end, or adopt) -> its Tokens message sent
    first_step_ms: float | None = None  # the decode step that makes token 2


# ---- worker -> router ------------------------------------------------------------------------


class Register(msgspec.Struct, tag="register", frozen=True):
    version: int
    worker_id: str
    role: str
    address: str  # this worker's control endpoint (router PUSHes here)
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int  # blocks requests can get (the pool may hold a few more for the engine itself)
    free_blocks: int
    device: str
    dtype: str
    pid: int
    transport: str | None = None  # prefill and decode
    mode: str | None = None
    kv_address: str | None = None  # decode: where senders reach its KV receiver


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    worker_id: str
    address: str
    free_blocks: int
    queue_depth: int  # requests waiting on this worker (not yet running)
    running: int  # requests running (decoding) on this worker
    sent_at: float  # time.time()


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    worker_id: str
    reason: str


class Reserved(msgspec.Struct, tag="reserved", frozen=True):
    worker_id: str
    request_id: str
    block_ids: list[int]
    kv_address: str


class PrefillDone(msgspec.Struct, tag="prefill_done", frozen=True):
    worker_id: str
    request_id: str
    first_token: int
    timeline: Timeline
    transfer_ms: float  # first copy issued -> last copy complete (sender's clock)
    transfer_exposed_ms: float  # prefill end -> last copy complete (this worker's clock): what TTFT pays
    kv_bytes: int
    copies: int


class TokenOut(msgspec.Struct, frozen=True):
    request_id: str
    token_id: int
    text: str
    finished: bool = False
    finish_reason: str | None = None
    timeline: Timeline | None = None  # on the last token of a request


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    worker_id: str
    outputs: list[TokenOut]


FAILURE_KINDS = ("invalid", "capacity", "transfer", "timeout", "aborted", "internal")


class RequestFailed(msgspec.Struct, tag="request_failed", frozen=True):
    worker_id: str
    request_id: str
    kind: str  # one of FAILURE_KINDS
    error: str


# ---- router -> worker ------------------------------------------------------------------------


class RegisterAck(msgspec.Struct, tag="register_ack", frozen=True):
    version: int
    ok: bool
    heartbeat_interval_s: float = 1.0
    error: str | None = None
    retry: bool = False  # ok=False: True = register again (router restarted), False = refused, exit


class Generate(msgspec.Struct, tag="generate", frozen=True):
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    request_id: str
    prompt_ids: list[int]  # decode keeps the prompt to continue it (adopt)
    sampling: Sampling
    deadline_s: float  # from receipt: blocks come back if the KV has not landed by then


class Prefill(msgspec.Struct, tag="prefill", frozen=True):
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    decode_worker: str
    kv_address: str  # the decode worker's KV receiver
    dst_blocks: list[int]
    deadline_s: float  # from receipt: give up (and free the blocks) if not transferred by then


class Connect(msgspec.Struct, tag="connect", frozen=True):
    decode_worker: str
    kv_address: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str
    reason: str


ToRouter = Union[Register, Heartbeat, Goodbye, Reserved, PrefillDone, Tokens, RequestFailed]
ToWorker = Union[RegisterAck, Generate, Reserve, Prefill, Connect, Abort]

_encoder = msgspec.msgpack.Encoder()
_to_router = msgspec.msgpack.Decoder(ToRouter)
_to_worker = msgspec.msgpack.Decoder(ToWorker)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_router(frame: bytes) -> ToRouter:
    try:
        return _to_router.decode(frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad worker->router frame ({len(frame)} bytes): {e}; "
                            f"is the worker running pdserve protocol version {PROTOCOL_VERSION}?") from e


def decode_to_worker(frame: bytes) -> ToWorker:
    try:
        return _to_worker.decode(frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad router->worker frame ({len(frame)} bytes): {e}; "
                            f"is the router running pdserve protocol version {PROTOCOL_VERSION}?") from e
