"""KV transports on raw pools: prefill and decode in separate processes, bytes compared exactly;
handshake refusals, deadlines, cancels and killed peers (nothing hangs, every block comes back)."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.bench.transfer.table import Child
from transfer_peer import layout_arg, source_pool
from pdserve.protocol import kv as P
from pdserve.settings.worker import TransferConfig
from pdserve.protocol.enums import TRANSPORTS  # a new transport is tested here as soon as it has its name
from pdserve.workers.engine.block_pool import BlockPool, paired_runs
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import fake, registry
from pdserve.workers.transfer.base import LIVE, MOVES, PeerState, TransferState
from pdserve.workers.transfer.errors import IllegalMove, LayoutMismatch, TransferError
from pdserve.workers.transfer.peers import DEAD_RETRY_S, Peer
from pdserve.workers.transfer.plan import descriptors, make_plan
from pdserve.workers.transfer.registry import make_receiver, make_sender
from pdserve.workers.transfer.sender_transfer import SenderTransfer

pytestmark = pytest.mark.timeout(180)

# the decode side's pool; the prefill side's has fewer blocks (only the block count may differ)
LAYOUT = KVLayout(4, 2, 8, "bfloat16", 16, 64)
SRC_LAYOUT = KVLayout(4, 2, 8, "bfloat16", 16, 48)
SEED = 1234
PEER = Path(__file__).with_name("transfer_peer.py")
PACKAGE = Path(__file__).resolve().parents[1] / "workers" / "transfer"


class PeerProcess(Child):
    """tests/transfer_peer.py in a child process; its first reply is its hello."""

    def __init__(self, *args: str):
        argv = [sys.executable, str(PEER), *args, "--transports", ",".join(TRANSPORTS)]
        super().__init__("transfer peer", argv, reply="@peer ")
        self.hello = self.read(120)


@pytest.fixture(scope="module")
def receiver_peer():
    peer = PeerProcess("receiver", "--layout", layout_arg(LAYOUT))
    yield peer
    peer.close()


# ---- units ---------------------------------------------------------------------------------


def test_plan_pairs_runs_and_checks_blocks():
    plan = make_plan("r", [3, 4, 5, 9, 10, 20], [40, 41, 42, 7, 8, 50], 90, SRC_LAYOUT, LAYOUT)
    assert plan.runs == ((3, 40, 3), (9, 7, 2), (20, 50, 1))
    assert plan.num_bytes == LAYOUT.num_layers * 6 * LAYOUT.block_bytes
    assert paired_runs([1, 2, 3], [7, 8, 10]) == [(1, 7, 2), (3, 10, 1)]
    with pytest.raises(TransferError, match="need 2 blocks"):
        make_plan("r", [1], [2], 17, SRC_LAYOUT, LAYOUT)
    with pytest.raises(TransferError, match="outside a pool of 48"):
        make_plan("r", [48], [1], 5, SRC_LAYOUT, LAYOUT)


def test_descriptors_address_layer_major_runs():
    rows = descriptors(1000, LAYOUT, np.array([3, 9]), np.array([3, 2]), np.array([0, 2]), 7)
    bb, lb = LAYOUT.block_bytes, LAYOUT.layer_bytes
    assert rows.tolist() == [
        [1000 + 3 * bb, 3 * bb, 7], [1000 + 9 * bb, 2 * bb, 7],
        [1000 + 2 * lb + 3 * bb, 3 * bb, 7], [1000 + 2 * lb + 9 * bb, 2 * bb, 7],
    ]
    assert rows[2, 0] == 1000 + LAYOUT.offset(2, 3)


def test_the_transfer_ladder_is_one_table():
    """base.MOVES is a transfer's whole ladder: every state is reached from OPENED, DONE and FAILED end
    it, and every live state can fail both ways."""
    reached, grew = {TransferState.OPENED}, True
    while grew:
        more = {to for to, sources in MOVES.values() if sources & reached}
        grew, reached = not more <= reached, reached | more
    assert reached == set(TransferState)
    ends = {TransferState.DONE, TransferState.FAILED}
    assert all(not (sources & ends) for _, sources in MOVES.values())
    assert MOVES["fail"][1] == MOVES["fail_quietly"][1] == LIVE == set(TransferState) - ends - {TransferState.ABORTING}


class QuietSender:
    """A transfer's sender without an I/O thread: what it is handed runs at once, what it sends is kept."""

    one_sided = True

    def __init__(self):
        self.cfg, self.kv, self.sent = TransferConfig(transport="zmq"), KVCache(SRC_LAYOUT, "cpu"), []

    def _submit(self, fn, *args) -> Future:
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def send(self, p, msg, data=None):
        self.sent.append(msg)


