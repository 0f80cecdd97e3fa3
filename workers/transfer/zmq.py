"""`zmq`: host-staged copy over TCP; works between any two hosts, no shared memory, no RDMA.

The bytes go as frames of at most FRAME_BYTES of one layer's blocks, after a typed Chunk header that
lists the runs they hold, (layer, dst_start, num_blocks) in the order the bytes come (frames.py): a run of
FRAME_BYTES or more is cut into frames of one piece each (a contiguous request: 8 MiB frames of one run,
as before), shorter runs share a frame, up to P.MAX_FRAME_RUNS of them. Frames are dealt round robin over
--kv-streams data sockets per decode worker; the handshake, Begin/Accept and Done/Ack stay on the KV
channel's own socket (sender.py, receiver.py).

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
    short runs   a fragmented pool (qwen2.5-7b at 32k tokens over 1,024 runs of 2 blocks): one frame per run
                 and layer, 28,672 frames of 64 KiB, each its own staging copy, event, ZMQ message,
                 header, host-to-device copy and stream synchronisation (10-20 us a frame on each side,
                 estimated, not measured) -> frames of many runs: 224 frames of 8 MiB, as many as the
                 contiguous request's
A frame of one run is one copy on each side, as before: on GPU the sender copies its blocks into a pinned
slot, on CPU it sends a view of the pool zero-copy; the receiver copies the frame into them. A frame of
several runs: on GPU gathered into a device buffer (block_copy.copy: its kernel; without Triton a gather into
a temporary and a scatter from it), then one device-to-host copy into a slot; the receiver copies it to a
device buffer once and scatters it into the blocks by id (block_copy.copy again). On CPU index_select into
the frame's buffer and index_copy_ from the received frame. The prefill side's transfer is zmq_transfer.py.

Data streams and who may write: each stream is a DEALER whose routing id carries the token the
receiver handed out in this handshake's Welcome (over the authenticated channel); the receiver maps a
stream's frames to the sender that shook hands, and writes a frame only into blocks that sender's
accepted request reserved (receiver.py's checks). With the deployment's keys the streams are CURVE
like the channel; with --kv-plaintext on both sides they connect to a second, unencrypted port
(--kv-port + 1, or any free port) that lets a connection in only if it shows its token in ZeroMQ's
PLAIN handshake (answered by the ZAP gate from the tokens handed out), and takes nothing but data
frames of that token's stream, at most one frame's size each. A prefill worker without --kv-plaintext
refuses a receiver that offers only that.

Receiver: every run of every frame is checked against the blocks the sender's accepted request reserved
(receiver.py, frames.refusal: the bytes against the runs' length exactly, no block outside the reservation
or named twice; the run count is bounded when the header is decoded); a frame that fails a check fails
its request, as a malformed one always did. Each frame is written into the reserved blocks by a writer
thread (on GPU on that thread's stream, synchronised before the write counts). The arrival waits for the
Done, for as many frames as it counts, and for every write of the request; a request given up on is
reported only once its writes in progress have finished (no write lands in blocks that went back to the
pool), and its later frames are dropped. Since the bytes land only when the receiver writes them,
TransferStats.finished_at is the Ack.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import msgspec
import torch
import zmq

from pdserve.protocol import auth
from pdserve.protocol import kv as P
from pdserve.workers.transfer import block_copy, frames
from pdserve.workers.transfer.block_copy import words
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.receiver import ChannelReceiver, Expected
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.zmq_transfer import Slots, Streams, ZmqTransfer, scatter, staging_buffer

SLOTS_PER_STREAM = 2  # GPU: pinned staging buffers of frames.FRAME_BYTES per data stream
TOKEN_PREFIX = b"d"  # a stream's routing id: prefix + token + stream index (ids may not start with 0)
MAX_TOKENS = 4096  # handshakes remembered (oldest forgotten first)
HEADER_BYTES = 1024 + 24 * P.MAX_FRAME_RUNS  # a Chunk header: its request id (at most 256), ~2-24 bytes a run
DATA_DOMAIN = b"pdserve-kv-data"  # the plaintext port's ZAP domain
HANDSHAKE_MS = 2000  # a connection to the plaintext port that has not shown its token by then is cut


def data_frame_limit(block_bytes: int) -> int:
    """The plaintext port's ZMQ_MAXMSGSIZE: a data frame (up to FRAME_BYTES of a layer's blocks) or its header."""
    return max(frames.max_frame_bytes(block_bytes), HEADER_BYTES)


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
        self.local = threading.local()  # a writer thread's CUDA stream, its staging buffer (GPU)
        pool = words(self.kv.pool)
        self.flat = pool.view(1, -1, pool.shape[2])  # [1, layers * blocks, words]: a frame's runs name any layer
        if block_copy.kernel_ready(self.flat, self.flat):  # its compile now, not in a transfer's first frame
            block_copy.warmup(staging_buffer(self.flat, self.layout.block_bytes), self.flat)
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
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = parts[0].bytes
            owner = self._owner(ident) if len(parts) == 3 else None
            if owner is None or parts[1].get("User-Id") != ident[1:17].hex():
                self._throttle("stranger", logging.WARNING, "%s: dropped a message on the plaintext KV port that "
                               "is not one data frame of the stream its token names", self._name)
                continue
            try:
                msg = P.decode_to_receiver(parts[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(msg, P.Chunk):
                super()._on_chunk(owner, msg, parts[2].buffer)

    def _write_chunk(self, exp: Expected, chunk: P.Chunk, data: memoryview) -> None:
        frame = torch.frombuffer(data, dtype=torch.uint8)  # keeps the frame alive until its write is done
        if len(chunk.runs) == 1:  # a piece of one run: contiguous in the pool, one copy
            r = chunk.runs[0]
            dst = self.kv.pool[r.layer, r.dst_start:r.dst_start + r.num_blocks]
            fut = self.writers.submit(self._copy, dst, frame.view(dst.dtype).view(dst.shape))
        else:  # many runs: one scatter by block id
            ids = torch.from_numpy(frames.dst_index(chunk, self.layout.num_blocks))
            fut = self.writers.submit(self._scatter, ids, frame)
        fut.add_done_callback(lambda _: self._submit(_nothing))  # wake the I/O thread: the arrival may be due
        self.writing.setdefault(exp.request_id, []).append(fut)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:  # a writer thread
        if dst.device.type != "cuda":
            dst.copy_(src)
            return
        stream = self._stream()
        with torch.cuda.stream(stream):
            dst.copy_(src)  # from pageable memory: returns once the frame has been read
        stream.synchronize()

    def _scatter(self, ids: torch.Tensor, frame: torch.Tensor) -> None:  # a writer thread
        """The frame's blocks, in order, into pool blocks `ids` (of the pool seen as [layers * blocks, words])."""
        pool = self.flat  # [1, layers * blocks, words]
        n = ids.shape[0]
        if pool.device.type != "cuda":
            pool[0].index_copy_(0, ids, frame.view(pool.dtype).view(n, -1))
            return
        stream = self._stream()
        with torch.cuda.stream(stream):
            staged, arange = self._staging()
            staged[0, :n].view(torch.uint8).view(-1).copy_(frame)  # one host-to-device copy of the frame
            scatter(staged, pool, ids.to(pool.device), arange)
        stream.synchronize()

    def _stream(self) -> torch.cuda.Stream:
        """This writer thread's CUDA stream."""
        if getattr(self.local, "stream", None) is None:
            self.local.stream = torch.cuda.Stream(self.kv.pool.device)
        return self.local.stream

    def _staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This writer thread's device buffer for a frame of many runs, and arange over its blocks."""
        if getattr(self.local, "staged", None) is None:
            self.local.staged = staging_buffer(self.flat, self.layout.block_bytes)
            self.local.arange = torch.arange(self.local.staged.shape[1], device=self.flat.device)
        return self.local.staged, self.local.arange

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


