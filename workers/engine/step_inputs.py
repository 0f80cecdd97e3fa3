"""A step's inputs, built on the host with NumPy in one place (`build`, for every forward: eager,
piecewise and decode graphs): token ids, positions, the pool rows their K/V go to, block tables,
the rows whose logits are kept, the rows whose prompt logprobs are asked.

Per-step host work must not grow with the contexts' length: a request's block list is mirrored
once in a NumPy row (`block_row`), extended in place as the request gains blocks, so a block
table of 32 requests at 16k context (32 x 1024 ids) is 32 slice copies, not 32k Python ints
turned into a tensor every step.

Rows of a step come in the order attention.py expects: decode rows first, then prompt chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.workers.engine.request import Request, decode_row


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A NumPy array on the device, through pinned memory on CUDA: a copy from pageable memory would
    wait for the stream's work first, and the engine launches a step while the previous one runs.
    (PyTorch's pinned allocator keeps the staging block until the copy has completed.)"""
    t = torch.from_numpy(arr)
    if device.type != "cuda":
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


def apply_feed(ids: torch.Tensor, feed) -> None:
    """Write the device-side tokens of `feed` ((rows, src, tokens): overlap.feed) into a step's input ids."""
    if feed is None:
        return
    rows, src, tokens = feed
    dev = ids.device
    ids.index_copy_(0, to_device(np.asarray(rows, dtype=np.int64), dev),
                    tokens.index_select(0, to_device(np.asarray(src, dtype=np.int64), dev)))


class _Row:
    """NumPy copy of one block list (the list object itself is kept to tell when it is replaced)."""

    __slots__ = ("src", "arr", "n")

    def __init__(self, ids: list[int]):
        self.src = ids
        self.arr = np.empty(max(16, 2 * len(ids)), dtype=np.int64)
        self.arr[:len(ids)] = ids
        self.n = len(ids)

    def extend(self) -> None:
        ids = self.src
        if len(ids) > len(self.arr):
            grown = np.empty(2 * len(ids), dtype=np.int64)
            grown[:self.n] = self.arr[:self.n]
            self.arr = grown
        self.arr[self.n:len(ids)] = ids[self.n:]
        self.n = len(ids)


def block_row(req: Request) -> np.ndarray:
    """req.block_ids as int64, from its mirror (block lists only grow at the end or are replaced)."""
    row = req.table_row
    ids = req.block_ids
    if row is None or row.src is not ids or row.n > len(ids):
        row = req.table_row = _Row(ids)
    elif row.n < len(ids):
        row.extend()
    return row.arr[:row.n]


def block_table(reqs: list[Request], width: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """[len(reqs), width] int64 block ids, zero padded (width: the longest list)."""
    rows = [block_row(r) for r in reqs]
    width = width or max(len(r) for r in rows)
    if out is None:
        out = np.zeros((len(reqs), width), dtype=np.int64)
    else:
        out[:len(reqs), :width] = 0
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def slots(blocks_at: np.ndarray, positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of K and V for the given positions in a layer viewed as [blocks * 2 * block_size, heads, dim]."""
    k = blocks_at * (2 * block_size) + positions % block_size
    return k, k + block_size


@dataclass
class StepInputs:
    """A step of decodes and prompt chunks, as the forward and attention.py's StepState want it."""
    ids: np.ndarray  # [T] token ids
    positions: np.ndarray  # [T]
    k_slots: np.ndarray  # [T]
    v_slots: np.ndarray  # [T]
    keep: np.ndarray  # [K] rows whose logits are returned: requests reaching num_tokens, in work order
    decodes: list[Request]  # rows [0, len(decodes))
    ctx_lens: np.ndarray  # [D] decode rows' keys, their new token included
    table: np.ndarray  # [D, width] decode rows' block ids, zero padded
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (start, end) rows of chunks from position 0
    prefix: list[tuple[int, int, int, int]] = field(default_factory=list)  # (seq, first row, tokens, first position)
    prefix_reqs: list[Request] = field(default_factory=list)
    prefix_table: np.ndarray | None = None  # [len(prefix), width] block ids of the prefix chunks' requests
    last_row: dict[int, int] = field(default_factory=dict)  # id(request) -> its last row
    asks: list[tuple[Request, list[int], int]] = field(default_factory=list)  # (request, rows, k): prompt logprobs


def build(work: list[tuple[Request, int]], block_size: int, table: np.ndarray | None = None) -> StepInputs:
    """The inputs of one forward over `work` ((request, n): positions [num_computed, num_computed + n)),
    every path's (eager, piecewise, decode graphs). table: where the decode rows' block table goes (a
    decode graph's buffer, its width the graph's), else a new array as wide as the longest."""
    bs = block_size
    decodes = [r for r, n in work if decode_row(r, n)]
    chunks = [(r, n) for r, n in work if not decode_row(r, n)]
    nd = len(decodes)
    total = nd + sum(n for _, n in chunks)
    ids = np.empty(total, dtype=np.int64)
    pos = np.empty(total, dtype=np.int64)
    blocks_at = np.empty(total, dtype=np.int64)
    at = np.fromiter((r.num_computed for r in decodes), dtype=np.int64, count=nd)
    ids[:nd] = [r.token_at(r.num_computed) for r in decodes]
    pos[:nd] = at
    if nd:
        table = block_table(decodes, table.shape[1] if table is not None else None, table)[:nd]
        blocks_at[:nd] = table[np.arange(nd), at // bs]
    else:
        table = np.zeros((0, 0), dtype=np.int64)
    last = {id(r): i for i, r in enumerate(decodes)}
    inp = StepInputs(ids, pos, blocks_at, blocks_at, np.empty(0, dtype=np.int64), decodes, at + 1, table)
    row = nd
    for r, n in chunks:
        a = r.num_computed
        ids[row:row + n] = r.tokens(a, a + n)
        pos[row:row + n] = np.arange(a, a + n)
        blocks_at[row:row + n] = block_row(r)[pos[row:row + n] // bs]
        if a == 0:
            inp.fresh.append((row, row + n))
        else:
            inp.prefix.append((len(inp.prefix_reqs), row, n, a))
            inp.prefix_reqs.append(r)
        row += n
        last[id(r)] = row - 1
    if inp.prefix_reqs:
        inp.prefix_table = block_table(inp.prefix_reqs)
    inp.k_slots, inp.v_slots = slots(blocks_at, pos, bs)
    inp.keep = np.array([last[id(r)] for r, n in work if r.num_computed + n == r.num_tokens], dtype=np.int64)
    inp.last_row = last
    for r, n in work:
        wanted = prompt_positions(r, n)
        if wanted:
            first_row = last[id(r)] - n + 1  # the row of position num_computed
            inp.asks.append((r, [first_row + p - r.num_computed for p in wanted], r.params.prompt_logprobs))
    return inp


def prompt_positions(r: Request, n: int) -> range:
    """Positions of a step of (r, n) whose logits r's prompt logprobs still need: p < prompt length - 1
    (position p predicts prompt token p + 1), from the first not yet computed. Empty unless the request
    asked, and when positions before this step were skipped (a cached prefix): the engine then finds
    the list short and fails the request rather than report a gap."""
    if r.params.prompt_logprobs is None or r.output_ids:  # token 1 exists: they were made (or came from
        return range(0)  # a prefill worker); a recompute after preemption does not redo them
    have = len(r.prompt_logprobs)  # prompt tokens 1..have are done: position `have` is the next one needed
    if r.num_computed > have:
        return range(0)
    return range(have, min(r.num_computed + n, len(r.prompt_ids) - 1))
