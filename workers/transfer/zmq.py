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

import torch

from protocol import kv as P
from workers.transfer.receiver import ChannelReceiver, Expected
from workers.transfer.sender import ChannelSender, SenderTransfer


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


class ZmqTransfer(SenderTransfer):
    """Queue items: [(Chunk, host buffer)] per run, behind the event of their gather."""

    def _move(self, layers: list[int]) -> None:
        staged = [self._stage(layer) for layer in layers] if self.layered else [self._stage(-1)]
        self.sender._submit(self.queue.extend, staged)

    def _stage(self, layer: int) -> tuple[list[tuple[P.Chunk, torch.Tensor]], torch.cuda.Event | None]:
        """Gather one layer (or all, layer=-1) of every run into host memory."""
        self.mark_started()
        layers = slice(None) if layer == -1 else layer
        frames = []
        if self.sender.stream is None:
            for s, d, n in self.plan.runs:
                view = self.src[layers, s:s + n]
                buf = view if layer != -1 else view.contiguous()
                frames.append((P.Chunk(self.request_id, layer, d, n, buf.numel() * buf.element_size()), buf))
            self.copies += len(self.plan.runs) if layer == -1 else 0
            return frames, None
        stream = self.sender.stream
        stream.wait_event(self.mark())
        with torch.cuda.stream(stream):
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
                frames.append((P.Chunk(self.request_id, layer, d, n, buf.numel() * buf.element_size()), buf))
        return frames, stream.record_event()

    def _post(self, frames: list[tuple[P.Chunk, torch.Tensor]]) -> int:
        for chunk, buf in frames:
            # zero-copy: ZMQ holds the buffer until it is on the wire; the source blocks stay
            # untouched until finish() returns (after the Ack, after every frame arrived)
            self.sender.send(self.p, chunk, buf.view(torch.uint8).numpy().data)
        return len(frames)


class Sender(ChannelSender):
    transport = "zmq"
    info = (P.ZmqInfo,)
    transfer_class = ZmqTransfer
    one_sided = False