class Sender(ChannelSender):
    transport = "zmq"
    info = (P.ZmqInfo,)
    transfer_class = ZmqTransfer
    one_sided = False

    def _setup_transport(self) -> None:
        self.slots = Slots()
        self.slot_count = 0
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None  # GPU: staging() once made
        pool = words(self.kv.pool)[:1]
        if block_copy.kernel_ready(pool, pool):  # its compile now, not in a transfer's first frame
            block_copy.warmup(pool, self.staging()[0])

    def staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """GPU: the buffer a frame of many runs is gathered into before its copy to a slot, [1, frame_blocks,
        words] on the pool's device (one: every gather and copy runs on the side stream, in order), and
        arange over its blocks."""
        if self.staged is None:
            with torch.cuda.stream(self.stream):
                buf = staging_buffer(words(self.kv.pool), self.layout.block_bytes)
                self.staged = (buf, torch.arange(buf.shape[1], device=buf.device))
        return self.staged

    def _setup(self) -> None:
        self._ctx.set(zmq.IO_THREADS, self.cfg.streams)  # before the first socket: one per stream
        super()._setup()

    def more_slots(self) -> bool:
        """GPU: allocate one more pinned slot if the sender has fewer than SLOTS_PER_STREAM per stream."""
        if self.slot_count >= SLOTS_PER_STREAM * self.cfg.streams:
            return False
        nbytes = frames.max_frame_bytes(self.layout.block_bytes)
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
