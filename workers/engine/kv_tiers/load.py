"""A load: the LoadHandle the engine polls, and HostTier's load path that fills it.

load() copies host entries in at once on the load stream; disk entries are read and verified by
a thread into host slots (promoted), then copied in. Here, apart from host.py, because a load is
the one operation that spans both tiers and a thread, and its handle is what the engine holds
(workers/engine/tiering.py) while the request waits. HostLoads is a part of HostTier (its base
class); it uses the tier's locks, entries, slots, streams and copies (HostCopies).
    load(pool, [(hash, gpu_block)]) -> LoadHandle   copy those entries into the blocks, async
LoadHandle:
    done() -> bool                            non-blocking; True once the copies completed (then any
                                              later work on any stream sees the KV)
    wait(timeout=None) -> bool / fence()      block the host until done / make the current stream wait
    error, loaded, bytes, seconds, tier_seconds   what failed (the caller recomputes from `loaded` on)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from pdserve.workers.engine.kv_tiers.copies import _Entry

if TYPE_CHECKING:
    from pdserve.workers.engine.kv_tiers.host import HostTier

log = logging.getLogger("pdserve.kv_tiers")


class LoadHandle:
    """One load(): poll done(); `error` set when an entry could not be served (missing, or refused
    on disk: the caller recomputes from block `loaded` on, the blocks before it landed)."""

    def __init__(self, tier: "HostTier", n: int):
        self._tier = tier
        self.error: str | None = None
        self._failed = n  # index of the first item that did not land
        self._events: list = []  # CUDA: each part's last copy
        self._parts: dict[str, list] = {}  # tier -> [bytes, start event or seconds, end event or None, extra s]
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._finished = False
        self.bytes = 0
        self.seconds: float | None = None
        self.tier_seconds: dict[str, float] = {}

    @property
    def loaded(self) -> int:
        """Leading items that landed (all of them when error is None)."""
        return self._failed

    def _fail(self, index: int, why: str) -> None:
        with self._lock:
            if index < self._failed:
                self._failed, self.error = index, why

    def done(self) -> bool:
        if self._finished:
            return True
        if self._thread is not None and self._thread.is_alive():
            return False
        if not all(ev.query() for ev in self._events):
            return False
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block the host until the load is complete (False on timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        for ev in self._events:
            while end is not None and not ev.query():
                if time.monotonic() > end:
                    return False
                time.sleep(0.0002)
            ev.synchronize()
        return self.done()

    def fence(self) -> None:
        """The current stream waits for the copies (no host sync, unless a disk read is still on
        its thread: that is joined first, since its copies are not issued yet)."""
        if self._thread is not None:
            self._thread.join()
        if self._tier.cuda:  # on the CPU every copy is done once issued
            for ev in self._events:
                torch.cuda.current_stream(self._tier.device).wait_event(ev)

    def _finish(self) -> None:
        self._finished = True
        for tier, (nbytes, start, end, extra) in self._parts.items():
            seconds = (start.elapsed_time(end) / 1e3 if end is not None else start) + extra
            self.tier_seconds[tier] = seconds
            self._tier.cost.observe_load(tier, nbytes, seconds)
        self.seconds = max(self.tier_seconds.values(), default=0.0)


class HostLoads:
    """HostTier's load path (see the module docstring); not made on its own."""

    def load(self, pool: torch.Tensor, items: list[tuple[bytes, int]]) -> LoadHandle:
        """Copy these entries into the given GPU blocks, asynchronously. Host entries go at once on
        the load stream; disk entries are read and verified by a thread into host slots (they stay
        there: promoted), then copied. An entry in no tier ends the load there (handle.error)."""
        self._blocks_view(pool)
        handle = LoadHandle(self, len(items))
        hosted: list[tuple[int, bytes, _Entry, int]] = []
        on_disk: list[tuple[int, bytes, int]] = []
        with self._lock:
            for i, (h, b) in enumerate(items):
                e = self._entries.get(h) or self._leaving.get(h)
                if e is not None:
                    if h in self._entries:
                        self._entries.move_to_end(h)
                    hosted.append((i, h, e, b))
                elif self.disk is not None and self.disk.contains(h):
                    on_disk.append((i, h, b))
                else:
                    handle._fail(i, f"block {i} of the load (hash {h.hex()[:16]}) is in no tier; recompute it")
                    break
            spill, slots = [], None
            if on_disk:
                spill = self._make_room(len(on_disk), {h for _, h, _, _ in hosted})
                if self.slots.num_free >= len(on_disk):
                    slots = self.slots.allocate(len(on_disk))
                spill += self._make_room(self.evict_ahead, {h for _, h, _, _ in hosted})
            retired = list(self._retired)
            dst = [b for *_, b in hosted] + [b for *_, b in on_disk]
            guards = {id(v): v for b in dst for v in (self._gpu_reads.get(b), self._gpu_writes.get(b)) if v is not None}
            guards = list(guards.values())
            ready = self._event(torch.cuda.current_stream(self.device)) if self.cuda else None
            if hosted:
                self._issue_hosted(handle, pool, hosted, ready, guards)
        self._send_to_disk(spill)
        if on_disk:
            handle._thread = threading.Thread(target=self._load_from_disk, name="pdserve-kv-disk-load",
                                              args=(handle, pool, on_disk, slots, retired, ready, guards), daemon=True)
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
                handle._parts["host"] = [nbytes, start, end, 0.0]
                for _, _, e, b in hosted:
                    e.read = end
                    self._gpu_writes[b] = end
            else:
                t0 = time.perf_counter()
                self._copy_in(pool, self.host, rows, blocks)
                handle._parts["host"] = [nbytes, time.perf_counter() - t0, None, 0.0]
        handle.bytes += nbytes
        self._stats.loaded_bytes += nbytes

    def _load_from_disk(self, handle: LoadHandle, pool, on_disk, slots, retired, ready, guards) -> None:
        """A thread: read + verify the disk entries into host slots (or a temporary buffer when the
        host tier has no room), copy the good ones in, then promote them to host entries."""
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
                    src = torch.empty((len(on_disk), self.layout.num_layers, self._row), dtype=self.layout.torch_dtype,
                                      pin_memory=self.pinned)
                    rows, raw = list(range(len(on_disk))), memoryview(src.view(-1).view(torch.uint8).numpy())
                    bufs = [raw[k * E:(k + 1) * E] for k in range(len(on_disk))]
                errors = self.disk.read([h for _, h, _ in on_disk], bufs)
                read_s = time.perf_counter() - t0
                good = [k for k, why in enumerate(errors) if why is None]
                for k, why in enumerate(errors):
                    if why is not None:
                        handle._fail(on_disk[k][0], f"block {on_disk[k][0]} of the load: {why}; recompute it")
                if good:
                    self._issue_from_disk(handle, pool, src, [rows[k] for k in good],
                                          [on_disk[k][2] for k in good], ready, guards, read_s)
        except BaseException as e:  # the handle carries it; the caller recomputes
            log.exception("a disk load of %d entries failed", len(on_disk))
            handle._fail(on_disk[0][0], f"disk load failed: {type(e).__name__}: {e}; recompute")
            errors = ["failed"] * len(on_disk)
        finally:
            if promoted:
                with self._lock:
                    end = handle._events[-1] if handle._events and self.cuda else None
                    for k, (_, h, _) in enumerate(on_disk):
                        e = _Entry(slots[k], None, end)
                        if errors[k] is None and h not in self._entries and h not in self._leaving:
                            self._entries[h] = e
                        else:
                            self._free(e)

    def _issue_from_disk(self, handle, pool, src, rows, blocks, ready, guards, read_s) -> None:
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
        handle._parts["disk"] = part
        handle.bytes += nbytes
