"""nixl's staged path for a fragmented request (workers/transfer/staging.py, nixl_staging.py): a request of
many short runs is gathered into the sender's staging range, written with one descriptor per span of layers
into the range the receiver granted, and scattered there: O(layers) descriptors where run by run was
O(runs x layers), bitwise exact, nothing outside the reservation touched. The staging space goes back on
every path (success, a cancel, an abort, a closed sender, a killed one), a request that finds no room goes
run by run, and a staging offset or grant that a peer sends outside what was granted is refused. Both
agents live in this process but for the killed sender's (fine for correctness; never for timing)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.protocol import kv as P
from pdserve.protocol.enums import MODES
from pdserve.settings.worker import TransferConfig
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import nixl_staging, staging
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_receiver, make_sender
from pdserve.workers.transfer.staging import ALIGN, Space, grant_refusal, groups, note_layers, stages
from test_transfer import PeerProcess  # tests/transfer_peer.py in a child process
from transfer_peer import layout_arg

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(3, 2, 8, "bfloat16", 16, 96)  # blocks of 1 KiB a layer
POISON = 0x7FC1  # a NaN pattern: a block never written keeps it
RUNS = 40


# ---- the bookkeeping (no torch) ---------------------------------------------------------------


def test_space_hands_out_aligned_ranges_and_merges_them_back():
    space = Space(4 * ALIGN)
    a, b, c = space.take(10), space.take(ALIGN + 1), space.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and space.free_bytes == 0 and space.take(1) is None
    space.give(b)
    assert space.take(3 * ALIGN) is None and space.take(2 * ALIGN) == ALIGN  # the freed range
    for offset in (a, ALIGN, c):
        space.give(offset)
    assert space.free_bytes == 4 * ALIGN and space.held == 0 and space.take(4 * ALIGN) == 0  # merged whole
    with pytest.raises(KeyError):
        Space(ALIGN).give(0)  # never taken


def test_only_many_short_runs_stage():
    short = [(2 * i, 3 * i, 1) for i in range(staging.STAGE_RUNS + 1)]
    assert stages(short, 32 * 1024, "VRAM")
    assert not stages(short[:staging.STAGE_RUNS], 32 * 1024, "VRAM")  # a few runs keep their direct descriptors
    assert not stages([(0, 0, 1000)], 32 * 1024, "VRAM")  # contiguous
    long = [(1000 * i, 1000 * i, 200) for i in range(8)]  # 200 blocks of 32 KiB a run: 6.25 MiB
    assert not stages(long, 32 * 1024, "VRAM")
    # host memory: only runs of a few KB (descriptors there cost less than the gather and scatter)
    assert not stages(short, 32 * 1024, "DRAM") and stages(short, 1024, "DRAM")
    assert groups([0, 1, 2, 5, 6], per_write=2) == [(0, 2), (2, 1), (5, 2)]
    assert groups([3], per_write=4) == [(3, 1)]


def test_a_note_and_a_grant_are_checked_against_what_was_granted():
    seen: set[int] = set()
    assert note_layers(1024, 3 * 100, 1124, 200, 100, seen) == (1, 2)
    for offset, nbytes, why in ((924, 100, "outside its grant"), (1324, 100, "outside its grant"),
                                (1224, 200, "outside its grant"), (1124, 0, "outside its grant"),
                                (1074, 100, "not whole layers"), (1124, 150, "not whole layers")):
        assert why in note_layers(1024, 300, offset, nbytes, 100, seen), (offset, nbytes)
    assert "layer 1 written twice" in note_layers(1024, 300, 1024, 200, 100, {1})
    assert grant_refusal(256, 1000, 4096, 1000) is None
    assert "a grant of 999 bytes" in grant_refusal(256, 999, 4096, 1000)
    assert "not on an 8-byte boundary" in grant_refusal(260, 1000, 4096, 1000)
    assert "in a staging region of 4096 bytes" in grant_refusal(3840, 1000, 4096, 1000)


# ---- the transport ----------------------------------------------------------------------------


def scattered(seed: int, n: int) -> tuple[list[int], list[int]]:
    """n source blocks (every other one) and n destination blocks in a shuffled order: n runs."""
    rng = random.Random(seed)
    dst = list(range(LAYOUT.num_blocks))
    rng.shuffle(dst)
    return list(range(0, 2 * n, 2)), dst[:n]


class Pair:
    """A nixl sender and receiver on CPU pools in this process; the source pool random, the destination
    poisoned."""

    def __init__(self, mode: str, recv_staging_gb: float | None = None):
        self.src, self.dst = KVCache(LAYOUT, "cpu"), KVCache(LAYOUT, "cpu")
        self.src.pool.view(torch.int16).copy_(torch.randint(-2**15, 2**15, self.src.pool.shape, dtype=torch.int16,
                                                            generator=torch.Generator().manual_seed(3)))
        self.dst.pool.view(torch.int16).fill_(POISON)
        self.recv = make_receiver(self.dst, TransferConfig(transport="nixl", deadline_s=10, cancel_grace_s=10,
                                                           staging_gb=recv_staging_gb))
        self.send = make_sender(self.src, TransferConfig(transport="nixl", mode=mode, deadline_s=10))

    def open(self, rid: str, src: list[int], dst: list[int]):
        self.recv.expect(rid, dst, 10)
        return self.send.open(rid, self.recv.address, src, dst, len(src) * LAYOUT.block_size)

    def exact(self, src: list[int], dst: list[int]) -> bool:
        return torch.equal(self.src.pool[:, src].view(torch.int16), self.dst.pool[:, dst].view(torch.int16))

    def untouched(self, dst: list[int]) -> bool:
        rest = [b for b in range(LAYOUT.num_blocks) if b not in dst]
        return bool((self.dst.pool[:, rest].view(torch.int16) == POISON).all())

    def staging_free(self) -> bool:
        """Both regions whole again (the sender gives its range back on its I/O thread, once the transfer is over)."""
        spaces = (self.recv.staging.space, self.send.staging.space)
        return until(lambda: all(s.held == 0 and s.free_bytes == s.nbytes for s in spaces))

    def close(self) -> None:
        self.send.close(), self.recv.close()


def arrival(recv, rid: str, timeout_s: float = 10.0):
    """The request's arrival that lets its blocks go (a fenced one's notice, released=False, comes first);
    those of other requests are kept for their turn."""
    kept = recv.__dict__.setdefault("kept_arrivals", {})
    end = time.monotonic() + timeout_s
    while rid not in kept and time.monotonic() < end:
        kept.update({a.request_id: a for a in recv.poll() if a.released})
        time.sleep(0.005)
    if rid not in kept:
        raise AssertionError(f"no arrival for {rid} within {timeout_s} s")
    return kept.pop(rid)


def until(done, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not done() and time.monotonic() < end:
        time.sleep(0.005)
    return done()


def scattered_layers(recv, rid: str) -> int:
    """Layers of the request's staging grant the receiver scattered so far (0 before its grant)."""
    grant = recv.grants.by_request.get(rid)
    return 0 if grant is None else len(grant.seen)


