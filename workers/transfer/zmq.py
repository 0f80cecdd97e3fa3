"""`zmq`: host-staged copy over TCP; works between any two hosts, no shared memory, no RDMA.

The bytes go as frames of at most FRAME_BYTES, each a piece of one layer's paired run of blocks
([n, 2, block_size, heads, dim], contiguous in both pools), after a typed Chunk header, dealt round
robin over --kv-streams data sockets per decode worker; the handshake, Begin/Accept and Done/Ack
stay on the KV channel's own socket (sender.py, receiver.py).

    bulk   finish(): every layer's frames       layer  layer_done(l): layer l's frames

Where the time of the first version went (one frame per run with all layers on the channel's one
socket: 1.3 GB/s at 32k tokens on the H200 host, 0.23 GiB/s with CURVE on the CPU), and what
replaced it:
    frame size   a frame is a fresh receive buffer; past glibc's 32 MiB mmap threshold each is a new
                 mapping the kernel zero-fills page by page (one stream on this project's CPU machine:
                 0.6 GB/s at 256 MiB frames, 2.6 GB/s at 16 MiB)              -> FRAME_BYTES
    one socket   one TCP connection, one ZMQ I/O thread, one CURVE session: one core does all the
                 encryption                                   -> --kv-streams connections, each its own
                                                                 CURVE session on its own ZMQ I/O thread
    staging      (GPU) a pinned buffer allocated per run per request, every layer copied before the
                 first byte left   -> SLOTS pinned staging buffers per sender, reused: each frame's
                                      device-to-host copy on a side stream, sent zero-copy as soon as
                                      that copy completes, its slot free again once ZMQ let go of it
    pool writes  on the receiver's one I/O thread, between reads -> writer threads (one per stream)
On CPU a frame is a view of the source pool, sent zero-copy: no staging at all.

Data streams and who may write: each stream is a DEALER whose routing id carries the token the
receiver handed out in this handshake's Welcome (over the authenticated channel); the receiver maps a
stream's frames to the sender that shook hands, and writes a frame only into blocks that sender's
accepted request reserved (receiver.py's checks). With the deployment's keys the streams are CURVE
like the channel; with --kv-plaintext on both sides they connect to a second, unencrypted port
(--kv-port + 1, or any free port) that lets a connection in only if it shows its token in ZeroMQ's
PLAIN handshake (answered by the ZAP gate from the tokens handed out), and takes nothing but data
frames of that token's stream, at most one frame's size each. A prefill worker without --kv-plaintext
refuses a receiver that offers only that.

Receiver: each frame is copied into the reserved blocks by a writer thread (on GPU on that thread's
stream, synchronised before the write counts). The arrival waits for the Done, for as many frames as
it counts, and for every write of the request; a request given up on is reported only once its writes
in progress have finished (no write lands in blocks that went back to the pool), and its later frames
are dropped. Since the bytes land only when the receiver writes them, TransferStats.finished_at is the Ack.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from pdserve.protocol import auth
from pdserve.protocol import kv as P
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.receiver import ChannelReceiver, Expected
from pdserve.workers.transfer.sender import ZERO_COPY_MIN, ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer

FRAME_BYTES = 8 * 2**20  # at most this per frame (one block more where a single block is larger)
SLOTS_PER_STREAM = 2  # GPU: pinned staging buffers of FRAME_BYTES per data stream
TOKEN_PREFIX = b"d"  # a stream's routing id: prefix + token + stream index (ids may not start with 0)
MAX_TOKENS = 4096  # handshakes remembered (oldest forgotten first)
HEADER_BYTES = 4096  # a Chunk header is ~100 bytes (its request id at most 256)
DATA_DOMAIN = b"pdserve-kv-data"  # the plaintext port's ZAP domain
HANDSHAKE_MS = 2000  # a connection to the plaintext port that has not shown its token by then is cut


def frame_blocks(block_bytes: int) -> int:
    return max(1, FRAME_BYTES // block_bytes)


def max_frame_bytes(block_bytes: int) -> int:
    return frame_blocks(block_bytes) * block_bytes


def data_frame_limit(block_bytes: int) -> int:
    """The plaintext port's ZMQ_MAXMSGSIZE: a data frame (one layer's slice of a run) or its Chunk header."""
    return max(max_frame_bytes(block_bytes), HEADER_BYTES)


# ---- decode side ---------------------------------------------------------------------------------


class Receiver(ChannelReceiver):
    transport = "zmq"
    one_sided = False

    def _setup(self) -> None:
        self._ctx.set(zmq.IO_THREADS, self.cfg.streams)  # before the first socket: one per stream
        self._hello_from: bytes | None = None
        super()._setup()

    def _setup_transport(self) -> None:
        self.writers = ThreadPoolExecutor(self.cfg.streams, thread_name_prefix="kv-writer")
        self.local = threading.local()  # a writer thread's CUDA stream
        self.writing: dict[str, list[Future]] = {}  # request -> its pool writes
        self.owners: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # token -> channel identity
        self.data_sock: zmq.Socket | None = None
        self.data_address = ""
        if self._keys is not None and self.cfg.plaintext:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # libzmq buffers a message until its last frame and counts only whole ones against a high-water
            # mark, so a peer that sends frames without end grows this process by what it sends: nobody but
            # the holder of a token handed out over the CURVE channel gets past the handshake (the Gate
            # answers for self.owners), and no frame of anyone is larger than a real one (a bigger one, or
            # a handshake command of that size: the connection is cut)
            auth.serve_tokens(sock, DATA_DOMAIN)
            self._gate.tokens = self.owners.__contains__
            sock.setsockopt(zmq.MAXMSGSIZE, data_frame_limit(self.layout.block_bytes))
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            if self.cfg.port:
                sock.bind(f"tcp://{self.cfg.host}:{self.cfg.port + 1}")
                port = self.cfg.port + 1
            else:
                port = sock.bind_to_random_port(f"tcp://{self.cfg.host}")
            self.data_sock, self.data_address = sock, f"tcp://{self.cfg.host}:{port}"
            self._poller.register(sock, zmq.POLLIN)

    def _teardown_transport(self) -> None:
        self.writers.shutdown(wait=True)

    def _on_hello(self, ident: bytes, hello: P.Hello) -> None:
        self._hello_from = ident  # for _transport_info: whose streams the new token names
        try:
            super()._on_hello(ident, hello)
        finally:
            self._hello_from = None

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        token = secrets.token_bytes(16)
        self.owners[token] = self._hello_from
        while len(self.owners) > MAX_TOKENS:
            self.owners.popitem(last=False)
        return P.ZmqInfo(self.data_address, token)

    def _owner(self, ident: bytes) -> bytes | None:
        """The channel identity whose handshake gave out the token in a data stream's routing id."""
        if len(ident) != 18 or not ident.startswith(TOKEN_PREFIX):
            return None
        return self.owners.get(ident[1:17])

    def _on_chunk(self, ident: bytes, chunk: P.Chunk, data: memoryview) -> None:
        super()._on_chunk(self._owner(ident) or ident, chunk, data)

    def _on_readable(self, sock: zmq.Socket) -> None:
        if sock is not self.data_sock:
            super()._on_readable(sock)
            return
        for _ in range(1000):  # the plaintext port: data frames of known streams, nothing else
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            owner = self._owner(ident) if len(frames) == 3 else None
            if owner is None or frames[1].get("User-Id") != ident[1:17].hex():
                self._throttle("stranger", logging.WARNING, "%s: dropped a message on the plaintext KV port that "
                               "is not one data frame of the stream its token names", self._name)
                continue
            try:
                msg = P.decode_to_receiver(frames[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(msg, P.Chunk):
                super()._on_chunk(owner, msg, frames[2].buffer)

    def _write_chunk(self, exp: Expected, chunk: P.Chunk, data: memoryview) -> None:
        L = self.layout
        block = (2, L.block_size, L.num_kv_heads, L.head_dim)
        d, n = chunk.dst_start, chunk.num_blocks
        if chunk.layer == -1:  # all layers of a run in one frame (senders before the streams)
            src = torch.frombuffer(data, dtype=L.torch_dtype).view(L.num_layers, n, *block)
            dst = self.kv.pool[:, d:d + n]
        else:
            src = torch.frombuffer(data, dtype=L.torch_dtype).view(n, *block)
            dst = self.kv.pool[chunk.layer, d:d + n]
        fut = self.writers.submit(self._copy, dst, src)  # src keeps the frame alive until then
        fut.add_done_callback(lambda _: self._submit(_nothing))  # wake the I/O thread: the arrival may be due
        self.writing.setdefault(exp.request_id, []).append(fut)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:  # a writer thread
        if dst.device.type != "cuda":
            dst.copy_(src)
            return
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src)  # from pageable memory: returns once the frame has been read
        stream.synchronize()

    def _landed(self, exp: Expected) -> bool:
        if exp.received < exp.done.writes:
            return False
        writes = self.writing.get(exp.request_id, [])
        if not all(f.done() for f in writes):
            return False
        failed = next((f.exception() for f in writes if f.exception() is not None), None)
        if failed is not None:
            exp.give_up = exp.give_up or f"request {exp.request_id}: writing a data frame into the pool failed: {failed}"
            return False
        return True

    def _report(self, exp: Expected, arrival) -> None:
        wait_all(self.writing.pop(exp.request_id, []))  # the fence: no write of ours lands after this
        super()._report(exp, arrival)


def _nothing() -> None: ...


# ---- prefill side --------------------------------------------------------------------------------


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
    frames. GPU: frames wait in `todo` for a free slot, then in `staged` for their copy."""

    def __init__(self, sender: Sender, peer: Peer, plan):
        super().__init__(sender, peer, plan)
        self.streams: Streams = peer.remote
        self.gpu = sender.stream is not None  # on GPU: frames staged through pinned slots
        self.polls_writes = self.gpu  # staged copies to watch: poll without a nap
        self.todo: collections.deque = collections.deque()  # (layer, src, dst, n)
        self.staged: collections.deque = collections.deque()  # (slot, its view, Chunk, copy event)

    def frames(self, layers: list[int]):
        step = frame_blocks(self.plan.block_bytes)
        for layer in layers:
            for s, d, n in self.plan.runs:
                for k in range(0, n, step):
                    yield layer, s + k, d + k, min(step, n - k)

    def _post(self, layers: list[int]) -> int:
        self.mark_started()
        frames = list(self.frames(layers))
        if not self.gpu:  # a layer's run is contiguous in the pool: zero-copy
            for layer, s, d, n in frames:
                self._send(self._chunk(layer, d, n), self.src[layer, s:s + n])
        else:
            self.todo.extend(frames)
            self._pump()
        return len(frames)

    def _chunk(self, layer: int, d: int, n: int) -> P.Chunk:
        return P.Chunk(self.request_id, layer, d, n, n * self.plan.block_bytes)

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
            layer, s, d, n = self.todo.popleft()
            view = self.src[layer, s:s + n]
            slot = slots.free.pop()  # [max_frame_bytes] uint8, pinned
            buf = slot[:view.numel() * view.element_size()].view(view.dtype).view(view.shape)
            with torch.cuda.stream(stream):
                buf.copy_(view, non_blocking=True)
            self.staged.append((slot, buf, self._chunk(layer, d, n), stream.record_event()))
            self.copies += 1

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


class Sender(ChannelSender):
    transport = "zmq"
    info = (P.ZmqInfo,)
    transfer_class = ZmqTransfer
    one_sided = False

    def _setup_transport(self) -> None:
        self.slots = Slots()
        self.slot_count = 0

    def _setup(self) -> None:
        self._ctx.set(zmq.IO_THREADS, self.cfg.streams)  # before the first socket: one per stream
        super()._setup()

    def more_slots(self) -> bool:
        """GPU: allocate one more pinned slot if the sender has fewer than SLOTS_PER_STREAM per stream."""
        if self.slot_count >= SLOTS_PER_STREAM * self.cfg.streams:
            return False
        nbytes = max_frame_bytes(self.layout.block_bytes)
        self.slots.free.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.kv.pool.is_cuda))
        self.slot_count += 1
        return True

    def _attach(self, peer: Peer, welcome: P.Welcome) -> Streams:
        info: P.ZmqInfo = welcome.info
        if info.data_address and self._keys is not None and not self.cfg.plaintext:
            raise TransferError(f"the decode worker at {peer.address} takes KV bytes only unencrypted "
                                "(--kv-plaintext); start this prefill worker with --kv-plaintext too (isolated "
                                "networks only, SECURITY.md), or the decode worker without it")
        socks = []
        for i in range(self.cfg.streams):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: bounded by the requests in flight
            sock.setsockopt(zmq.ROUTING_ID, TOKEN_PREFIX + info.token + bytes([i]))
            if info.data_address:
                auth.connect_token(sock, info.token)
                sock.connect(info.data_address)
            else:
                self._secure_client(sock)
                sock.connect(peer.address)
            socks.append(sock)
        return Streams(socks)

    def _detach(self, peer: Peer) -> None:
        for sock in peer.remote.socks:
            sock.close(linger=0)
