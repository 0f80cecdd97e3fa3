"""The zmq transport's data path: frames cut at FRAME_BYTES over several streams, with CURVE (the
deployment's keys) and with --kv-plaintext, strangers on the plaintext port (an endless multi-part
message spoken in raw ZMTP holds nothing: no token, no handshake), and the fence (a request
given up on is reported only once its pool writes in progress are done)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

import pytest
import torch
import zmq

from pdserve.protocol import kv as P
from pdserve.settings.keys import new_deployment
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import frames
from pdserve.workers.transfer import zmq as Z
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_receiver, make_sender

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(3, 2, 8, "bfloat16", 16, 64)  # 1 KiB per block and layer


@pytest.fixture()
def small_frames(monkeypatch):
    monkeypatch.setattr(frames, "FRAME_BYTES", 3 * LAYOUT.block_bytes)  # a 10-block run: 4 frames per layer


@pytest.fixture(scope="module")
def keys():
    return new_deployment()[1]


def pools():
    src, dst = KVCache(LAYOUT, "cpu"), KVCache(LAYOUT, "cpu", shared=True)
    src.pool.view(torch.int16).copy_(torch.randint(-2**15, 2**15, src.pool.shape, dtype=torch.int16,
                                                   generator=torch.Generator().manual_seed(5)))
    dst.pool.view(torch.int16).fill_(0x7FC1)  # a NaN pattern: a block never written stays so
    return src, dst


def wait_arrival(recv, rid: str, timeout_s: float = 10):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for a in recv.poll():
            if a.request_id == rid:
                return a
        time.sleep(0.005)
    raise AssertionError(f"no arrival for {rid}")


def move(recv, send, rid: str, src_blocks, dst_blocks, mode_layers=None):
    recv.expect(rid, dst_blocks, 10)
    t = send.open(rid, recv.address, src_blocks, dst_blocks, len(src_blocks) * 16)
    for layer in mode_layers or []:
        t.layer_done(layer)
    stats = t.finish(7, deadline_s=10)
    return stats, wait_arrival(recv, rid)


def same(src, dst, sb, db) -> bool:
    return torch.equal(src.pool[:, sb].view(torch.int16), dst.pool[:, db].view(torch.int16))


@pytest.mark.parametrize("secure", ["curve", "plaintext", "none"])
@pytest.mark.parametrize("mode", ["bulk", "layer"])
def test_frames_over_several_streams_arrive_exactly(small_frames, keys, secure, mode):
    src, dst = pools()
    k = None if secure == "none" else keys
    plain = secure == "plaintext"
    recv = make_receiver(dst, TransferConfig(transport="zmq", keys=k, streams=3, plaintext=plain, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", mode=mode, keys=k, streams=3, plaintext=plain,
                                           deadline_s=10))
    ids = []
    real = Z.Receiver._on_chunk

    def on_chunk(self, ident, chunk, data):
        ids.append(ident)
        return real(self, ident, chunk, data)

    try:
        Z.Receiver._on_chunk = on_chunk
        sb, db = list(range(2, 12)) + [30], list(range(40, 50)) + [5]  # a 10-block run and a 1-block one
        stats, a = move(recv, send, "r", sb, db, range(LAYOUT.num_layers) if mode == "layer" else None)
        assert a.ok and a.first_token == 7, a
        assert stats.num_bytes == len(sb) * LAYOUT.num_layers * LAYOUT.block_bytes
        assert same(src, dst, sb, db)
        untouched = [b for b in range(LAYOUT.num_blocks) if b not in db]
        assert (dst.pool[:, untouched].view(torch.int16) == 0x7FC1).all()
        # per layer: 3 + 3 + 3 blocks of the 10-block run, then its last block and the 1-block run in one frame
        want = LAYOUT.num_layers * 4
        assert len(ids) == want if not plain else len(ids) == 0  # plaintext: read on the data port
        assert (recv.data_address != "") == plain
        if not plain:
            assert len(set(ids)) == 3 and all(i.startswith(Z.TOKEN_PREFIX) and len(i) == 18 for i in ids)
    finally:
        Z.Receiver._on_chunk = real
        send.close(), recv.close(), dst.close()


def test_a_prefill_worker_without_plaintext_refuses_a_plaintext_receiver(keys):
    src, dst = pools()
    recv = make_receiver(dst, TransferConfig(transport="zmq", keys=keys, plaintext=True, deadline_s=5))
    send = make_sender(src, TransferConfig(transport="zmq", keys=keys, deadline_s=5))
    try:
        with pytest.raises(TransferError, match="only unencrypted.*--kv-plaintext"):
            send.connect(recv.address, 5)
    finally:
        send.close(), recv.close(), dst.close()


def test_strangers_on_the_plaintext_port_write_nothing(keys):
    """A process without the keys reaches the plaintext port: with a made-up token, with no routing id,
    with a frame larger than any real one; none of it lands, and the real sender's transfer still does."""
    src, dst = pools()
    recv = make_receiver(dst, TransferConfig(transport="zmq", keys=keys, plaintext=True, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", keys=keys, plaintext=True, deadline_s=10))
    ctx = zmq.Context()
    try:
        recv.expect("x", [20, 21], 10)
        send.connect(recv.address, 5)
        data = torch.zeros(2, *LAYOUT.shape[2:], dtype=torch.bfloat16).view(torch.uint8).numpy()
        header = P.encode(P.Chunk("x", [P.Run(0, 20, 2)], data.nbytes))
        for ident, payload in ((Z.TOKEN_PREFIX + bytes(16) + b"\0", data), (None, data),
                               (Z.TOKEN_PREFIX + bytes(17), bytes(frames.max_frame_bytes(LAYOUT.block_bytes) + 8192))):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if ident is not None:
                sock.setsockopt(zmq.ROUTING_ID, ident)
            sock.connect(recv.data_address)
            sock.send_multipart([header, payload])
        time.sleep(0.5)
        assert (dst.pool[:, [20, 21]].view(torch.int16) == 0x7FC1).all(), "a stranger's frame was written"
        t = send.open("x", recv.address, [3, 4], [20, 21], 32)
        t.finish(1, deadline_s=10)
        assert wait_arrival(recv, "x").ok and same(src, dst, [3, 4], [20, 21])
    finally:
        ctx.destroy(linger=0)
        send.close(), recv.close(), dst.close()


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def endless_message(address: str, ident: bytes, password: bytes | None, mib: int) -> int:
    """ZMTP 3.0 spoken by hand (libzmq's own senders hold a message until its last frame): a NULL
    greeting and READY, or (with a password) PLAIN's HELLO and INITIATE, as a DEALER named `ident`; then
    1 MiB frames that all say "more follows", without waiting for any answer. MiB the peer took."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)

    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    def command(body: bytes) -> bytes:
        return bytes([0x04, len(body)]) + body

    props = prop(b"Socket-Type", b"DEALER") + prop(b"Identity", ident)
    if password is None:
        mechanism, handshake = b"NULL", command(b"\x05READY" + props)
    else:
        hello = b"\x05HELLO" + bytes([5]) + b"token" + bytes([len(password)]) + password
        mechanism, handshake = b"PLAIN", command(hello) + command(b"\x08INITIATE" + props)
    part = b"\x03" + struct.pack(">Q", 2**20) + os.urandom(2**20)  # MORE | LONG, 8-byte size
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + bytes(32))
            s.sendall(handshake)
            for _ in range(mib):
                s.sendall(part)
                sent += 1
        except OSError:  # cut off by the receiver
            pass
    return sent


def test_an_endless_message_on_the_plaintext_port_is_cut_at_the_handshake(keys):
    """Before: libzmq read all 128 MiB of a message that never ends into this process (+128 MiB), with a
    made-up token in its routing id. Now a peer must show a token the receiver handed out before a frame
    is read: without one (no mechanism, or a made-up token) it is cut at once, and the sender that holds
    a token still moves its KV."""
    src, dst = pools()
    recv = make_receiver(dst, TransferConfig(transport="zmq", keys=keys, plaintext=True, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", keys=keys, plaintext=True, deadline_s=10))
    try:
        send.connect(recv.address, 5)
        real = Z.TOKEN_PREFIX + next(iter(recv.owners)) + b"\0"  # the real stream's routing id
        before = rss_mib()
        took = [endless_message(recv.data_address, ident, password, 128)
                for ident, password in ((Z.TOKEN_PREFIX + bytes(17), None), (real, None), (real, bytes(16)))]
        time.sleep(0.3)
        grown = rss_mib() - before
        assert max(took) < 16 and grown < 32, f"the receiver took {took} MiB, grew {grown} MiB"
        assert recv._gate.refused == 1  # the made-up token; the two without PLAIN never reach the gate
        _, a = move(recv, send, "ok", [3, 4], [20, 21])
        assert a.ok and same(src, dst, [3, 4], [20, 21])
    finally:
        send.close(), recv.close(), dst.close()


def test_a_cancelled_request_is_reported_after_its_writes_end(small_frames, monkeypatch):
    """Pool writes slowed to 0.3 s each: the cancel's failed arrival (when the blocks may go back)
    comes only after every write that had started has ended."""
    src, dst = pools()
    ended: list[float] = []
    started = threading.Event()
    real = Z.Receiver._copy

    def slow(self, d, s):
        started.set()
        time.sleep(0.3)
        real(self, d, s)
        ended.append(time.monotonic())

    monkeypatch.setattr(Z.Receiver, "_copy", slow)
    recv = make_receiver(dst, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    try:
        sb, db = list(range(10)), list(range(30, 40))
        recv.expect("c", db, 10)
        t = send.open("c", recv.address, sb, db, 160)
        t.start_finish(1, deadline_s=10)
        while not started.is_set():
            t.poll()
            time.sleep(0.005)
        recv.cancel("c")
        a = wait_arrival(recv, "c")
        assert not a.ok and "cancelled" in a.error
        assert ended and a.reported_at >= max(ended), (a.reported_at, ended)
        with pytest.raises(TransferError):
            t.finish(1, deadline_s=5)
    finally:
        send.close(), recv.close(), dst.close()


class DoneEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class HostStream:
    """Stands in for the sender's CUDA side stream on a CPU machine: its copies run at once, its
    events are complete when recorded. What runs for real: the slots, their reuse, ZMQ's trackers."""

    def record_event(self) -> DoneEvent:
        return DoneEvent()


def test_staging_slots_are_reused_and_all_come_back(monkeypatch):
    layout = KVLayout(3, 4, 64, "bfloat16", 16, 64)  # 16 KiB blocks: 5-block frames go zero-copy, tracked
    monkeypatch.setattr(frames, "FRAME_BYTES", 5 * layout.block_bytes)
    monkeypatch.setattr(Z, "SLOTS_PER_STREAM", 1)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    src, dst = KVCache(layout, "cpu"), KVCache(layout, "cpu", shared=True)
    src.pool.view(torch.int16).copy_(torch.randint(-2**15, 2**15, src.pool.shape, dtype=torch.int16,
                                                   generator=torch.Generator().manual_seed(8)))
    recv = make_receiver(dst, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    send.stream = HostStream()
    try:
        for i, (sb, db) in enumerate([(list(range(0, 23)), list(range(30, 53))), ([60, 61], [2, 3])]):
            stats, a = move(recv, send, f"s{i}", sb, db)
            assert a.ok and same(src, dst, sb, db), a
            assert stats.copies == layout.num_layers * -(-len(sb) // 5)  # one staging copy per frame
        assert send.slot_count == 2  # 2 slots carried 15 + 3 frames
        deadline = time.monotonic() + 5
        while len(send.slots.free) < 2 and time.monotonic() < deadline:
            send._call(send.slots.reclaim, timeout_s=5)
            time.sleep(0.01)
        assert len(send.slots.free) == 2 and not send.slots.sending
    finally:
        send.close(), recv.close(), dst.close()
