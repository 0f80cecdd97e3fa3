"""The zmq transport's data frames: which blocks each one carries (integer bookkeeping, no torch).

A frame carries up to `per_frame` blocks of one layer (frame_blocks: FRAME_BYTES of them) taken from any
number of the plan's runs, at most P.MAX_FRAME_RUNS; its header (protocol/kv.py's Chunk) lists them as
(layer, dst_start, num_blocks) in the order their bytes come.

    sender    pack(runs, per_frame)           one layer's runs as frames of pieces (src, dst, n), the same for
                                              every layer: a run of per_frame blocks or more is cut into pieces
                                              of per_frame, each a frame of its own (a contiguous request: one
                                              run per frame); shorter pieces share a frame while they fit
              block_ids(starts, counts)       the block ids a frame's pieces name, in frame order (its gather)
    receiver  refusal(chunk, nbytes, layout, reserved)  why a frame may not be written, or None
              dst_index(chunk, num_blocks)    the [layer * num_blocks + block] ids of its blocks (its scatter)

What the pack saves (qwen2.5-7b, 32k tokens, 32 KiB blocks, a pool fragmented into 1,024 runs of 2 blocks):
one frame per run and layer was 28,672 frames of 64 KiB, each with its own staging copy, header, ZMQ message
and pool write; packed, 224 frames of 8 MiB, as many as the contiguous request's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.protocol import kv as P

FRAME_BYTES = 8 * 2**20  # at most this per frame (one block more where a single block is larger)

Piece = tuple[int, int, int]  # (src_start, dst_start, num_blocks): a run of the plan or a piece of one


def frame_blocks(block_bytes: int) -> int:
    """Blocks of one layer a frame holds at most (per_frame)."""
    return max(1, FRAME_BYTES // block_bytes)


def max_frame_bytes(block_bytes: int) -> int:
    return frame_blocks(block_bytes) * block_bytes


def pack(runs: Sequence[Piece], per_frame: int, max_runs: int = P.MAX_FRAME_RUNS) -> list[list[Piece]]:
    """One layer's frames: each at most per_frame blocks in at most max_runs pieces, in the runs' order."""
    out: list[list[Piece]] = []
    held = per_frame  # blocks in out[-1]: none open yet
    for s, d, n in runs:
        for k in range(0, n, per_frame):
            m = min(per_frame, n - k)
            if held + m > per_frame or len(out[-1]) >= max_runs:
                out.append([])
                held = 0
            out[-1].append((s + k, d + k, m))
            held += m
    return out


def block_ids(starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """[sum(counts)] int64: starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1 for each i in turn."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts  # where each run's blocks begin in the frame
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def refusal(chunk: P.Chunk, nbytes: int, layout, reserved: frozenset[int]) -> str | None:
    """Why the frame `chunk` heads (nbytes of data) may not be written into the blocks `reserved`, or None.
    Checked in this order, so no check walks more blocks than the frame's bytes hold: the bytes against the
    runs' length, each run's layer and blocks against the layout and the reservation, no block twice."""
    total = sum(r.num_blocks for r in chunk.runs)
    want = total * layout.block_bytes
    if chunk.nbytes != want or nbytes != want:
        return (f"{nbytes} bytes (its header says {chunk.nbytes}) where its {len(chunk.runs)} runs name {total} "
                f"blocks, {want} bytes")
    for r in chunk.runs:
        if not r.layer < layout.num_layers:
            return f"a run in layer {r.layer} of a pool of {layout.num_layers} layers"
        if not reserved.issuperset(range(r.dst_start, r.dst_start + r.num_blocks)):
            return f"blocks {r.dst_start}..{r.dst_start + r.num_blocks - 1} of layer {r.layer} outside its reservation"
    if len(chunk.runs) > 1:
        spans = sorted((r.layer, r.dst_start, r.num_blocks) for r in chunk.runs)
        for (la, da, na), (lb, db, _) in zip(spans, spans[1:]):
            if la == lb and da + na > db:
                return f"block {db} of layer {lb} named twice"
    return None


def dst_index(chunk: P.Chunk, num_blocks: int) -> np.ndarray:
    """The frame's blocks as ids into the pool seen as [layers * blocks, ...], in the frame's order."""
    return block_ids([r.layer * num_blocks + r.dst_start for r in chunk.runs], [r.num_blocks for r in chunk.runs])
