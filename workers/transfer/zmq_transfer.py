"""One transfer of the `zmq` transport on the prefill side: its frames, staged and sent (zmq.py has the design).

    ZmqTransfer   _post(layers): the layers' frames (frames.pack's, the same for every layer): on CPU each sent
                  at once (one piece: a view of the pool, zero-copy; several: gathered by index_select); on GPU
                  queued in `todo`, each staged into a free pinned slot by one device-to-host copy on the
                  side stream (several pieces: gathered on the device first, block_copy.copy), sent once
                  that copy is done, the slot free again once ZMQ let go of it
    Streams       a decode worker's data sockets, dealt round robin (Peer.remote)
    Slots         the sender's pinned staging buffers (I/O thread only)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from pdserve.protocol import kv as P
from pdserve.workers.engine.step_inputs import to_device
from pdserve.workers.transfer import block_copy, frames
from pdserve.workers.transfer.block_copy import words
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.sender import ZERO_COPY_MIN
from pdserve.workers.transfer.sender_transfer import SenderTransfer


def staging_buffer(pool: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[1, frame_blocks, words] on the device of `pool` ([1 or layers, blocks, words]): a frame of many runs,
    gathered (sender) or to be scattered (receiver). Always the whole buffer: one kernel variant."""
    return torch.empty(1, frames.frame_blocks(block_bytes), pool.shape[2], dtype=pool.dtype, device=pool.device)


def gather(src: torch.Tensor, staged: torch.Tensor, ids: torch.Tensor, arange: torch.Tensor) -> int:
    """staged[0, k] <- src[0, ids[k]]: a frame's blocks of one layer (src: [1, blocks, words]) into the staging
    buffer, on the current stream (block_copy.copy); returns the calls it issued."""
    return block_copy.copy(src, staged, ids, arange[:ids.shape[0]])


def scatter(staged: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor, arange: torch.Tensor) -> None:
    """pool[0, ids[k]] <- staged[0, k]: a received frame's blocks into the pool seen as [1, layers * blocks,
    words], on the current stream (block_copy.copy)."""
    block_copy.copy(staged, pool, arange[:ids.shape[0]], ids)


@dataclass
class Streams:
    """A decode worker's data sockets (Peer.remote)."""

    socks: list[zmq.Socket]
    turn: int = 0

    def next(self) -> zmq.Socket:
        self.turn += 1
        return self.socks[self.turn % len(self.socks)]


@dataclass
class Slots:
    """GPU: the sender's pinned staging buffers (I/O thread only)."""

    free: list[torch.Tensor] = field(default_factory=list)
    sending: list[tuple[torch.Tensor, zmq.MessageTracker]] = field(default_factory=list)

    def reclaim(self) -> None:
        self.free += [slot for slot, tracker in self.sending if tracker.done]
        self.sending = [(slot, tracker) for slot, tracker in self.sending if not tracker.done]


