"""Moving one request's KV cache from a prefill worker's pool into blocks a decode worker reserved.

Decode side (receiver), one per decode worker, made once at start:
    registry.make_receiver(kv, cfg)         bind the endpoint senders reach; register/export the pool once
    .address                                the endpoint (e.g. tcp://10.0.0.2:7300) to give to senders
    .expect(request_id, dst_blocks, deadline_s)  blocks are reserved and wait for this request's KV
    .poll() -> list[Arrival]                transfers that landed, failed or missed their deadline (non-blocking);
                                            free the blocks of every Arrival with ok=False and released=True;
                                            released=False: fail the request, keep its blocks (fenced) until
                                            the Arrival(released=True) that follows
    .began() -> list[str]                   requests whose sender began writing since the last call
    .cancel(request_id)                     stop waiting (router gave up); an Arrival(ok=False) follows once
                                            no write can land any more: free the blocks then, not before
    .close()

Prefill side (sender), one per prefill worker:
    registry.make_sender(kv, cfg)
    .connect(peer, deadline_s)              optional: the handshake with `peer` now (version + layout +
                                            transport metadata; maps or registers its pool), not on first open
    .reach(peer, fresh=False) -> (PeerState, why)   the same without waiting: READY, CONNECTING or DEAD
                                            (a failed handshake or a disconnect; requests to it fail at once)
    .open(request_id, peer, src_blocks, dst_blocks, num_tokens) -> Transfer
                                            handshake on first use; then returns at once, the Begin (tells the
                                            receiver the transfer starts) goes out on the sender's I/O thread
    Transfer.layer_done(layer)              layer mode: that layer's K/V are in the pool (on GPU: enqueued on
                                            the current stream); start moving it, return at once. Bulk: no-op
    Transfer.finish(first_token, deadline_s) -> TransferStats
                                            move what is left, wait for it, tell the receiver "kv done", wait
                                            for its ack; raises TransferError (then free the source blocks)
    Transfer.start_finish(first_token, deadline_s); .poll() -> TransferStats | None
                                            finish() without waiting (the prefill worker's loop): poll() raises
                                            TransferError as finish() would
    Transfer.abort(reason)                  give up; the receiver is told
    .close()

States of a transfer (TransferState, MOVES): OPENED -> TRANSFERRING -> LANDING -> ACKING -> DONE, or
ABORTING -> FAILED (or FAILED at once) from any of the first four. The receiver accepts a transfer
(answer to the sender's Begin) before any byte is written into its blocks, and a request it
gave up on is refused, so a late sender never writes into blocks that went back to the pool.
Fenced reuse: a block an accepted transfer may still write into goes back only after the
sender's Done or Abort (sent once none of its writes can land), or the sender's death confirmed;
per transport in docs/design-fencing.md.
Every wait has a deadline; NIXL, CUDA and ZMQ have none of their own. A failure raises
TransferError naming the request, the peer and what to check.

This module holds the interface only (what the roles call, what they get back). make_sender and
make_receiver: registry.py; the errors: errors.py; the wire messages: protocol/kv.py; the shared
plumbing (sockets, handshake, deadlines) every transport builds on: sender.py (with peers.py and
sender_transfer.py), receiver.py.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.settings.worker import TransferConfig
    from pdserve.workers.engine.kv_cache import KVCache


class PeerState(enum.Enum):
    READY = "ready"
    CONNECTING = "connecting"
    DEAD = "dead"


class TransferState(enum.Enum):
    """A transfer's ladder on the prefill side; MOVES has every legal step."""

    OPENED = "opened"  # the Begin is on its way; layers handed over wait for the receiver's Accept
    TRANSFERRING = "transferring"  # accepted: writes go out as their layers are ready
    LANDING = "landing"  # finish: every layer handed over; waiting until every byte landed
    ACKING = "acking"  # the Done went out; waiting for the receiver's Ack
    DONE = "done"
    ABORTING = "aborting"  # failed; the receiver gets an Abort once none of our writes can still land
    FAILED = "failed"  # failed; nothing more to tell the receiver


# not over yet: a failure still counts
LIVE = frozenset({TransferState.OPENED, TransferState.TRANSFERRING, TransferState.LANDING,
                  TransferState.ACKING})
