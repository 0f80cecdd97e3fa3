"""`zmq`: host-staged copy over TCP; works between any two hosts, no shared memory, no RDMA.

Sender: per paired run of blocks, gather the run into host memory and send it as one frame
after a typed Chunk header on the same DEALER socket as the control messages:

    bulk   finish(): one frame per run holding all layers, [layers, n, 2, block_size, heads, dim]
    layer  layer_done(l): one frame per run holding layer l, [n, 2, block_size, heads, dim]

On GPU the gather is a device-to-host copy into pinned memory on a side stream that waits for an
event on the compute stream; the I/O thread sends once that copy's event completes. On CPU a
layer's run is already contiguous and goes out zero-copy; a bulk run is gathered with one copy.

Receiver: writes each frame straight into the reserved blocks with one copy_ (on GPU, on its own
stream, synchronised before the arrival is reported). Frames of a request it gave up on are
dropped, so the receiver alone decides what lands: a Cancel needs no confirmation. The Done
notice follows the frames on the same connection; the receiver checks the frame and byte counts.
Since the bytes land only when the receiver writes them, TransferStats.finished_at is the Ack.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future

import torch

from protocol import kv as P
from workers.transfer.base import TransferError
from workers.transfer.plan import Plan
from workers.transfer.receiver import ChannelReceiver, Expected
from workers.transfer.sender import ChannelSender, Peer, SenderTransfer


class Receiver(ChannelReceiver):
    transport = "zmq"
    one_sided = False

    def _setup_transport(self) -> None:
        device = self.kv.pool.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        return P.ZmqInfo()

    def _write_chunk(self, exp: Expected, chunk: P.Chunk, data: memoryview) -> None:
        L = self.layout
        block = (2, L.block_size, L.num_kv_heads, L.head_dim)
        d, n = chunk.dst_start, chunk.num_blocks
        if chunk.layer == -1:
            src = torch.frombuffer(data, dtype=L.torch_dtype).view(L.num_layers, n, *block)
            dst = self.kv.pool[:, d:d + n]
        else:
            src = torch.frombuffer(data, dtype=L.torch_dtype).view(n, *block)
            dst = self.kv.pool[chunk.layer, d:d + n]
        if self.stream is None:
            dst.copy_(src)
        else:  # from pageable memory: copy_ returns once the frame has been read
            with torch.cuda.stream(self.stream):
                dst.copy_(src)

    def _verify(self, exp: Expected) -> str | None:
        done = exp.done
        if exp.received != done.writes or exp.received_bytes != done.num_bytes:
            return (f"request {exp.request_id}: {exp.received_bytes} bytes in {exp.received} frames arrived, the "
                    f"prefill worker sent {done.num_bytes} in {done.writes}")
        return None

    def _before_arrival(self, exp: Expected) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class Sender(ChannelSender):
    transport = "zmq"

    def _setup_transport(self) -> None:
        device = self.kv.pool.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _attach(self, peer: Peer, welcome: P.Welcome) -> bool:
        if not isinstance(welcome.info, P.ZmqInfo):
            raise TransferError(f"decode worker at {peer.address} answered the zmq handshake with "
                                f"{type(welcome.info).__name__}")
        return True

    def _new_transfer(self, peer: Peer, plan: Plan) -> "ZmqTransfer":
        return ZmqTransfer(self, peer, plan)


class Staged:
    """Frames ready to go once `ready` (a CUDA event, or None on CPU) has completed."""

    def __init__(self, chunks: list[P.Chunk], buffers: list[torch.Tensor], ready: torch.cuda.Event | None):
        self.chunks, self.buffers, self.ready = chunks, buffers, ready


class ZmqTransfer(SenderTransfer):
    landed_on_ack = True

    def __init__(self, sender: Sender, peer: Peer, plan: Plan):
        super().__init__(sender, peer, plan)
        self.src = sender.kv.pool
        self.stream: torch.cuda.Stream | None = sender.stream
        self.queue: collections.deque[Staged] = collections.deque()  # I/O thread
        self.finishing: Future | None = None  # I/O thread: resolved once the queue is sent
        self.sent = 0

    def layer_done(self, layer: int) -> None:
        if not self.layered or layer in self.layers_sent or self.error is not None:
            return
        self.layers_sent.add(layer)
        self.sender._submit(self.queue.append, self._stage(layer))

    def _complete(self, deadline: float) -> Future:
        if self.layered:
            rest = [layer for layer in range(self.plan.num_layers) if layer not in self.layers_sent]
            self.layers_sent.update(rest)
            staged = [self._stage(layer) for layer in rest]
        else:
            staged = [self._stage(-1)]
        fut: Future = Future()
        self.sender._submit(self._finish_io, staged, fut)
        return fut  # the hand-off of the data frames: poll() waits for it without blocking

    def _stage(self, layer: int) -> Staged:
        """Gather one layer (or all, layer=-1) of every run into host memory."""
        self.mark_started()
        layers = slice(None) if layer == -1 else layer
        chunks, buffers = [], []
        if self.stream is None:
            for s, d, n in self.plan.runs:
                view = self.src[layers, s:s + n]
                buffers.append(view if layer != -1 else view.contiguous())
                chunks.append(P.Chunk(self.request_id, layer, d, n, buffers[-1].numel() * buffers[-1].element_size()))
            self.copies += len(self.plan.runs) if layer == -1 else 0
            return Staged(chunks, buffers, None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.src.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for s, d, n in self.plan.runs:
                view = self.src[layers, s:s + n]
                buf = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
                if layer == -1:  # one contiguous device-to-host copy per layer of the run
                    for i in range(self.plan.num_layers):
                        buf[i].copy_(view[i], non_blocking=True)
                    self.copies += self.plan.num_layers
                else:
                    buf.copy_(view, non_blocking=True)
                    self.copies += 1
                buffers.append(buf)
                chunks.append(P.Chunk(self.request_id, layer, d, n, buf.numel() * buf.element_size()))
        return Staged(chunks, buffers, self.stream.record_event())

    # ---- I/O thread ------------------------------------------------------------------------

    def _finish_io(self, staged: list[Staged], fut: Future) -> None:
        self.queue.extend(staged)
        self.finishing = fut

    def pump(self) -> None:
        if self.accepted.is_set():
            while self.queue and (self.queue[0].ready is None or self.queue[0].ready.query()):
                item = self.queue.popleft()
                for chunk, buf in zip(item.chunks, item.buffers):
                    # zero-copy: ZMQ holds the buffer until it is on the wire; the source blocks stay
                    # untouched until finish() returns (after the Ack, after every frame arrived)
                    self.sender.send(self.p, chunk, buf.view(torch.uint8).numpy().data)
                    self.sent += 1
        if self.finishing is not None and not self.queue and not self.finishing.done():
            self.finished_at = time.time()
            self.finishing.set_result(None)

    def io_pending(self) -> bool:
        return bool(self.queue) and self.accepted.is_set()

    def writes(self) -> int:
        return self.sent