class ZmqTransfer(SenderTransfer):
    """Queue items: (layers, the compute stream's event), as the base queues them; _post cuts them into
    frames, (layer, i): frame i of frames.pack's for that layer. GPU: frames wait in `todo` for a free
    slot, then in `staged` for their copy."""

    def __init__(self, sender, peer: Peer, plan):  # sender: zmq.Sender
        super().__init__(sender, peer, plan)
        self.streams: Streams = peer.remote
        self.gpu = sender.stream is not None  # on GPU: frames staged through pinned slots
        self.polls_writes = self.gpu  # staged copies to watch: poll without a nap
        self.todo: collections.deque = collections.deque()  # (layer, i)
        self.staged: collections.deque = collections.deque()  # (slot, its view, Chunk, copy event)
        self.packed: list[list[frames.Piece]] | None = None  # I/O thread: one layer's frames
        self.index: list[torch.Tensor | None] = []  # frame i's source block ids in a layer (None: one piece)

    def layer_frames(self, layers: list[int]) -> list[tuple[int, int]]:
        """(layer, i) for each frame of these layers (frames.pack's, packed once per transfer)."""
        if self.packed is None:
            self.packed = frames.pack(self.plan.runs, frames.frame_blocks(self.plan.block_bytes))
        return [(layer, i) for layer in layers for i in range(len(self.packed))]

    def _post(self, layers: list[int]) -> int:
        self.mark_started()
        todo = self.layer_frames(layers)
        if not self.gpu:
            for layer, i in todo:
                self._send(self._chunk(layer, i), self._frame(layer, i))
        else:
            self.todo.extend(todo)
            self._pump()
        return len(todo)

    def _chunk(self, layer: int, i: int) -> P.Chunk:
        pieces = self.packed[i]
        return P.Chunk(self.request_id, [P.Run(layer, d, n) for _, d, n in pieces],
                       sum(n for _, _, n in pieces) * self.plan.block_bytes)

    def _frame(self, layer: int, i: int) -> torch.Tensor:
        """CPU: frame i of `layer`: one piece is a view of the pool (sent zero-copy), several are gathered."""
        pieces = self.packed[i]
        if len(pieces) == 1:
            s, _, n = pieces[0]
            return self.src[layer, s:s + n]
        self.copies += 1
        return self.src[layer].index_select(0, self._index()[i])

    def _index(self) -> list[torch.Tensor | None]:
        """Each frame's source block ids within a layer (None for a frame of one piece), made once per transfer,
        on the pool's device (GPU: one upload, on the side stream, before the first gather)."""
        if not self.index:
            ids = [frames.block_ids([s for s, _, _ in f], [n for _, _, n in f]) if len(f) > 1 else None
                   for f in self.packed]
            # each frame's ids start 16-byte aligned, as the kernel variant warmed up at start (Triton
            # specialises a pointer argument on it)
            sizes = [0 if i is None else len(i) + len(i) % 2 for i in ids]
            flat = np.zeros(sum(sizes), dtype=np.int64)
            offsets = np.cumsum(sizes) - sizes
            for f, o in zip(ids, offsets):
                if f is not None:
                    flat[o:o + len(f)] = f
            index = to_device(flat, self.src.device)  # GPU: through pinned memory, on the side stream
            self.index = [None if f is None else index[o:o + len(f)] for f, o in zip(ids, offsets)]
        return self.index

    def _send(self, chunk: P.Chunk, buf: torch.Tensor, track: bool = False) -> zmq.MessageTracker | None:
        # zero-copy: ZMQ holds the buffer until it is on the wire; the source blocks stay untouched
        # until finish() returns (after the Ack, after every frame arrived); a slot until its tracker is done
        sock = self.streams.next()
        data = buf.view(torch.uint8).numpy()
        sock.send(P.encode(chunk), zmq.SNDMORE)
        if data.nbytes < ZERO_COPY_MIN:
            sock.send(data, copy=True)
            return None
        return sock.send(data, copy=False, track=track)

    def _pump(self) -> None:
        """GPU, I/O thread: send the staged frames whose copy is done, then stage more into free slots."""
        slots: Slots = self.sender.slots
        while self.staged and self.staged[0][3].query():
            slot, buf, chunk, _ = self.staged.popleft()
            tracker = self._send(chunk, buf, track=True)
            if tracker is None:
                slots.free.append(slot)
            else:
                slots.sending.append((slot, tracker))
        slots.reclaim()
        stream = self.sender.stream
        while self.todo and (slots.free or self.sender.more_slots()):
            layer, i = self.todo.popleft()
            slot = slots.free.pop()  # [max_frame_bytes] uint8, pinned
            with torch.cuda.stream(stream):
                view = self._gather(layer, i)
                buf = slot[:view.numel() * view.element_size()].view(view.dtype).view(view.shape)
                buf.copy_(view, non_blocking=True)
            self.staged.append((slot, buf, self._chunk(layer, i), stream.record_event()))
            self.copies += 1

    def _gather(self, layer: int, i: int) -> torch.Tensor:
        """GPU, on the side stream: frame i of `layer` on the device, contiguous. One piece: a view of the pool;
        several: gathered into the sender's one staging buffer, which the side stream's order keeps from
        being overwritten before the previous frame's copy out of it is done."""
        pieces = self.packed[i]
        if len(pieces) == 1:
            s, _, n = pieces[0]
            return self.src[layer, s:s + n]
        staged, arange = self.sender.staging()
        ids = self._index()[i]
        self.copies += gather(words(self.src)[layer:layer + 1], staged, ids, arange)
        return staged[0, :ids.shape[0]]

    def _writes_in_flight(self) -> bool:
        if not self.gpu:
            return False
        if self.error is not None:  # nothing more goes out; the slots come back once their copies are done
            self._drop_writes()
            return False
        self._pump()
        return bool(self.todo or self.staged)

    def _drop_writes(self) -> None:
        self.todo.clear()
        while self.staged:
            slot, _, _, event = self.staged.popleft()
            event.synchronize()  # a device-to-host copy of at most FRAME_BYTES
            self.sender.slots.free.append(slot)
