"""The decode workers a sender talks to: one Peer per handshake with one, holding all of its state.

Two threads share a Peer, each with its half; the handshake's Future is the bridge:

    caller side    state (PeerState), why, since: where the handshake stands, as reach() reports it
    I/O thread     sock, monitor, layout, remote, transfers, handshake_deadline: the connection
    either         ready: Future[Peer], resolved by the I/O thread once the handshake is done (or failed);
                   alive, lost: False and why, once the I/O thread dropped the connection

The caller's ladder (Peer.look, the only place that moves `state`):

    CONNECTING   a handshake under way                -> READY once it is done, DEAD once it failed
    READY        shaken hands; requests go out at once -> DEAD once the connection is dropped
    DEAD         failed or dropped: requests to it fail at once for DEAD_RETRY_S, then a new Peer shakes
                 hands again (at once with reach(peer, fresh=True), e.g. when the router introduces it anew)

A dropped Peer is never revived: its transfers failed with it, and the next handshake makes a new one.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pdserve.workers.transfer.base import PeerState, Transfer
from pdserve.workers.transfer.errors import TransferError

if TYPE_CHECKING:
    import zmq

    from pdserve.workers.engine.kv_cache import KVLayout

DEAD_RETRY_S = 5.0  # a peer that failed its handshake or went away: requests to it fail at once this long


class Peer:
    """One handshake with the decode worker at `address` and the connection it made."""

    def __init__(self, address: str):
        self.address = address
        # caller side
        self.state = PeerState.CONNECTING
        self.why: str | None = None  # DEAD: why
        self.since = 0.0  # DEAD: since when (time.monotonic())
        # either thread
        self.ready: Future = Future()  # -> self, once the handshake is done
        self.alive = True  # False once the I/O thread dropped it
        self.lost: str | None = None  # why it was dropped
        # I/O thread
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.handshake_deadline = 0.0  # time.monotonic(); the I/O thread drops a peer still silent then
        self.layout: KVLayout | None = None
        self.remote = None  # what the transport attached: a mapped pool, a NIXL agent name
        self.transfers: dict[str, Transfer] = {}  # its SenderTransfers in flight, by request id

    # ---- caller side ---------------------------------------------------------------------

    def look(self, now: float) -> PeerState | None:
        """Where the handshake stands now; None once a DEAD peer may be tried again (make a new one)."""
        if self.state is PeerState.CONNECTING and self.ready.done():
            error = self.ready.exception()
            if error is None:
                self.state = PeerState.READY
            else:
                self.dead(str(error), now)
        if self.state is PeerState.READY and not self.alive:
            self.dead(self.lost or "it went away", now)
        if self.state is PeerState.DEAD and now - self.since >= DEAD_RETRY_S:
            return None
        return self.state

    def dead(self, why: str, now: float | None = None) -> None:
        self.state, self.why, self.since = PeerState.DEAD, why, time.monotonic() if now is None else now

    def wait(self, timeout_s: float) -> Peer:
        """Wait for the handshake; TransferError if it failed, FutureTimeout past timeout_s."""
        try:
            self.ready.result(timeout=max(timeout_s, 0.001))
        except TransferError as e:
            self.dead(str(e))
            raise
        self.state = PeerState.READY
        return self
