"""Wire messages between a KV sender (prefill) and a KV receiver (decode): typed, msgpack, no pickle.

Sender -> receiver (DEALER -> ROUTER, one connection per worker pair):
    Hello       once per pair: protocol version, transport, host, KV layout
    Begin       a request's transfer starts: which reserved blocks it will fill (nixl: `stage`, whether it
                asks for a staging grant)
    Chunk       zmq transport only: header of one data frame (the bytes follow as the next frame): the
                runs of blocks it holds, in their order (at most MAX_FRAME_RUNS)
    Done        "kv done": all bytes landed; carries the first sampled token
    Abort       the sender gave up on a request and writes no more into its blocks

Receiver -> sender:
    Welcome     handshake accepted: the receiver's layout and how to reach its pool (TransportInfo)
    Refused     handshake refused (version, transport, host or layout): `kind` says which
    Accept / Reject   answer to Begin: only after Accept does the sender write into the blocks (nixl: an
                Accept may carry a StagingGrant, bytes of the receiver's staging region for this request)
    Ack         answer to Done (ok, or why the receiver could not take the request any more)
    Cancel      the receiver stopped waiting (deadline, or the router gave up): stop writing, then Abort

NIXL notifications (sender agent -> receiver agent, through NIXL itself) carry an XferNote, or a StagedNote
for a write into the request's staging grant (workers/transfer/staging.py).

Every size, index and count is bounded at decode time (msgspec constraints: a frame outside them is a
decode error, answered like any unreadable frame); the receiver then checks each against its own
layout and the request's reservation (receiver.py), the sender each pool it is told to map (ipc.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pdserve.protocol.enums import Transport
# PROTOCOL_VERSION and encode: the KV side reads them through this module
from pdserve.protocol.wire import (MAX_COUNT, MAX_INT32, MAX_PROMPT_TOKENS, PROTOCOL_VERSION, BlockIds, Count, Id,  # noqa: F401
                                   Text, encode)


Small = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]  # layers, heads, head dim, block size
Name = Annotated[str, msgspec.Meta(max_length=256)]  # hosts, agent names, paths
Handle = Annotated[bytes, msgspec.Meta(max_length=256)]  # CUDA IPC handles (64 bytes in practice)


class Layout(msgspec.Struct, frozen=True):
    num_layers: Small
    num_kv_heads: Small
    head_dim: Small
    dtype: Literal["float32", "float16", "bfloat16"]  # the keys of kv_cache.DTYPES
    block_size: Small
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]

    @classmethod
    def of(cls, layout) -> "Layout":
        """From a layout with these fields (the worker's KVLayout; and back: KVLayout.from_wire)."""
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   layout.block_size, layout.num_blocks)



# ---- how to reach the receiver's pool, one struct per transport -------------------------------


class ShmInfo(msgspec.Struct, tag="shm"):
    """ipc on CPU: the pool is a /dev/shm file; map it with torch.from_file(shared=True)."""

    path: Name
    nbytes: Count


class CudaIpcInfo(msgspec.Struct, tag="cuda_ipc"):
    """ipc on GPU: the fields of torch's UntypedStorage._share_cuda_(), in its order."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    handle: Handle
    size_bytes: Count
    offset_bytes: Count
    ref_counter_handle: Handle
    ref_counter_offset: Count
    event_handle: Handle
    event_sync_required: bool


class NixlInfo(msgspec.Struct, tag="nixl"):
    """nixl: the receiver agent's metadata, where its registered pool starts, and its staging region (a second
    registered region on the pool's device, for fragmented requests; staging_bytes 0: none)."""

    agent: Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=16 << 20)]
    base_addr: Annotated[int, msgspec.Meta(ge=0)]  # up to 2**64 - 1 (msgpack)
    device_id: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    mem_type: Literal["DRAM", "VRAM"]
    staging_addr: Annotated[int, msgspec.Meta(ge=0)] = 0
    staging_bytes: Count = 0