# accepted and not over: queued writes may go out (in ACKING only a test's held ones, fake.py)
WRITING = frozenset({TransferState.TRANSFERRING, TransferState.LANDING, TransferState.ACKING})
# each named move: where it leads, and the states it may start from (the whole ladder, in one place)
MOVES: dict[str, tuple[TransferState, frozenset[TransferState]]] = {
    # I/O thread: the receiver's Accept
    "accept": (TransferState.TRANSFERRING, frozenset({TransferState.OPENED})),
    # poll(), finishing: the last layers handed over to the transport
    "land": (TransferState.LANDING, frozenset({TransferState.TRANSFERRING})),
    # poll(): every byte landed; the Done goes out
    "send_done": (TransferState.ACKING, frozenset({TransferState.LANDING})),
    # I/O thread: the receiver's Ack
    "acked": (TransferState.DONE, frozenset({TransferState.ACKING})),
    # a failure the receiver must hear of: its Abort waits until none of our writes can land
    "fail": (TransferState.ABORTING, LIVE),
    # a failure the receiver knows of (it refused), or the receiver is gone
    "fail_quietly": (TransferState.FAILED, LIVE),
    # I/O thread: the Abort went out
    "aborted": (TransferState.FAILED, frozenset({TransferState.ABORTING})),
}


@dataclass
class Arrival:
    """What the receiver reports for one expected request."""

    request_id: str
    ok: bool
    first_token: int = -1
    error: str | None = None
    num_bytes: int = 0
    # Sender-side wall-clock (time.time()) of the first byte leaving and the last landing.
    started_at: float = 0.0
    finished_at: float = 0.0
    reported_at: float | None = None  # receiver's time.monotonic() when it reported this (its I/O thread)
    # ok=False only: True when no write into the request's blocks can land any more (free them now);
    # False when the request failed but its blocks stay fenced: an Arrival(released=True) follows
    released: bool = True


@dataclass
class TransferStats:
    num_bytes: int
    started_at: float  # time.time() when the first copy was issued
    finished_at: float  # time.time() when the last copy was complete
    copies: int  # copy calls or descriptors issued
    layers_sent_before_finish: int = 0  # layer mode: layers already moving when finish() was called
    runs: int = 0  # contiguous runs of blocks the plan moved
    # ipc on GPU: a CUDA event recorded after the last copy; with one recorded at prefill end it gives
    # the exposed transfer on the GPU's own clock (None elsewhere)
    done_event: object | None = None
    # ipc on GPU: a CUDA event recorded on the side stream once it waited for the KV, before the first copy;
    # with done_event it times the copies alone on the GPU's clock (the host's issuing and polling left out)
    start_event: object | None = None
    ucx_lane: dict | None = None  # nixl: the UCX lane the writes took (ucx_log.py), or why it is unknown


class Transfer(ABC):
    request_id: str
    peer: str
    state: TransferState

    @abstractmethod
    def layer_done(self, layer: int) -> None: ...

    @abstractmethod
    def finish(self, first_token: int, deadline_s: float | None = None) -> TransferStats: ...

    @abstractmethod
    def start_finish(self, first_token: int, deadline_s: float | None = None) -> None: ...

    @abstractmethod
    def poll(self) -> TransferStats | None: ...

    @abstractmethod
    def abort(self, reason: str) -> None: ...


class KVReceiver(ABC):
    address: str

    def __init__(self, kv: KVCache, cfg: TransferConfig):
        self.kv, self.cfg = kv, cfg

    @abstractmethod
    def expect(self, request_id: str, dst_blocks: list[int], deadline_s: float | None = None) -> None: ...

    @abstractmethod
    def poll(self) -> list[Arrival]: ...

    @abstractmethod
    def began(self) -> list[str]: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    def __init__(self, kv: KVCache, cfg: TransferConfig):
        self.kv, self.cfg = kv, cfg

    @abstractmethod
    def connect(self, peer: str, deadline_s: float | None = None) -> None: ...

    @abstractmethod
    def reach(self, peer: str, fresh: bool = False) -> tuple[PeerState, str | None]: ...

    @abstractmethod
    def open(self, request_id: str, peer: str, src_blocks: list[int], dst_blocks: list[int],
             num_tokens: int) -> Transfer: ...

    @abstractmethod
    def close(self) -> None: ...