class CountedTransfer(SenderTransfer):
    def _post(self, layers: list[int]) -> int:
        self.mark_started()
        return 1


def counted(sender: QuietSender, request_id: str) -> CountedTransfer:
    """A one-block transfer to a peer that is never reached."""
    plan = make_plan(request_id, [1], [2], 16, SRC_LAYOUT, LAYOUT)
    return CountedTransfer(sender, Peer("tcp://127.0.0.1:1"), plan)


def test_a_transfer_moves_only_along_its_ladder():
    sender = QuietSender()
    t = counted(sender, "r")
    with pytest.raises(IllegalMove, match="poll\\(\\) before start_finish"):
        t.poll()
    t.on_ack(P.Ack("r", True))  # an answer that comes out of turn is ignored
    assert t.state is TransferState.OPENED
    with pytest.raises(IllegalMove, match="cannot send done while opened"):
        t._transition("send_done")
    t.on_accept()
    t.start_finish(first_token=5, deadline_s=5)
    assert t.poll() is None and t.state is TransferState.LANDING  # the I/O thread has not posted yet
    t.io_step()  # nothing queued, nothing in flight: every byte landed
    assert t.poll() is None and t.state is TransferState.ACKING and isinstance(sender.sent[-1], P.Done)
    t.on_ack(P.Ack("r", True))
    assert t.poll().num_bytes == LAYOUT.num_layers * LAYOUT.block_bytes and t.state is TransferState.DONE and t.over
    t.abort("too late")  # a done transfer stays done
    assert t.state is TransferState.DONE and t.error is None

    t = counted(sender, "s")
    t.abort("changed my mind")
    t.fail(TransferError("a second failure"))  # the first one counts
    assert t.state is TransferState.ABORTING and "changed my mind" in str(t.error)
    with pytest.raises(TransferError, match="changed my mind"):  # a move from a failed state raises the failure
        t._transition("accept")
    t.io_step()  # no write in flight: the receiver is told
    assert t.state is TransferState.FAILED and t.over and isinstance(sender.sent[-1], P.Abort)


def test_a_failure_while_landing_ends_finish_at_once():
    """A Cancel that comes while finish() waits for the writes to land (LANDING): the wait ends with the
    failure once no write is in flight. Before, the landing was resolved only while the transfer was live,
    so finish() slept on until its deadline (10 s in tests/test_zmq_frames.py, now and then)."""
    sender = QuietSender()
    t = counted(sender, "w")
    t.on_accept()

    def cancel() -> None:  # what the I/O thread does on a Cancel, 0.2 s into finish()'s wait
        t.fail(TransferError("the decode worker stopped waiting"))
        t.io_step()

    timer = threading.Timer(0.2, cancel)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(TransferError, match="stopped waiting"):
            t.finish(5, deadline_s=5)
    finally:
        timer.cancel()
    assert time.monotonic() - start < 2 and t.landing is not None and t.landing.done()


def test_a_peer_is_one_record_with_its_own_ladder():
    now = time.monotonic()
    p = Peer("tcp://127.0.0.1:1")
    assert p.look(now) is PeerState.CONNECTING
    p.ready.set_exception(TransferError("refused"))
    assert p.look(now) is PeerState.DEAD and p.why == "refused"
    assert p.look(now + DEAD_RETRY_S) is None  # tried again: a new Peer
    p = Peer("tcp://127.0.0.1:1")
    p.ready.set_result(p)
    assert p.look(now) is PeerState.READY
    p.alive, p.lost = False, "it disconnected"
    assert p.look(now) is PeerState.DEAD and p.why == "it disconnected"