class ZmqInfo(msgspec.Struct, tag="zmq"):
    """zmq: where the sender's data streams connect ("": this KV channel's own socket, CURVE with the
    deployment's keys; else the decode worker's --kv-plaintext port) and the secret token (sent over the
    authenticated channel) that ties each stream to this handshake."""

    data_address: Name = ""
    token: Handle = b""


TransportInfo = ShmInfo | CudaIpcInfo | NixlInfo | ZmqInfo


# ---- control messages -----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    version: int
    transport: Transport
    host: Name
    layout: Layout
    sender: Name  # a name for logs and errors


class Welcome(msgspec.Struct, tag="welcome"):
    version: int
    host: Name
    layout: Layout
    info: TransportInfo


class Refused(msgspec.Struct, tag="refused"):
    kind: Annotated[str, msgspec.Meta(max_length=32)]  # "version" | "transport" | "host" | "layout"
    error: Text


class Begin(msgspec.Struct, tag="begin"):
    request_id: Id
    dst_blocks: BlockIds
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
    stage: bool = False  # nixl: the request's runs are many and short; grant it staging space if there is room


class StagingGrant(msgspec.Struct, array_like=True, frozen=True):
    """Bytes offset..offset+nbytes-1 of the receiver's staging region (NixlInfo) are the request's until it
    ends: its blocks, layer-major, [layers, blocks, 2, block_size, heads, dim] in the order of dst_blocks."""

    offset: Count
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]


class Accept(msgspec.Struct, tag="accept"):
    request_id: Id
    staging: StagingGrant | None = None  # nixl, asked for and room: write through it; None: run by run


class Reject(msgspec.Struct, tag="reject"):
    request_id: Id
    error: Text


MAX_FRAME_RUNS = 512  # runs one data frame may name (a header of at most ~12 KiB)


class Run(msgspec.Struct, array_like=True, frozen=True):
    """Blocks dst_start..dst_start+num_blocks-1 of `layer`: a run of a zmq data frame ([l, d, n] on the wire)."""

    layer: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    dst_start: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]


class Chunk(msgspec.Struct, tag="chunk"):
    """Header of one zmq data frame: its bytes are the blocks of `runs`, one after the other in this order,
    each block [2, block_size, heads, dim]; nbytes = their blocks x the block's bytes."""

    request_id: Id
    runs: Annotated[list[Run], msgspec.Meta(min_length=1, max_length=MAX_FRAME_RUNS)]
    nbytes: Count


class Done(msgspec.Struct, tag="done"):
    request_id: Id
    first_token: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
    num_bytes: Count
    started_at: float  # time.time() of the first copy issued
    finished_at: float  # time.time() when the last copy was seen complete
    writes: Count  # nixl: transfers posted (each sends one XferNote); zmq: chunks sent
    # --kv-checksum: one 63-bit digest per destination block, in the reservation's order
    # (workers/transfer/integrity.py); empty without it
    checksums: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]],
                         msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] = []


class Ack(msgspec.Struct, tag="ack"):
    request_id: Id
    ok: bool
    error: Text | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_id: Id
    reason: Text


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: Id
    reason: Text


class XferNote(msgspec.Struct, tag="note"):
    request_id: Id
    seq: Count


class StagedNote(msgspec.Struct, tag="staged"):
    """A staged write landed: bytes offset..offset+nbytes-1 of the receiver's staging region hold whole layers
    of the request's grant; the receiver checks them against the grant, then scatters them into its blocks."""

    request_id: Id
    seq: Count
    offset: Count
    nbytes: Count


ToReceiver = Hello | Begin | Chunk | Done | Abort
ToSender = Welcome | Refused | Accept | Reject | Ack | Cancel

_to_receiver = msgspec.msgpack.Decoder(ToReceiver)
_to_sender = msgspec.msgpack.Decoder(ToSender)
_note = msgspec.msgpack.Decoder(XferNote | StagedNote)


def decode_to_receiver(data: bytes) -> ToReceiver:
    return _to_receiver.decode(data)


def decode_to_sender(data: bytes) -> ToSender:
    return _to_sender.decode(data)


def decode_note(data: bytes) -> XferNote | StagedNote:
    return _note.decode(data)
