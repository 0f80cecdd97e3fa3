"""`fake`: for tests only; a real transport's sender with a fault the tests pick.

The faults are the sender's: it moves every byte over the real data path, then misbehaves at the
end, so what a test watches is the real receiver coping (its deadline, its cancel, its grace):

    stall       the done notice never leaves; the sender fails at its deadline (or at the
                receiver's Cancel, whichever comes first)
    drop_done   the done notice never leaves, and the sender returns as if the decode worker had
                acked it; the receiver must still fail the request at its deadline

    make_sender(kv, cfg, fault)     cfg.transport's Sender (ipc, nixl, zmq) with `fault`; pair it
                                    with registry.make_receiver(kv, cfg) as usual

Not a name the router knows (protocol.enums.Transport): no worker can be started with it, and the
real transports carry no test-only code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol import kv as P
from workers.transfer import registry
from workers.transfer.sender import ChannelSender, Peer

if TYPE_CHECKING:
    from protocol.config import TransferConfig
    from workers.engine.kv_cache import KVCache

FAULTS = ("stall", "drop_done")


class Faulty:
    """Put before a transport's Sender: its done notices go astray as `fault` says."""

    fault = "stall"

    def send(self, p: Peer, msg: msgspec.Struct, data=None) -> None:  # I/O thread
        if not isinstance(msg, P.Done):
            super().send(p, msg, data)
        elif self.fault == "drop_done" and msg.request_id in p.transfers:
            p.transfers[msg.request_id].on_ack(P.Ack(msg.request_id, True))


def make_sender(kv: KVCache, cfg: TransferConfig, fault: str) -> ChannelSender:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    real = registry.transport(cfg.transport).Sender
    sender = type(f"Faulty{real.__name__}", (Faulty, real), {"fault": fault})
    return sender(kv, cfg)