@pytest.mark.parametrize("mode", MODES)
def test_a_fragmented_request_is_staged_exactly_with_a_descriptor_per_write(mode):
    pair = Pair(mode)
    try:
        src, dst = scattered(11, RUNS)
        t = pair.open("frag", src, dst)
        for layer in range(LAYOUT.num_layers):
            t.layer_done(layer)
        stats = t.finish(9, deadline_s=10)
        assert arrival(pair.recv, "frag").ok
        assert stats.runs == RUNS and t.staged is not None and t.staged.grant is not None
        # run by run it was a descriptor per run and layer (120 here); staged, one per write: one per layer in
        # layer mode, one for the whole request in bulk (its 120 KiB under staging.WRITE_BYTES)
        assert t.descriptors == (LAYOUT.num_layers if mode == "layer" else 1) == t.writes, t.descriptors
        assert pair.exact(src, dst) and pair.untouched(dst)
        assert pair.staging_free()

        t = pair.open("contiguous", list(range(8)), list(range(50, 58)))  # one run: run by run, no staging
        for layer in range(LAYOUT.num_layers):
            t.layer_done(layer)
        t.finish(9, deadline_s=10)
        assert arrival(pair.recv, "contiguous").ok and t.staged is None
        assert t.descriptors == LAYOUT.num_layers and pair.exact(list(range(8)), list(range(50, 58)))
    finally:
        pair.close()


def test_no_room_for_staging_means_run_by_run():
    """The receiver's region holds one request: a second one at the same time goes run by run, exactly; a
    receiver without a region (--kv-staging-gb 0), or with one too small for the request, is never asked."""
    need = LAYOUT.num_layers * 20 * LAYOUT.block_bytes
    pair = Pair("layer", recv_staging_gb=need / 2**30)
    try:
        (src_a, dst_a), (src_b, dst_b) = scattered(5, 20), scattered(5, 40)
        dst_b = [b for b in dst_b if b not in dst_a][:20]
        a = pair.open("a", src_a, dst_a)
        for layer in range(LAYOUT.num_layers):
            a.layer_done(layer)
        assert a.wait_accepted(5) and a.staged.grant is not None
        b = pair.open("b", [s + 1 for s in src_a], dst_b)  # the odd blocks: another run of 20
        b.finish(9, deadline_s=10)
        a.finish(9, deadline_s=10)
        assert arrival(pair.recv, "a").ok and arrival(pair.recv, "b").ok
        assert b.staged is None and b.descriptors == 20 * LAYOUT.num_layers  # run by run
        assert a.descriptors == LAYOUT.num_layers
        assert pair.exact(src_a, dst_a) and pair.exact([s + 1 for s in src_a], dst_b) and pair.staging_free()
    finally:
        pair.close()
    for gb in (0, 2**-20):  # no region; one of 1 KiB, smaller than any request
        pair = Pair("bulk", recv_staging_gb=gb)
        try:
            assert (pair.recv.staging is None) == (gb == 0)
            src, dst = scattered(7, RUNS)
            t = pair.open("r", src, dst)
            t.finish(9, deadline_s=10)
            assert arrival(pair.recv, "r").ok and t.staged is None and pair.exact(src, dst)
        finally:
            pair.close()


