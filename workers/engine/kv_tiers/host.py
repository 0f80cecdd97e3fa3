"""HostTier: host slots for evicted GPU blocks (pinned on CUDA), LRU, with an optional tier below (disk).

The engine's entry point to the tiers (one caller thread; the tiers' own threads only write
files, read files and free slots). This module holds the slot memory (anonymous pages locked
with cudaHostRegister) and the bookkeeping: which hash holds which slot, what is on its way to
the tier below, which pending copies a GPU block or a freed slot must wait for. The copies themselves, and
the load path, are in copies.py.
    HostTier(layout, capacity_bytes, device, pinned=True, below=None)   slots allocated once; below: a LowerTier
    build(setting, below) -> HostTier | None  what the config asks for (tiering.build)
    store(pool, [(hash, gpu_block)]) -> int   copy those blocks out, async; held hashes skipped; LRU
                                              entries go below in the background, or are dropped
    before_reuse(gpu_blocks)                  the current stream waits for pending stores reading them
    name                                      "host" (protocol.enums.Tier)
    contains(hash) -> bool                    held here (counts nothing)
    lookup([hash]) -> [tier]                  the tier of each leading hash held here or below; stops at the first miss
    load(pool, [(hash, gpu_block)]) -> LoadHandle   copy those entries into the blocks, async (copies.py)
    spill([hash]) -> int                      push host entries to the tier below now (their host slots freed)
    discard([hash])                           forget entries in every tier
    figures() -> TierStats                    occupancy, bytes in and out, hits and misses (the tier below's: below.figures())
    probe_gbps() -> float                     host -> device bandwidth of one copy into staging, at start (copies.py)
    cost                                      a CostModel seeded by each tier's probe_gbps(), fed by every finished load
    flush() / close()                         wait for every copy and every write below (tests, bench, shutdown)
"""

from __future__ import annotations

import math
import mmap
import threading
from collections import OrderedDict
from dataclasses import asdict

import torch

from pdserve.protocol.enums import Tier
from pdserve.workers.engine.block_pool import BlockPool
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.kv_tiers.copies import HostCopies, _Entry
from pdserve.workers.engine.kv_tiers.cost import CostModel
from pdserve.workers.engine.kv_tiers.base import LowerTier, TierSetting, chain
from pdserve.workers.engine.kv_tiers.stats import TierStats


