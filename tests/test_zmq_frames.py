"""The zmq transport's frames of many runs (workers/transfer/frames.py): a fragmented request packs into as
many frames as a contiguous one (qwen2.5-7b at 32k tokens over 1,024 runs of 2 blocks: 224 frames of 8 MiB,
not 28,672 of 64 KiB), counted on the planner and on the sender's GPU path against test_ipc_copies.py's
recording stand-in for torch.cuda (the pools on the meta device), the device gather and scatter run through
Triton's interpreter on the views the two sides pass; moved over real sockets it lands bitwise
as the contiguous request does; and a header whose runs lie (a block outside the reservation, more or
fewer bytes than the runs name, a block twice, a layer past the pool, more runs than a header may hold)
is refused before a byte of its frame is written, on the KV channel and on the --kv-plaintext port."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import msgspec
import pytest
import torch
from test_ipc_copies import QWEN, FakeCuda, Recorder, cuda  # noqa: F401 (cuda: the recording stand-in's fixture)
from test_zmq_streams import HostStream, wait_arrival

from pdserve.protocol import kv as P
from pdserve.settings.keys import new_deployment
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import block_copy, frames
from pdserve.workers.transfer.block_copy import words
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.plan import Plan
from pdserve.workers.transfer.registry import make_receiver, make_sender
from pdserve.workers.transfer.zmq import Slots, ZmqTransfer
from pdserve.workers.transfer.zmq_transfer import gather, scatter, staging_buffer

pytestmark = pytest.mark.timeout(120)

MiB = 2**20
QWEN_BLOCK = 2 * 16 * 4 * 128 * 2  # K and V of 16 tokens, 4 KV heads, head dim 128, bf16: 32 KiB
FRAGMENTED = [(4 * i, 3 * i, 2) for i in range(1024)]  # 2,048 blocks in 1,024 runs of 2 on both sides
LAYOUT = KVLayout(3, 2, 8, "bfloat16", 16, 96)  # 1 KiB blocks
POISON = 0x7FC1  # a NaN pattern: a block never written keeps it


def test_a_fragmented_32k_plan_packs_into_as_many_frames_as_the_contiguous_one():
    per_frame = frames.frame_blocks(QWEN_BLOCK)
    assert per_frame == 256  # 8 MiB
    packed = frames.pack(FRAGMENTED, per_frame)
    assert len(packed) * 28 == 224 == 28 * 2048 * QWEN_BLOCK // frames.FRAME_BYTES  # not 28 x 1,024 runs
    assert all(len(f) == 128 and sum(n for _, _, n in f) == per_frame for f in packed)
    assert [p for f in packed for p in f] == FRAGMENTED  # every run once, in order
    contiguous = frames.pack([(0, 2050, 2048)], per_frame)  # one run per frame, 8 MiB each, as before
    assert contiguous == [[(256 * k, 2050 + 256 * k, 256)] for k in range(8)]
    # a run longer than a frame is cut; short ones share a frame up to its blocks and its runs
    assert frames.pack([(0, 0, 5), (9, 9, 1), (20, 30, 2)], 3) == [[(0, 0, 3)], [(3, 3, 2), (9, 9, 1)], [(20, 30, 2)]]
    assert [len(f) for f in frames.pack([(2 * i, 2 * i, 1) for i in range(7)], 100, max_runs=3)] == [3, 3, 1]
    assert list(frames.block_ids([10, 3, 50], [2, 1, 3])) == [10, 11, 3, 50, 51, 52]


def staged_transfer(runs) -> tuple[ZmqTransfer, list[P.Chunk]]:
    """A zmq transfer on the sender's GPU path (a side stream, pinned slots), the qwen2.5-7b pool at 32k tokens
    on the meta device, its frames' headers recorded instead of sent."""
    src = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    sent: list[P.Chunk] = []
    side = FakeCuda().Stream("side")  # logs nothing itself: the fixture's stand-in logs the copies
    staging = torch.empty(1, 256, QWEN_BLOCK // 8, dtype=torch.int64, device="meta")

    def more_slots() -> bool:
        sender.slots.free.append(torch.empty(8 * MiB, dtype=torch.uint8, device="meta"))
        return True

    sender = SimpleNamespace(cfg=TransferConfig(transport="zmq"), kv=SimpleNamespace(pool=src), stream=side,
                             slots=Slots(), more_slots=more_slots, staging=lambda: (staging, torch.arange(256)),
                             _submit=lambda fn, *args: None)
    plan = Plan("r", tuple(runs), 28, QWEN_BLOCK)
    t = ZmqTransfer(sender, SimpleNamespace(address="tcp://decode", remote=None), plan)
    t._send = lambda chunk, buf, track=False: sent.append(chunk)  # the slot comes back at once
    return t, sent


@pytest.mark.parametrize("kind", ["fragmented", "contiguous"])
def test_the_gpu_path_stages_a_32k_request_as_224_frames_of_8_mib(cuda, kind):  # noqa: F811
    """Fragmented, before: 28,672 device-to-host copies of 64 KiB, one per run and layer, each its own header.
    Now: per frame one gather on the device (block_copy.py's kernel) and one 8 MiB copy into a pinned slot.
    Contiguous: one copy per frame straight from the pool, no gather, as before."""
    t, sent = staged_transfer(FRAGMENTED if kind == "fragmented" else [(0, 2050, 2048)])
    with Recorder(cuda.log, cuda):
        posted = t._post(list(range(28)))
        while t.todo or t.staged:
            t._pump()
    copies = [op for op in cuda.log if op[0] in ("copy_", "copy_blocks")]
    d2h = [op for op in copies if op[0] == "copy_"]
    gathers = [op for op in copies if op[0] == "copy_blocks"]
    assert posted == len(sent) == len(d2h) == 224
    assert all(op[1] == "side" and op[2] == 8 * MiB and op[3] for op in d2h)  # contiguous 8 MiB copies
    assert len(gathers) == (224 if kind == "fragmented" else 0) and all(op[2] == 8 * MiB for op in gathers)
    assert t.copies == len(copies)
    assert all(c.nbytes == 8 * MiB and len(c.runs) == (128 if kind == "fragmented" else 1) for c in sent)
    layer0 = [r for c in sent if c.runs[0].layer == 0 for r in c.runs]
    want = FRAGMENTED if kind == "fragmented" else [(256 * k, 2050 + 256 * k, 256) for k in range(8)]
    assert [(r.dst_start, r.num_blocks) for r in layer0] == [(d, n) for _, d, n in want]


@pytest.mark.parametrize("kernel", [True, False])
def test_the_device_gather_and_scatter_move_a_frames_blocks_exactly(monkeypatch, kernel):
    """The device half of a frame of many runs, on the views the sender and the receiver pass (a layer of the
    pool into the staging buffer; the staging buffer into the pool seen as [1, layers * blocks, words]):
    block_copy.py's kernel through Triton's interpreter (what a GPU runs), and the index ops without it."""
    monkeypatch.setattr(block_copy, "kernel_ready", lambda src, dst: kernel)
    monkeypatch.setattr(frames, "FRAME_BYTES", 8 * 80)  # 80-byte blocks (10 words): 8 to a frame
    g = torch.Generator().manual_seed(9)
    pool = torch.randint(-2**15, 2**15, (3, 20, 2, 4, 1, 5), dtype=torch.int16, generator=g).view(torch.bfloat16)
    src = words(pool)  # [3, 20, 10]
    staged, arange = staging_buffer(src, 80), torch.arange(8)
    assert staged.shape == (1, 8, 10)
    ids = torch.tensor([7, 2, 3, 15, 0])
    assert gather(src[1:2], staged, ids, arange) == (1 if kernel else 2)  # a launch, or a gather and a scatter
    assert torch.equal(staged[0, :5], src[1, ids])
    out = torch.zeros_like(pool)
    flat = words(out).view(1, -1, 10)
    dst_ids = torch.tensor([24, 59, 0, 25, 41])  # layer 1 block 4, layer 2 block 19, ...
    scatter(staged, flat, dst_ids, arange)
    assert torch.equal(flat[0, dst_ids], src[1, ids])
    rest = [i for i in range(60) if i not in dst_ids.tolist()]
    assert (flat[0, rest] == 0).all()


def pools(seed: int) -> tuple[KVCache, KVCache]:
    src, dst = KVCache(LAYOUT, "cpu"), KVCache(LAYOUT, "cpu", shared=True)
    src.pool.view(torch.int16).copy_(torch.randint(-2**15, 2**15, src.pool.shape, dtype=torch.int16,
                                                   generator=torch.Generator().manual_seed(seed)))
    dst.pool.view(torch.int16).fill_(POISON)
    return src, dst


def move(recv, send, rid: str, sb: list[int], db: list[int]):
    recv.expect(rid, db, 10)
    t = send.open(rid, recv.address, sb, db, len(sb) * 16)
    t.finish(3, deadline_s=10)
    return t, wait_arrival(recv, rid)


@pytest.mark.parametrize("path", ["cpu", "staged"])
def test_a_fragmented_request_lands_bitwise_as_the_contiguous_one(monkeypatch, path):
    """The same 30 source blocks, once contiguous in both pools and once scattered over runs of 1-5 blocks
    (frames of 8 blocks: runs cut, runs sharing a frame): the two reservations end bitwise equal. "staged":
    the sender's GPU path (pinned slots, gathers into a staging buffer) with a stand-in side stream."""
    monkeypatch.setattr(frames, "FRAME_BYTES", 8 * LAYOUT.block_bytes)
    lengths = [1, 5, 2, 3, 1, 4, 2, 1, 5, 3, 2, 1]  # 30 blocks
    blocks, sb, db, s, d = sum(lengths), [], [], 34, 88
    for n in lengths:  # the source's runs in order, the destination's backwards; a gap after each: no merging
        sb += range(s, s + n)
        db += range(d - n, d)
        s, d = s + n + 1, d - n - 2
    src, dst = pools(6)
    src.pool[:, sb] = src.pool[:, 0:blocks]  # the contiguous request's bytes, scattered
    if path == "staged":
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    recv = make_receiver(dst, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    send = make_sender(src, TransferConfig(transport="zmq", streams=2, deadline_s=10))
    if path == "staged":
        send.stream = HostStream()
    try:
        _, a = move(recv, send, "contiguous", list(range(blocks)), list(range(2, 2 + blocks)))
        t, b = move(recv, send, "fragmented", sb, db)
        assert a.ok and b.ok, (a, b)
        assert torch.equal(dst.pool[:, db].view(torch.int16), dst.pool[:, 2:2 + blocks].view(torch.int16))
        assert torch.equal(dst.pool[:, db].view(torch.int16), src.pool[:, 0:blocks].view(torch.int16))
        runs = len(t.plan.runs)
        assert runs > 10 and t.writes == LAYOUT.num_layers * len(frames.pack(t.plan.runs, 8)) < runs * LAYOUT.num_layers
        rest = [x for x in range(LAYOUT.num_blocks) if x not in db and not 2 <= x < 2 + blocks]
        assert (dst.pool[:, rest].view(torch.int16) == POISON).all(), "a block outside the reservations was written"
    finally:
        send.close(), recv.close(), dst.close()


# ---- forged headers ----------------------------------------------------------------------------------


def forge(kind: str, chunk: P.Chunk, spare: int) -> P.Chunk:
    """`chunk` (runs of one block each) with its runs lying in one way; `spare`: a block not reserved."""
    runs, nbytes = list(chunk.runs), chunk.nbytes
    r0 = runs[0]
    if kind == "outside":
        runs[0] = P.Run(r0.layer, spare, 1)
    elif kind == "fewer_runs":  # the frame's bytes hold one block more than the runs name
        runs, nbytes = runs[:-1], nbytes - LAYOUT.block_bytes
    elif kind == "header_bytes":  # the runs match the frame, the header's byte count does not
        nbytes += LAYOUT.block_bytes
    elif kind == "twice":
        runs[1] = P.Run(r0.layer, r0.dst_start, 1)
    elif kind == "overlap":  # the first run grown over the block of another, the last dropped: the same bytes
        assert any(r.dst_start == r0.dst_start + 1 for r in runs[1:-1])
        runs = [P.Run(r0.layer, r0.dst_start, 2)] + runs[1:-1]
    elif kind == "layer":
        runs[0] = P.Run(LAYOUT.num_layers, r0.dst_start, 1)
    elif kind == "too_many":
        runs = [P.Run(r0.layer, r0.dst_start, 1)] * (P.MAX_FRAME_RUNS + 1)
    return P.Chunk(chunk.request_id, runs, nbytes)


REASONS = {"outside": "outside its reservation", "fewer_runs": "bytes (its header says",
           "header_bytes": "bytes (its header says", "twice": "named twice", "overlap": "named twice",
           "layer": "layer 3 of a pool of 3 layers",
           "too_many": "did not arrive within"}  # not decoded: its request misses a frame until its deadline


def test_a_header_that_lies_is_refused_and_the_truth_passes():
    reserved = frozenset(range(10, 20))
    ok = P.Chunk("r", [P.Run(0, 10, 2), P.Run(2, 10, 2), P.Run(0, 14, 1)], 5 * LAYOUT.block_bytes)
    assert frames.refusal(ok, ok.nbytes, LAYOUT, reserved) is None  # the same blocks in two layers: fine
    truth = P.Chunk("r", [P.Run(1, b, 1) for b in (10, 13, 11, 15, 17, 19)], 6 * LAYOUT.block_bytes)
    assert frames.refusal(truth, truth.nbytes, LAYOUT, reserved) is None
    for kind, reason in REASONS.items():
        if kind == "too_many":
            continue
        lie = forge(kind, truth, spare=40)
        assert lie != truth, kind
        assert reason in (frames.refusal(lie, truth.nbytes, LAYOUT, reserved) or ""), kind
    # a count no frame could hold is refused by its length before any block is walked
    huge = P.Chunk("r", [P.Run(0, 10, 2**40)], 2**40 * 1024)
    assert "bytes" in frames.refusal(huge, 1024, LAYOUT, reserved)


def test_a_header_names_at_most_max_frame_runs():
    runs = [P.Run(0, i, 1) for i in range(P.MAX_FRAME_RUNS)]
    assert P.decode_to_receiver(P.encode(P.Chunk("r", runs, 1))).runs == runs
    for bad in (runs + [P.Run(0, 0, 1)], [], [P.Run(0, 0, 0)], [P.Run(-1, 0, 1)]):
        with pytest.raises(msgspec.ValidationError):
            P.decode_to_receiver(P.encode(P.Chunk("r", bad, 1)))


@pytest.fixture(scope="module")
def keys():
    return new_deployment()[1]


@pytest.mark.parametrize("port", ["channel", "plaintext"])
@pytest.mark.parametrize("kind", list(REASONS))
def test_a_forged_frame_is_refused_and_writes_nothing(monkeypatch, keys, port, kind):
    """The sender's first frame (layer 0, 12 runs of one block) leaves with a forged header: the request
    fails, no block of that frame is written, nothing outside the reservation is. One stream: the frames
    arrive in order, so the frames after a refused one are dropped."""
    src, dst = pools(8)
    sb, db, spare = list(range(0, 24, 2)), [40, 47, 41, 50, 43, 51, 44, 42, 49, 46, 45, 48], 39
    real = ZmqTransfer._send
    forged = []

    def send_forged(self, chunk, buf, track=False):
        if not forged:
            assert len(chunk.runs) == 12 and chunk.runs[0].layer == 0
            chunk = forge(kind, chunk, spare)
            forged.append(chunk)
        return real(self, chunk, buf, track)

    monkeypatch.setattr(ZmqTransfer, "_send", send_forged)
    cfg = dict(transport="zmq", streams=1, deadline_s=10, keys=keys if port == "plaintext" else None,
               plaintext=port == "plaintext")
    recv, send = make_receiver(dst, TransferConfig(**cfg)), make_sender(src, TransferConfig(**cfg))
    try:
        recv.expect("f", db, 1.5 if kind == "too_many" else 10)
        t = send.open("f", recv.address, sb, db, 12 * 16)
        with pytest.raises(TransferError):
            t.finish(3, deadline_s=10)
        a = wait_arrival(recv, "f")
        assert forged and not a.ok and REASONS[kind] in a.error, a.error
        assert (dst.pool[0, db].view(torch.int16) == POISON).all(), "the forged frame was written"
        rest = [b for b in range(LAYOUT.num_blocks) if b not in db]
        assert (dst.pool[:, rest].view(torch.int16) == POISON).all(), "a block outside the reservation was written"
        _, ok = move(recv, send, "after", [1, 3], [20, 30])  # the receiver goes on
        assert ok.ok and torch.equal(dst.pool[:, [20, 30]].view(torch.int16), src.pool[:, [1, 3]].view(torch.int16))
    finally:
        send.close(), recv.close(), dst.close()
