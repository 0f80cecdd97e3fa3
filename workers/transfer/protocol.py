"""Wire messages between a KV sender (prefill) and a KV receiver (decode): typed, msgpack, no pickle.

Sender -> receiver (DEALER -> ROUTER, one connection per worker pair):
    Hello       once per pair: protocol version, transport, host, KV layout
    Begin       a request's transfer starts: which reserved blocks it will fill
    Chunk       zmq transport only: header of one data frame (the bytes follow as the next frame)
    Done        "kv done": all bytes landed; carries the first sampled token
    Abort       the sender gave up on a request and writes no more into its blocks

Receiver -> sender:
    Welcome     handshake accepted: the receiver's layout and how to reach its pool (TransportInfo)
    Refused     handshake refused (version, transport, host or layout): `kind` says which
    Accept / Reject   answer to Begin: only after Accept does the sender write into the blocks
    Ack         answer to Done (ok, or why the receiver could not take the request any more)
    Cancel      the receiver stopped waiting (deadline, or the router gave up): stop writing, then Abort

NIXL notifications (sender agent -> receiver agent, through NIXL itself) carry an XferNote.
"""

from __future__ import annotations

import msgspec

from workers.engine.kv_cache import KVLayout

PROTOCOL_VERSION = 1


class Layout(msgspec.Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int

    @classmethod
    def of(cls, layout: KVLayout) -> "Layout":
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   layout.block_size, layout.num_blocks)

    def to_kv(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.block_size, self.num_blocks)


# ---- how to reach the receiver's pool, one struct per transport -------------------------------


class ShmInfo(msgspec.Struct, tag="shm"):
    """ipc on CPU: the pool is a /dev/shm file; map it with torch.from_file(shared=True)."""

    path: str
    nbytes: int


class CudaIpcInfo(msgspec.Struct, tag="cuda_ipc"):
    """ipc on GPU: the fields of torch's UntypedStorage._share_cuda_(), in its order."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class NixlInfo(msgspec.Struct, tag="nixl"):
    """nixl: the receiver agent's metadata and where its registered pool starts."""

    agent: str
    metadata: bytes
    base_addr: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"


class ZmqInfo(msgspec.Struct, tag="zmq"):
    """zmq: nothing beyond the socket itself."""


TransportInfo = ShmInfo | CudaIpcInfo | NixlInfo | ZmqInfo


# ---- control messages -----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    version: int
    transport: str
    host: str
    layout: Layout
    sender: str  # a name for logs and errors


class Welcome(msgspec.Struct, tag="welcome"):
    version: int
    host: str
    layout: Layout
    info: TransportInfo


class Refused(msgspec.Struct, tag="refused"):
    kind: str  # "version" | "transport" | "host" | "layout"
    error: str


class Begin(msgspec.Struct, tag="begin"):
    request_id: str
    dst_blocks: list[int]
    num_tokens: int


class Accept(msgspec.Struct, tag="accept"):
    request_id: str


class Reject(msgspec.Struct, tag="reject"):
    request_id: str
    error: str


class Chunk(msgspec.Struct, tag="chunk"):
    """Header of one zmq data frame: blocks dst_start..dst_start+num_blocks-1 of `layer`
    (-1: all layers at once, as [num_layers, num_blocks, ...])."""

    request_id: str
    layer: int
    dst_start: int
    num_blocks: int
    nbytes: int


class Done(msgspec.Struct, tag="done"):
    request_id: str
    first_token: int
    num_bytes: int
    started_at: float  # time.time() of the first copy issued
    finished_at: float  # time.time() when the last copy was seen complete
    writes: int  # nixl: transfers posted (each sends one XferNote); zmq: chunks sent


class Ack(msgspec.Struct, tag="ack"):
    request_id: str
    ok: bool
    error: str | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_id: str
    reason: str


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: str
    reason: str


class XferNote(msgspec.Struct, tag="note"):
    request_id: str
    seq: int


ToReceiver = Hello | Begin | Chunk | Done | Abort
ToSender = Welcome | Refused | Accept | Reject | Ack | Cancel

_encoder = msgspec.msgpack.Encoder()
_to_receiver = msgspec.msgpack.Decoder(ToReceiver)
_to_sender = msgspec.msgpack.Decoder(ToSender)
_note = msgspec.msgpack.Decoder(XferNote)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_receiver(data: bytes) -> ToReceiver:
    return _to_receiver.decode(data)


def decode_to_sender(data: bytes) -> ToSender:
    return _to_sender.decode(data)


def decode_note(data: bytes) -> XferNote:
    return _note.decode(data)