def test_protocol_round_trip_and_no_pickle():
    hello = P.Hello(P.PROTOCOL_VERSION, "nixl", "host", P.Layout.of(LAYOUT), "me")
    assert P.decode_to_receiver(P.encode(hello)) == hello
    welcome = P.Welcome(1, "h", P.Layout.of(LAYOUT), P.NixlInfo("a", b"\x00md", 123, 0, "DRAM"))
    assert P.decode_to_sender(P.encode(welcome)) == welcome
    assert KVLayout.from_wire(P.Layout.of(LAYOUT)) == LAYOUT
    with pytest.raises(Exception):
        P.decode_to_receiver(b"\x80\x04\x95")  # a pickle header is not a message


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("field", ["num_kv_heads", "block_size", "dtype"])
def test_layout_mismatch_names_both_layouts(transport, field):
    other = dict(num_kv_heads=4, block_size=32, dtype="float16")[field]
    theirs = dataclasses.replace(LAYOUT, **{field: other})
    dst, src = KVCache(LAYOUT, "cpu", shared=True), KVCache(theirs, "cpu")
    recv = make_receiver(dst, TransferConfig(transport=transport, deadline_s=5))
    send = make_sender(src, TransferConfig(transport=transport, deadline_s=5))
    try:
        with pytest.raises(LayoutMismatch) as err:
            send.open("r1", recv.address, [0], [0], 4)
        assert theirs.describe() in str(err.value) and LAYOUT.describe() in str(err.value), str(err.value)
    finally:
        send.close(), recv.close(), dst.close()


def test_garbage_is_refused_and_the_receiver_keeps_working():
    import zmq

    dst, src = KVCache(LAYOUT, "cpu", shared=True), source_pool(SRC_LAYOUT, SEED)
    recv = make_receiver(dst, TransferConfig(transport="zmq", deadline_s=5))
    send = make_sender(src, TransferConfig(transport="zmq", deadline_s=5))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(recv.address)
        sock.send(b"\x80\x04\x95 not msgpack")
        assert sock.poll(5000), "no answer to a malformed message"
        refused = P.decode_to_sender(sock.recv())
        assert isinstance(refused, P.Refused) and "same pdserve version" in refused.error
        recv.expect("ok", [3], deadline_s=5)
        send.open("ok", recv.address, [1], [3], 16).finish(7)
        assert wait_arrival(recv, "ok", 5).ok and torch.equal(dst.pool[:, 3], src.pool[:, 1])
    finally:
        sock.close(0), ctx.term(), send.close(), recv.close(), dst.close()


def package_imports(path: Path) -> set[str]:
    """The modules of workers/transfer/ that `path` imports (TYPE_CHECKING ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "pdserve.workers.transfer":
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve.workers.transfer."):
            found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("pdserve.workers.transfer."))
    return found


def test_the_interface_and_errors_need_nothing_of_the_rest():
    """(No circles anywhere: tests/test_house.py.)"""
    deps = {f.stem: package_imports(f) for f in PACKAGE.glob("*.py")}
    assert deps["errors"] == deps["base"] == set()


def test_the_fake_transport_is_for_tests_only():
    """The fault knob lives in workers/transfer/fake.py: not in the config, not a name the router knows."""
    assert "fake" not in TRANSPORTS and "fault" not in {f.name for f in dataclasses.fields(TransferConfig)}
    with pytest.raises(ValueError, match="unknown transport"):
        registry.transport("fake")
    with pytest.raises(ValueError, match="unknown fault"):
        fake.make_sender(KVCache(SRC_LAYOUT, "cpu"), TransferConfig(transport="zmq"), "slow")
    for name in (*TRANSPORTS, "base", "peers", "sender", "sender_transfer", "receiver", "endpoint"):  # no test knob
        assert not re.search(r"\bfault", (PACKAGE / f"{name}.py").read_text()), name


# ---- bytes across processes ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bulk", "layer"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_arrive_exactly_across_processes(receiver_peer, transport, mode):
    src = source_pool(SRC_LAYOUT, SEED)
    send = make_sender(src, TransferConfig(transport=transport, mode=mode, deadline_s=20))
    address = receiver_peer.hello["addresses"][transport]
    cases = [([3, 4, 5, 9, 10, 20], [40, 41, 42, 7, 8, 50]),  # three runs
             ([47], [0]),  # a prompt shorter than one block
             (list(range(10, 42)), list(range(30, 62)))]  # one long run
    try:
        for i, (sb, db) in enumerate(cases):
            rid = f"{transport}-{mode}-{i}"
            assert receiver_peer.ask("expect", transport=transport, id=rid, blocks=db, deadline_s=20)["ok"]
            t = send.open(rid, address, sb, db, len(sb) * 16 - 5)
            for layer in range(SRC_LAYOUT.num_layers):
                t.layer_done(layer)
            stats = t.finish(first_token=100 + i)
            assert stats.num_bytes == len(sb) * LAYOUT.num_layers * LAYOUT.block_bytes
            assert stats.layers_sent_before_finish == (LAYOUT.num_layers if mode == "layer" else 0)
            got = receiver_peer.ask("wait", id=rid, timeout_s=20, seed=SEED, src_layout=layout_arg(SRC_LAYOUT),
                                    src_blocks=sb, dst_blocks=db)
            assert got["arrival"] == {"ok": True, "error": None, "first_token": 100 + i, "num_bytes": stats.num_bytes}
            assert got["equal"], f"{rid}: received blocks differ from the source"
            assert got["untouched"], f"{rid}: blocks outside the reservation were written"
    finally:
        send.close()


# ---- failures: nothing hangs, every block comes back -----------------------------------------


@pytest.fixture()
def pair(request):
    """An in-process receiver and sender for one transport (for deadline and refusal tests); with a
    fault, the sender is the fake transport's over that one (workers/transfer/fake.py)."""
    made = []

    def make(transport, mode="bulk", deadline_s=5.0, fault=None, grace_s=5.0):
        dst, src = KVCache(LAYOUT, "cpu", shared=True), KVCache(SRC_LAYOUT, "cpu")
        recv = make_receiver(dst, TransferConfig(transport=transport, deadline_s=deadline_s, cancel_grace_s=grace_s))
        cfg = TransferConfig(transport=transport, mode=mode, deadline_s=deadline_s)
        send = make_sender(src, cfg) if fault is None else fake.make_sender(src, cfg, fault)
        made.append((recv, send, dst))
        return recv, send

    yield make
    for recv, send, dst in made:
        send.close(), recv.close(), dst.close()


