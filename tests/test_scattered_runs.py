"""A request over a fragmented pool: many short runs on both sides (every transport, both modes),
moved exactly and nothing outside the reservation touched; ipc moves them by block index (a handful
of copies, not one per run and layer), zmq in frames of many runs (one per layer here, not one per run and
layer; tests/test_zmq_frames.py has the rest)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.settings.worker import TransferConfig
from pdserve.protocol.enums import MODES, TRANSPORTS
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.transfer import ipc
from pdserve.workers.transfer.registry import make_receiver, make_sender

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(3, 2, 8, "bfloat16", 16, 96)
POISON = 0x7FC1  # a NaN pattern: a block never written keeps it


def scattered(seed: int, n: int) -> tuple[list[int], list[int]]:
    """n source blocks (every other one) and n destination blocks in a shuffled order: n runs."""
    rng = random.Random(seed)
    dst = list(range(LAYOUT.num_blocks))
    rng.shuffle(dst)
    return list(range(0, 2 * n, 2)), dst[:n]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_scattered_request_arrives_exactly(transport, mode):
    src, dst = KVCache(LAYOUT, "cpu"), KVCache(LAYOUT, "cpu", shared=True)
    src.pool.view(torch.int16).copy_(torch.randint(-2**15, 2**15, src.pool.shape, dtype=torch.int16,
                                                   generator=torch.Generator().manual_seed(3)))
    dst.pool.view(torch.int16).fill_(POISON)
    recv = make_receiver(dst, TransferConfig(transport=transport, deadline_s=20))
    send = make_sender(src, TransferConfig(transport=transport, mode=mode, deadline_s=20))
    try:
        sb, db = scattered(11, 40)
        recv.expect("frag", db, 20)
        t = send.open("frag", recv.address, sb, db, 40 * 16 - 3)
        for layer in range(LAYOUT.num_layers):
            t.layer_done(layer)
        stats = t.finish(9, deadline_s=20)
        end = time.monotonic() + 20
        arrivals = []
        while not arrivals and time.monotonic() < end:
            arrivals = recv.poll()
            time.sleep(0.005)
        assert arrivals and arrivals[0].ok, arrivals
        assert stats.runs == 40 > ipc.INDEX_RUNS
        assert torch.equal(src.pool[:, sb].view(torch.int16), dst.pool[:, db].view(torch.int16))
        rest = [b for b in range(LAYOUT.num_blocks) if b not in db]
        assert (dst.pool[:, rest].view(torch.int16) == POISON).all(), "a block outside the reservation was written"
        if transport == "ipc":  # on the CPU a gather and a scatter per layer (block_copy.copy), either mode
            assert stats.copies == 2 * LAYOUT.num_layers, stats.copies
        if transport == "zmq":  # the 40 runs of 1 KiB blocks share a frame per layer; one per run and layer before
            assert t.writes == LAYOUT.num_layers, t.writes
    finally:
        send.close(), recv.close(), dst.close()