class HostTier(HostCopies):
    """Host slots for evicted GPU blocks, LRU, with an optional tier below (see the module
    docstrings of host.py and copies.py). staging_bytes: each side stream's device staging buffer (copies go in chunks of
    it). evict_ahead: with a tier below, the fraction of slots kept free or on their way down, so a
    store finds room while its writer drains (a store that finds too little room keeps its
    leading blocks and counts the rest as dropped; it never waits for the tier below)."""

    name = Tier.HOST.value

    def __init__(self, layout: KVLayout, capacity_bytes: int, device, pinned: bool = True,
                 below: LowerTier | None = None, *, staging_bytes: int = 128 << 20, evict_ahead: float = 0.1,
                 probe: bool = True):
        self.layout = layout
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.entry_bytes = layout.num_layers * layout.block_bytes
        self.num_slots = capacity_bytes // self.entry_bytes
        if self.num_slots < 1:
            raise ValueError(f"host tier of {capacity_bytes} bytes holds no block of {self.entry_bytes} bytes")
        if below is not None and below.entry_bytes != self.entry_bytes:
            raise ValueError(f"the {below.name} tier was made for another layout")
        self.pinned = pinned and self.cuda  # pinned memory needs CUDA; on the CPU it is plain memory
        self.below = below
        self.cost = CostModel(layout.bytes_per_token)
        row = layout.block_bytes // layout.itemsize  # elements of one block of one layer
        self._row = row
        stage = max(1, min(self.num_slots, staging_bytes // self.entry_bytes))
        # anonymous pages of our own, page-locked with cudaHostRegister: torch's pinned allocator
        # rounds an allocation up to a power of two (a 40 GiB tier would lock 64 GiB)
        self._mem = mmap.mmap(-1, self.num_slots * self.entry_bytes)
        self._host_bytes = memoryview(self._mem)  # slot i: [i * entry_bytes, (i + 1) * entry_bytes)
        self._registered = False
        with torch.inference_mode():
            flat = torch.frombuffer(self._mem, dtype=torch.uint8)
            if self.pinned:
                cudart = torch.cuda.cudart()
                err = int(cudart.cudaHostRegister(flat.data_ptr(), len(self._mem), 1))  # portable
                if err == 712:  # cudaErrorHostMemoryAlreadyRegistered: a dropped tier's pages at this address
                    cudart.cudaHostUnregister(flat.data_ptr())
                    err = int(cudart.cudaHostRegister(flat.data_ptr(), len(self._mem), 1))
                if err != 0:
                    raise RuntimeError(f"cudaHostRegister of the {len(self._mem) / 2**30:.1f} GiB host tier failed "
                                       f"(cudaError {err}); lower its size or check the memlock limit (ulimit -l)")
                self._registered = True
            # [slots, layers, row]: a run of slots is one contiguous range (one DMA, one file write)
            self.host = flat.view(layout.torch_dtype).view(self.num_slots, layout.num_layers, row)
            self._stage_out = torch.empty((stage, layout.num_layers, row), dtype=layout.torch_dtype, device=self.device)
            self._stage_in = torch.empty_like(self._stage_out)
        self._stage = stage
        self._out_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._in_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        self.slots = BlockPool(self.num_slots)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # resident, LRU first
        self._leaving: dict[bytes, _Entry] = {}  # queued for the tier below: still readable, slot freed once written
        self._retired: list = []  # events of copies that touched slots freed since (slot reuse waits)
        self._gpu_reads: dict[int, object] = {}  # GPU block -> the pending store reading it
        self._gpu_writes: dict[int, object] = {}  # GPU block -> the pending load writing it
        self._stats = TierStats(self.name, capacity_bytes=self.num_slots * self.entry_bytes)
        self._lock = threading.Lock()  # bookkeeping: the caller's thread and the tiers' threads
        self._issue = threading.Lock()  # the load stream and its staging buffer: one chunk at a time
        self.evict_ahead = math.ceil(evict_ahead * self.num_slots) if below is not None else 0
        if probe:
            for tier in chain(self):
                self.cost.seed_bandwidth(tier.name, tier.probe_gbps())

    # ---- bookkeeping (under self._lock) -----------------------------------------------------

    def _free(self, e: _Entry) -> None:
        self.slots.free([e.slot])
        self._retired += [ev for ev in (e.written, e.read) if ev is not None]

    def _make_room(self, target: int, protect: set[bytes]) -> list[tuple[bytes, _Entry]]:
        """Evict LRU entries until `target` slots are free (no tier below), or free + on their way
        down (with one: entries it holds already are freed at once); returns the entries to write.
        Called with the slots a copy needs before taking them, then with evict_ahead after."""
        spill: list[tuple[bytes, _Entry]] = []

        def have() -> int:
            return self.slots.num_free + (len(self._leaving) if self.below is not None else 0)

        if have() >= target:
            return spill
        for h in list(self._entries):
            if have() >= target:
                break
            if h in protect:
                continue
            e = self._entries.pop(h)
            self._stats.evicted += 1
            if self.below is not None and not self.below.contains(h):
                self._leaving[h] = e
                spill.append((h, e))
            else:
                self._free(e)
        return spill

    def _send_below(self, spill: list[tuple[bytes, _Entry]]) -> None:
        if not spill:
            return
        events = {id(e.written): e.written for _, e in spill if e.written is not None}

        def ready() -> None:  # writer thread: the stores' bytes must have landed
            for ev in events.values():
                ev.synchronize()

        def done(ok: bool) -> None:  # writer thread: the slots are no longer read
            with self._lock:
                for h, e in spill:
                    if self._leaving.get(h) is e:
                        del self._leaving[h]
                    self._free(e)
                    if e.discarded:
                        self.below.discard([h])

        E = self.entry_bytes
        self.below.store([(h, self._host_bytes[e.slot * E:(e.slot + 1) * E]) for h, e in spill], ready, done)

    def _wait_retired(self, stream) -> None:
        # kept until complete, not until waited on: a read from below may land in the slot later
        self._retired = [ev for ev in self._retired if not ev.query()]
        for ev in self._retired:
            stream.wait_event(ev)

    # ---- for the engine ----------------------------------------------------------------------

    def store(self, pool: torch.Tensor, items: list[tuple[bytes, int]]) -> int:
        """Copy these GPU blocks into host slots, asynchronously; returns how many were taken
        (hashes already held are skipped and count as used; blocks beyond the room are dropped)."""
        self._blocks_view(pool)  # refuse a pool of another layout before any slot is taken
        with self._lock:
            new, seen, held = [], set(), 0
            for h, b in items:
                if h in self._entries:
                    self._entries.move_to_end(h)
                    held += 1
                elif h in self._leaving:
                    held += 1
                elif h not in seen:
                    seen.add(h)
                    new.append((h, b))
            if not new:
                return held
            spill = self._make_room(len(new), set())
            room = min(len(new), self.slots.num_free)
            self._stats.dropped += len(new) - room
            new = new[:room]
            slots = self.slots.allocate(room)
            blocks = [b for _, b in new]
            written = None
            try:
                with torch.inference_mode():
                    if self.cuda and new:
                        s = self._out_stream
                        s.wait_event(self._event(torch.cuda.current_stream(self.device)))  # the KV is complete
                        self._wait_retired(s)
                        for ev in {id(v): v for b in blocks if (v := self._gpu_writes.get(b)) is not None}.values():
                            s.wait_event(ev)
                        with torch.cuda.device(self.device), torch.cuda.stream(s):
                            self._copy_out(pool, blocks, slots)
                        written = self._event(s)
                    elif new:
                        self._copy_out(pool, blocks, slots)
            except BaseException:
                self.slots.free(slots)  # nothing was recorded: the slots go back
                raise
            for (h, b), slot in zip(new, slots):
                self._entries[h] = _Entry(slot, written)
                if written is not None:
                    self._gpu_reads[b] = written
            self._stats.stored_bytes += room * self.entry_bytes
            spill += self._make_room(self.evict_ahead, set())
        self._send_below(spill)
        return held + room

    def before_reuse(self, block_ids: list[int]) -> None:
        """The caller is about to overwrite these GPU blocks: order the current stream after the
        pending stores that read them (no host sync)."""
        if not self.cuda:
            return
        with self._lock:
            events = {}
            for b in block_ids:
                ev = self._gpu_reads.pop(b, None)
                if ev is not None:
                    events[id(ev)] = ev
        stream = torch.cuda.current_stream(self.device)
        for ev in events.values():
            if not ev.query():
                stream.wait_event(ev)

    def contains(self, h: bytes) -> bool:
        with self._lock:
            return h in self._entries or h in self._leaving

    def lookup(self, hashes: list[bytes]) -> list[str]:
        out = []
        with self._lock:
            for h in hashes:
                if h in self._entries or h in self._leaving:
                    self._stats.hits += 1
                    out.append(self.name)
                    continue
                self._stats.misses += 1
                found = self.below.lookup([h]) if self.below is not None else []
                if not found:
                    break
                out += found
        return out

    def spill(self, hashes: list[bytes]) -> int:
        """Move these resident entries to the tier below now (already held there: just dropped from
        host); returns how many left the host tier."""
        if self.below is None:
            raise ValueError("this host tier has no tier below to spill to")
        spill, n = [], 0
        with self._lock:
            for h in hashes:
                e = self._entries.pop(h, None)
                if e is None:
                    continue
                n += 1
                if self.below.contains(h):
                    self._free(e)
                else:
                    self._leaving[h] = e
                    spill.append((h, e))
        self._send_below(spill)
        return n

    def discard(self, hashes: list[bytes]) -> None:
        with self._lock:
            for h in hashes:
                e = self._entries.pop(h, None)
                if e is not None:
                    self._free(e)
                e = self._leaving.pop(h, None)
                if e is not None:
                    e.discarded = True  # its slot is freed once the writer is done with it
            if self.below is not None:
                self.below.discard(hashes)

    def names(self) -> list[bytes]:
        """The names this tier can serve now (those on their way down too); the router's index."""
        with self._lock:
            return list(self._entries) + list(self._leaving)

    def figures(self) -> TierStats:
        with self._lock:
            s = TierStats(**asdict(self._stats))
            s.entries = len(self._entries) + len(self._leaving)
            s.bytes = s.entries * self.entry_bytes
        return s

    def flush(self) -> None:
        """Wait (host) for every queued copy and every write below."""
        if self.cuda:
            self._out_stream.synchronize()
            self._in_stream.synchronize()
        if self.below is not None:
            self.below.flush()

    def __del__(self):  # dropped without close(): unlock the pages before the mapping goes
        if getattr(self, "_registered", False):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            except Exception:  # interpreter teardown: CUDA may be gone already
                pass

    def close(self) -> None:
        self.flush()
        if self.below is not None:
            self.below.close()
        if self._registered:  # the pages stay mapped (self.host still views them), no longer locked
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self._registered = False


def build(setting: TierSetting, below: LowerTier | None) -> HostTier | None:
    """The host tier, if the config asks for one (--host-cache-gb), over the tier below."""
    config = setting.config
    if not config.host_cache_gb:
        return None
    return HostTier(setting.layout, int(config.host_cache_gb * 2**30), setting.device, pinned=True, below=below)