@pytest.mark.parametrize("end", ["cancel", "abort", "sender closed"])
def test_staging_goes_back_when_a_transfer_fails(end):
    pair = Pair("layer")
    try:
        src, dst = scattered(13, RUNS)
        t = pair.open("r", src, dst)
        t.layer_done(0)
        assert t.wait_accepted(5) and t.staged.grant is not None
        assert until(lambda: scattered_layers(pair.recv, "r") == 1)  # layer 0 written and scattered: mid-transfer
        if end == "cancel":
            pair.recv.cancel("r")
            with pytest.raises(TransferError, match="stopped waiting"):
                t.finish(9, deadline_s=10)
        elif end == "abort":
            t.abort("the prefill failed")
        else:
            pair.send.close()
            assert pair.send.staging.space.held == 0  # the receiver's fence waits for this process's death
            return
        assert not arrival(pair.recv, "r").ok
        assert pair.staging_free()
    finally:
        pair.close()


def test_staging_goes_back_when_the_sender_dies():
    """A prefill process killed mid-transfer (two layers written): the decode worker gives the request up at
    its deadline and frees its blocks and its staging range once that process's death is confirmed."""
    dst = KVCache(LAYOUT, "cpu")
    recv = make_receiver(dst, TransferConfig(transport="nixl", deadline_s=5, cancel_grace_s=5))
    peer = PeerProcess("sender", "--layout", layout_arg(LAYOUT), "--seed", "1")
    try:
        src, blocks = scattered(23, 20)
        recv.expect("r", blocks, deadline_s=2.0)
        assert peer.ask("begin", transport="nixl", id="r", peer=recv.address, src=src, dst=blocks, layers=2) == {
            "sent": 2}
        assert until(lambda: scattered_layers(recv, "r") == 2) and recv.staging.space.held == 1
        peer.kill()
        assert not arrival(recv, "r", 6).ok
        assert recv.staging.space.held == 0 and recv.staging.space.free_bytes == recv.staging.space.nbytes
    finally:
        peer.kill() if peer.proc.poll() is None else None
        recv.close()


def test_a_staged_write_outside_its_grant_is_refused(monkeypatch):
    """A sender whose note names bytes past the grant (inside the staging region, where another request's
    range would be): the receiver scatters nothing, fails the request and cancels it; the blocks keep their
    poison; both ranges go back once the sender confirmed."""
    real = nixl_staging.StagedSend.write_rows

    def past_the_grant(self, first, count, *args):
        local, remote, note = real(self, first, count, *args)
        return local, remote, P.StagedNote(note.request_id, note.seq, self.grant.offset + self.grant.nbytes,
                                           note.nbytes)

    monkeypatch.setattr(nixl_staging.StagedSend, "write_rows", past_the_grant)
    pair = Pair("bulk", recv_staging_gb=3 * LAYOUT.num_layers * RUNS * LAYOUT.block_bytes / 2**30)
    try:
        src, dst = scattered(17, RUNS)
        t = pair.open("r", src, dst)
        with pytest.raises(TransferError, match="outside its grant"):
            t.finish(9, deadline_s=10)
        a = arrival(pair.recv, "r")
        assert not a.ok and "refused a staged write" in a.error and "outside its grant" in a.error
        assert pair.untouched([]) and pair.staging_free()
    finally:
        pair.close()


def test_a_grant_outside_the_staging_region_is_refused(monkeypatch):
    """A receiver that grants bytes its region does not have: the sender writes nothing and fails the request;
    the receiver's real range goes back at the Abort."""
    real = nixl_staging.Grants.take

    def beyond(self, exp, nbytes, layer_bytes):
        grant = real(self, exp, nbytes, layer_bytes)
        return P.StagingGrant(self.staging.space.nbytes - ALIGN, grant.nbytes)

    monkeypatch.setattr(nixl_staging.Grants, "take", beyond)
    pair = Pair("bulk")
    try:
        src, dst = scattered(19, RUNS)
        t = pair.open("r", src, dst)
        with pytest.raises(TransferError, match="cannot use .*in a staging region of"):
            t.finish(9, deadline_s=10)
        assert t.descriptors == 0 and not arrival(pair.recv, "r").ok
        assert pair.untouched([]) and pair.staging_free()
    finally:
        pair.close()
