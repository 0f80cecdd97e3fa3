"""The copies between GPU blocks and host slots, both ways, and the record of one held slot (_Entry).

HostCopies is a part of HostTier (its base class), kept here so that host.py reads as
bookkeeping: this is the only code that knows the tensors' shapes, the staging buffers and the
CUDA kernels. It uses what HostTier.__init__ sets up: layout, device, cuda, entry_bytes,
num_slots, host, _row, _stage, _stage_out, _stage_in (and, for a load, the tier's locks, entries,
slots and the tier below).
    load(pool, [(hash, gpu_block)]) -> LoadHandle   copy those entries into the blocks, async: host
                                              entries at once on the load stream; entries below (disk)
                                              read and verified by a thread into host slots (promoted),
                                              then copied in (load.py: the handle)
    probe_gbps() -> float                     host -> device bandwidth of one copy into staging

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

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.workers.engine.block_pool import runs
from pdserve.workers.engine.kv_tiers.load import LoadHandle

log = logging.getLogger("pdserve.kv_tiers")


@dataclass
class _Entry:
    slot: int
    written: object | None = None  # CUDA event: the store's copy into the slot (None: landed)
    read: object | None = None  # CUDA event: the latest copy out of the slot
    discarded: bool = False  # discarded while its write below was queued


class HostCopies:
    """HostTier's copies and its load path (see the module docstring); not made on its own."""

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

    def probe_gbps(self) -> float:
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

    # ---- the load path (HostTier.load): host entries at once, entries below through a thread -------

    def load(self, pool: torch.Tensor, items: list[tuple[bytes, int]]) -> LoadHandle:
        """Copy these entries into the given GPU blocks, asynchronously. Host entries go at once on
        the load stream; entries below (disk) are read and verified by a thread into host slots (they stay
        there: promoted), then copied. An entry in no tier ends the load there (handle.error)."""
        self._blocks_view(pool)
        handle = LoadHandle(len(items), self.cost, self.device)
        hosted: list[tuple[int, bytes, _Entry, int]] = []
        below: list[tuple[int, bytes, int]] = []  # held by the tier below
        with self._lock:
            for i, (h, b) in enumerate(items):
                e = self._entries.get(h) or self._leaving.get(h)
                if e is not None:
                    if h in self._entries:
                        self._entries.move_to_end(h)
                    hosted.append((i, h, e, b))
                elif self.below is not None and self.below.contains(h):
                    below.append((i, h, b))
                else:
                    handle._fail(i, f"block {i} of the load (hash {h.hex()[:16]}) is in no tier; recompute it")
                    break
            spill, slots = [], None
            if below:
                spill = self._make_room(len(below), {h for _, h, _, _ in hosted})
                if self.slots.num_free >= len(below):
                    slots = self.slots.allocate(len(below))
                spill += self._make_room(self.evict_ahead, {h for _, h, _, _ in hosted})
            retired = list(self._retired)
            dst = [b for *_, b in hosted] + [b for *_, b in below]
            guards = {id(v): v for b in dst for v in (self._gpu_reads.get(b), self._gpu_writes.get(b)) if v is not None}
            guards = list(guards.values())
            ready = self._event(torch.cuda.current_stream(self.device)) if self.cuda else None
            if hosted:
                self._issue_hosted(handle, pool, hosted, ready, guards)
        self._send_below(spill)
        if below:
            handle._thread = threading.Thread(target=self._load_from_below, name=f"pdserve-kv-{self.below.name}-load",
                                              args=(handle, pool, below, slots, retired, ready, guards), daemon=True)
            handle._thread.start()
        return handle

    def _issue_hosted(self, handle: LoadHandle, pool, hosted, ready, guards) -> None:
        """Under self._lock: the host entries' copies, on the load stream."""
        nbytes = len(hosted) * self.entry_bytes
        rows, blocks = [e.slot for _, _, e, _ in hosted], [b for *_, b in hosted]
        with torch.inference_mode(), self._issue:
            if self.cuda:
                s = self._in_stream
                for ev in [ready, *guards, *{id(e.written): e.written for _, _, e, _ in hosted if e.written}.values()]:
                    s.wait_event(ev)
                with torch.cuda.device(self.device), torch.cuda.stream(s):
                    start = self._event(s, timing=True)
                    self._copy_in(pool, self.host, rows, blocks)
                    end = self._event(s, timing=True)
                handle._events.append(end)
                handle._parts[self.name] = [nbytes, start, end, 0.0]
                for _, _, e, b in hosted:
                    e.read = end
                    self._gpu_writes[b] = end
            else:
                t0 = time.perf_counter()
                self._copy_in(pool, self.host, rows, blocks)
                handle._parts[self.name] = [nbytes, time.perf_counter() - t0, None, 0.0]
        handle.bytes += nbytes
        self._stats.loaded_bytes += nbytes

    def _load_from_below(self, handle: LoadHandle, pool, items, slots, retired, ready, guards) -> None:
        """A thread: read + verify the entries below (on disk) into host slots (or a temporary buffer
        when the host tier has no room), copy the good ones in, then promote them to host entries."""
        promoted = False
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                for ev in retired:  # copies that touched these slots before they were freed
                    ev.synchronize()
                E = self.entry_bytes
                if slots is not None:
                    src, rows, promoted = self.host, slots, True
                    bufs = [self._host_bytes[s * E:(s + 1) * E] for s in slots]
                else:
                    src = torch.empty((len(items), self.layout.num_layers, self._row), dtype=self.layout.torch_dtype,
                                      pin_memory=self.pinned)
                    rows, raw = list(range(len(items))), memoryview(src.view(-1).view(torch.uint8).numpy())
                    bufs = [raw[k * E:(k + 1) * E] for k in range(len(items))]
                errors = self.below.load([h for _, h, _ in items], bufs)
                read_s = time.perf_counter() - t0
                good = [k for k, why in enumerate(errors) if why is None]
                for k, why in enumerate(errors):
                    if why is not None:
                        handle._fail(items[k][0], f"block {items[k][0]} of the load: {why}; recompute it")
                if good:
                    self._issue_from_below(handle, pool, src, [rows[k] for k in good],
                                           [items[k][2] for k in good], ready, guards, read_s)
        except BaseException as e:  # the handle carries it; the caller recomputes
            log.exception("a %s load of %d entries failed", self.below.name, len(items))
            handle._fail(items[0][0], f"{self.below.name} load failed: {type(e).__name__}: {e}; recompute")
            errors = ["failed"] * len(items)
        finally:
            if promoted:
                with self._lock:
                    end = handle._events[-1] if handle._events and self.cuda else None
                    for k, (_, h, _) in enumerate(items):
                        e = _Entry(slots[k], None, end)
                        if errors[k] is None and h not in self._entries and h not in self._leaving:
                            self._entries[h] = e
                        else:
                            self._free(e)

    def _issue_from_below(self, handle, pool, src, rows, blocks, ready, guards, read_s) -> None:
        nbytes = len(blocks) * self.entry_bytes
        with self._issue:
            if self.cuda:
                s = self._in_stream
                for ev in [ready, *guards]:
                    s.wait_event(ev)
                with torch.cuda.device(self.device), torch.cuda.stream(s):
                    start = self._event(s, timing=True)
                    self._copy_in(pool, src, rows, blocks)
                    end = self._event(s, timing=True)
                part = [nbytes, start, end, read_s]
                handle._events.append(end)
            else:
                t0 = time.perf_counter()
                self._copy_in(pool, src, rows, blocks)
                part = [nbytes, time.perf_counter() - t0, None, read_s]
        if self.cuda:
            with self._lock:  # after self._issue is let go: load() takes _lock, then _issue
                for b in blocks:
                    self._gpu_writes[b] = end
        handle._parts[self.below.name] = part
        handle.bytes += nbytes