def wait_arrival(recv, request_id: str, timeout_s: float):
    """The request's arrival that lets its blocks go (a fenced one's notice, released=False, comes first)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for a in recv.poll():
            if a.request_id == request_id and a.released:
                return a
        time.sleep(0.005)
    raise AssertionError(f"no arrival for {request_id} within {timeout_s} s")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_expect_deadline_reports_failure_and_late_sender_is_refused(pair, transport):
    recv, send = pair(transport)
    start = time.monotonic()
    recv.expect("late", [5, 6], deadline_s=0.3)
    a = wait_arrival(recv, "late", 3)
    assert not a.ok and "did not arrive within 0.3 s" in a.error
    assert 0.25 < time.monotonic() - start < 1.5
    t = send.open("late", recv.address, [1, 2], [5, 6], 20)  # the blocks went back: no write may land
    with pytest.raises(TransferError, match="not waiting for request late"):
        t.finish(1, deadline_s=3)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancel_and_wrong_blocks(pair, transport):
    recv, send = pair(transport)
    recv.expect("c", [1], deadline_s=5)
    recv.cancel("c")
    a = wait_arrival(recv, "c", 2)
    assert not a.ok and "cancelled" in a.error
    recv.expect("w", [1, 2], deadline_s=5)
    t = send.open("w", recv.address, [1, 2], [3, 4], 20)
    with pytest.raises(TransferError, match="destination blocks"):
        t.finish(1, deadline_s=3)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stalled_sender_fails_both_sides_within_deadlines(pair, transport):
    recv, send = pair(transport, mode="layer", deadline_s=2.0, fault="stall", grace_s=1.0)
    recv.expect("s", [7, 8], deadline_s=0.5)
    start = time.monotonic()
    t = send.open("s", recv.address, [1, 2], [7, 8], 30)
    t.layer_done(0)
    with pytest.raises(TransferError):
        t.finish(1, deadline_s=1.5)
    a = wait_arrival(recv, "s", 3)
    assert not a.ok and "did not arrive" in a.error
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lost_done_notice_fails_on_the_receiver(pair, transport):
    recv, send = pair(transport, fault="drop_done")
    recv.expect("d", [9], deadline_s=0.5)
    send.open("d", recv.address, [2], [9], 3).finish(1, deadline_s=2)
    a = wait_arrival(recv, "d", 3)
    assert not a.ok and "did not arrive" in a.error


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_receiver_fails_the_handshake_in_time(transport):
    src = KVCache(SRC_LAYOUT, "cpu")
    send = make_sender(src, TransferConfig(transport=transport, deadline_s=0.5))
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="no handshake answer"):
            send.open("x", "tcp://127.0.0.1:9", [0], [0], 1)
        assert time.monotonic() - start < 2
    finally:
        send.close()


def test_receiver_killed_mid_transfer_fails_the_senders_in_time():
    peer = PeerProcess("receiver", "--layout", layout_arg(LAYOUT))
    src = source_pool(SRC_LAYOUT, SEED)
    blocks = BlockPool(SRC_LAYOUT.num_blocks)
    senders, transfers = [], []
    try:
        for transport in TRANSPORTS:
            send = make_sender(src, TransferConfig(transport=transport, mode="layer", deadline_s=5))
            senders.append(send)
            sb = blocks.allocate(4)
            db = [20 + 4 * len(transfers) + i for i in range(4)]
            peer.ask("expect", transport=transport, id=transport, blocks=db, deadline_s=30)
            t = send.open(transport, peer.hello["addresses"][transport], sb, db, 64)
            t.layer_done(0)
            t.layer_done(1)
            transfers.append((t, sb))
        time.sleep(0.2)  # the first layers are on their way
        peer.kill()
        for t, sb in transfers:
            start = time.monotonic()
            with pytest.raises(TransferError) as err:
                t.finish(first_token=1, deadline_s=5)
            assert time.monotonic() - start < 5.5, f"{t.request_id}: took {time.monotonic() - start:.1f} s"
            assert t.request_id in str(err.value)
            blocks.free(sb)  # the caller gives the prefill blocks back
        assert blocks.num_free == SRC_LAYOUT.num_blocks
    finally:
        for send in senders:
            send.close()
        if peer.hello.get("shm_path") and os.path.exists(peer.hello["shm_path"]):
            os.unlink(peer.hello["shm_path"])  # the killed receiver could not remove its pool file


def test_sender_killed_mid_transfer_fails_the_receivers_in_time():
    dst = KVCache(LAYOUT, "cpu", shared=True)
    receivers = {t: make_receiver(dst, TransferConfig(transport=t, deadline_s=5, cancel_grace_s=5))
                 for t in TRANSPORTS}
    peer = PeerProcess("sender", "--layout", layout_arg(SRC_LAYOUT), "--seed", str(SEED))
    reserved = BlockPool(LAYOUT.num_blocks)
    try:
        held = {}
        for transport, recv in receivers.items():
            held[transport] = reserved.allocate(3)
            recv.expect(transport, held[transport], deadline_s=2.0)
            assert peer.ask("begin", transport=transport, id=transport, peer=recv.address, src=[0, 1, 2],
                            dst=held[transport], layers=2) == {"sent": 2}
        start = time.monotonic()
        peer.kill()
        for transport, recv in receivers.items():
            a = wait_arrival(recv, transport, 6)
            assert not a.ok and transport in a.error
            reserved.free(held[transport])
        # deadline 2 s; a dead sender cannot confirm, and need not: its socket is gone
        assert time.monotonic() - start < 3.5
        assert reserved.num_free == LAYOUT.num_blocks
    finally:
        peer.kill() if peer.proc.poll() is None else None
        for recv in receivers.values():
            recv.close()
        dst.close()


@pytest.mark.parametrize("transport", ["nixl", "zmq"])
def test_writes_that_do_not_complete_never_block_poll(pair, transport):
    """Once the decode worker accepted, poll() posts the writes and returns; while they are in
    flight it keeps returning at once (the worker's loop serves others), and it fails at the deadline."""
    recv, send = pair(transport, deadline_s=5.0)
    recv.expect("slow", [3, 4], deadline_s=5)
    t = send.open("slow", recv.address, [1, 2], [3, 4], 20)
    t._finish_io = lambda *args: None  # the I/O thread never takes the writes: their Future stays pending
    t.start_finish(1, deadline_s=1.0)
    calls, states, start = [], set(), time.monotonic()
    with pytest.raises(TransferError, match="completion of the KV writes"):
        while True:
            before = time.monotonic()
            assert t.poll() is None
            calls.append(time.monotonic() - before)
            states.add(t.state)
            time.sleep(0.01)
    assert states - {TransferState.OPENED} == {TransferState.LANDING}  # the accept was due, then the writes
    assert len(calls) > 20  # polled many times while the writes were due
    assert max(calls) < 0.2, max(calls)  # none of them waited for the writes
    assert 0.9 < time.monotonic() - start < 3.0
