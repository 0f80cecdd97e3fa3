"""The copies between GPU blocks and host slots, and the record of one held slot (_Entry).

HostCopies is a part of HostTier (its base class), kept here so that host.py reads as
bookkeeping: this is the only code that knows the tensors' shapes, the staging buffers and the
CUDA kernels. It uses what HostTier.__init__ sets up: layout, device, cuda, entry_bytes,
num_slots, host, _row, _stage, _stage_out, _stage_in.

Copies (CUDA; never a host sync on the caller's thread): a store records an event on the current
stream, a side stream waits on it, gathers the blocks into a device staging buffer (`pool` viewed
as [blocks, layers, row]: one strided copy per run of consecutive blocks, or one `index_select`
when they are scattered) and moves each run of consecutive host slots with one `copy_`. A load is
the mirror on a second, higher-priority stream (runs of slots -> staging -> the blocks). Host slots are [slots, layers, row]
so a run of slots is one contiguous range: one DMA per run, one file write per run. Slot reuse
is ordered after every pending copy that touched the slot (stream waits for GPU copies, a host
wait on the tiers' own threads before a file read lands in it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from pdserve.workers.engine.block_pool import runs


@dataclass
class _Entry:
    slot: int
    written: object | None = None  # CUDA event: the store's copy into the slot (None: landed)
    read: object | None = None  # CUDA event: the latest copy out of the slot
    discarded: bool = False  # discarded while its disk write was queued


class HostCopies:
    """HostTier's copies (see the module docstring); not made on its own."""

    def _blocks_view(self, pool: torch.Tensor) -> torch.Tensor:
        L = self.layout
        if pool.dtype != L.torch_dtype or pool.shape[0] != L.num_layers or tuple(pool.shape[2:]) != L.shape[2:]:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match the tier's layout {L.describe()}")
        return pool.view(L.num_layers, pool.shape[1], self._row).transpose(0, 1)  # [blocks, layers, row]

    def _index(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.long)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)  # on the side stream: no host sync

    def _copy_out(self, pool: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        view = self._blocks_view(pool)
        for c in range(0, len(blocks), self._stage):
            b, s = blocks[c:c + self._stage], slots[c:c + self._stage]
            self._gather(view, b, self._stage_out[:len(b)])
            off = 0
            for start, n in runs(s):
                self.host[start:start + n].copy_(self._stage_out[off:off + n], non_blocking=True)
                off += n

    def _copy_in(self, pool: torch.Tensor, src: torch.Tensor, rows: list[int], blocks: list[int]) -> None:
        """src: [rows, layers, row] on the host; rows[i] lands in GPU block blocks[i]."""
        view = self._blocks_view(pool)
        for c in range(0, len(blocks), self._stage):
            r, b = rows[c:c + self._stage], blocks[c:c + self._stage]
            off = 0
            for start, n in runs(r):
                self._stage_in[off:off + n].copy_(src[start:start + n], non_blocking=True)
                off += n
            self._scatter(view, b, self._stage_in[:len(b)])

    # a few runs of consecutive blocks: one strided copy each (the usual case: the engine hands out
    # contiguous extents); scattered blocks: one index kernel (CPU index_select over this strided
    # view is ~10x slower than a strided copy, and each copy_ costs a launch on CUDA)
    MAX_RUN_COPIES = 8

    def _gather(self, view: torch.Tensor, blocks: list[int], out: torch.Tensor) -> None:
        spans = runs(blocks)
        if len(spans) > self.MAX_RUN_COPIES:
            torch.index_select(view, 0, self._index(blocks), out=out)
            return
        off = 0
        for start, n in spans:
            out[off:off + n].copy_(view[start:start + n])
            off += n

    def _scatter(self, view: torch.Tensor, blocks: list[int], src: torch.Tensor) -> None:
        spans = runs(blocks)
        if len(spans) > self.MAX_RUN_COPIES:
            view.index_copy_(0, self._index(blocks), src)
            return
        off = 0
        for start, n in spans:
            view[start:start + n].copy_(src[off:off + n])
            off += n

    def _event(self, stream, timing: bool = False):
        if stream is None:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def _probe(self) -> float:
        """Host -> device bandwidth of one copy of up to 32 MiB of slots into staging (GB/s), at start."""
        n = max(1, min(self._stage, self.num_slots, (32 << 20) // self.entry_bytes))
        with torch.inference_mode():
            self._stage_in[:n].copy_(self.host[:n], non_blocking=True)  # warm-up
            best = math.inf
            for _ in range(3):
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                self._stage_in[:n].copy_(self.host[:n], non_blocking=True)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                best = min(best, time.perf_counter() - start)
        return n * self.entry_bytes / max(best, 1e-9) / 1e9
