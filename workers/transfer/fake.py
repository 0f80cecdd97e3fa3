"""`fake`: for tests only; a real transport's sender with a fault the tests pick, and a receiver
without its fence.

The faults are the sender's: it moves every byte over the real data path, then misbehaves at the
end, so what a test watches is the real receiver coping (its deadline, its cancel, its grace):

    stall       the done notice never leaves; the sender fails at its deadline (or at the
                receiver's Cancel, whichever comes first)
    drop_done   the done notice never leaves, and the sender returns as if the decode worker had
                acked it; the receiver must still fail the request at its deadline
    late        requests whose id starts with "late": their writes are in flight (held) until the
                test calls release(request_id); a Cancel or abort meanwhile takes effect only once
                they landed (a copy already queued on a GPU or a NIC cannot be recalled), and the done
                notice never leaves before that

    make_sender(kv, cfg, fault)     cfg.transport's Sender (ipc, nixl, zmq) with `fault`; pair it
                                    with registry.make_receiver(kv, cfg) as usual
    make_unfenced_receiver(kv, cfg) cfg.transport's Receiver as the peers shipped it in 2026: blocks of a
                                    request it gave up on go back at once, though writes may still land
                                    (the fenced receiver's counterpart: the chaos test shows it corrupts)

Not a name the router knows (protocol.enums.Transport): no worker can be started with it, and the
real transports carry no test-only code.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from pdserve.protocol import kv as P
from pdserve.workers.transfer import registry
from pdserve.workers.transfer.base import Arrival
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.receiver import ChannelReceiver, Expected
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer

if TYPE_CHECKING:
    from pdserve.settings.worker import TransferConfig
    from pdserve.workers.engine.kv_cache import KVCache

FAULTS = ("stall", "drop_done", "late")
RELEASE_TIMEOUT_S = 10.0


class Faulty:
    """Put before a transport's Sender: its done notices go astray as `fault` says."""

    fault = "stall"

    def send(self, p: Peer, msg: msgspec.Struct, data=None) -> None:  # I/O thread
        if not isinstance(msg, P.Done):
            super().send(p, msg, data)
        elif self.fault == "late":
            t = p.transfers.get(msg.request_id)
            if t is None or not t.late or t.released:
                super().send(p, msg, data)
        elif self.fault == "drop_done" and msg.request_id in p.transfers:
            p.transfers[msg.request_id].on_ack(P.Ack(msg.request_id, True))

    def release(self, request_id: str) -> None:
        """fault="late": the held writes of `request_id` land now, then its deferred failure takes effect."""
        self.held[request_id].release()


class HeldWrites:
    """Put before a transport's SenderTransfer (fault="late")."""

    def __init__(self, sender, peer, plan):
        super().__init__(sender, peer, plan)
        self.late = self.request_id.startswith("late")
        self.released = False
        self.held_layers: list[list[int]] = []
        self.deferred: list[tuple] = []
        if self.late:
            sender.held[self.request_id] = self

    def _move(self, layers: list[int]) -> None:
        if self.late and not self.released:
            self.held_layers.append(layers)
        else:
            super()._move(layers)

    def fail(self, error, reachable: bool = True) -> None:
        if self.late and not self.released:
            self.deferred.append((error, reachable))
        else:
            super().fail(error, reachable)

    def release(self) -> None:  # the test's thread
        self.released = True
        for layers in self.held_layers:
            super()._move(layers)  # ipc copies now; nixl and zmq queue them for the I/O thread
        self.sender._submit(lambda: None).result(RELEASE_TIMEOUT_S)  # after the queueing, in order
        end = time.monotonic() + RELEASE_TIMEOUT_S
        while (self.queue or self._in_flight) and time.monotonic() < end:  # the I/O thread posts them
            time.sleep(0.002)
        for error, reachable in self.deferred:
            super().fail(error, reachable)


def make_sender(kv: KVCache, cfg: TransferConfig, fault: str) -> ChannelSender:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    real = registry.transport(cfg.transport).Sender
    transfer = type(f"Held{real.transfer_class.__name__}", (HeldWrites, real.transfer_class), {})
    sender = type(f"Faulty{real.__name__}", (Faulty, real), {"fault": fault, "transfer_class": transfer})
    made = sender(kv, cfg)
    made.held: dict[str, SenderTransfer] = {}
    return made


class Unfenced:
    """Put before a transport's Receiver: no fence. One-sided (ipc, nixl): a transfer given up on is
    reported at once, its blocks free while the sender may still write; zmq: its writes in progress
    are not waited for, and late frames of a request given up on are still written where it had
    its blocks."""

    def _fence(self, exp: Expected) -> None:
        self._report(exp, Arrival(exp.request_id, False, error=exp.give_up))

    def _report(self, exp: Expected, arrival: Arrival) -> None:
        if not self.one_sided and not arrival.ok:
            self.__dict__.setdefault("gone", {})[exp.request_id] = exp
            self.writing.pop(exp.request_id, None)
            ChannelReceiver._report(self, exp, arrival)
            return
        super()._report(exp, arrival)

    def _on_chunk(self, ident: bytes, chunk: P.Chunk, data: memoryview) -> None:
        gone = self.__dict__.get("gone", {}).get(chunk.request_id)
        if gone is not None and chunk.request_id not in self._expected:
            self._write_chunk(gone, chunk, data)
            return
        super()._on_chunk(ident, chunk, data)


def make_unfenced_receiver(kv: KVCache, cfg: TransferConfig) -> ChannelReceiver:
    real = registry.transport(cfg.transport).Receiver
    return type(f"Unfenced{real.__name__}", (Unfenced, real), {})(kv, cfg)

