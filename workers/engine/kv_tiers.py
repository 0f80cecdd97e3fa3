"""The KV tiers below GPU memory: a host slot pool (pinned on CUDA), an optional disk directory
under it, and the cost model that chooses between reloading a cached prefix and recomputing it.

An entry is one whole block, every layer (`pool[:, b]`: entry_bytes = num_layers x
KVLayout.block_bytes), named by the prefix cache's block hash (bytes, opaque here).

For the engine (one caller thread; the tiers' own threads only write files, read files and free slots):
    HostTier(layout, capacity_bytes, device, pinned=True, disk=None)   slots allocated once
    store(pool, [(hash, gpu_block)]) -> int   copy those blocks out, async; held hashes skipped; LRU
                                              entries go to disk in the background, or are dropped
    before_reuse(gpu_blocks)                  the current stream waits for pending stores reading them
    lookup([hash]) -> ["host" | "disk"]       the tier of each leading hash held; stops at the first miss
    load(pool, [(hash, gpu_block)]) -> LoadHandle   copy those entries into the blocks, async
    spill([hash]) -> int                      push host entries to disk now (their host slots freed)
    discard([hash])                           forget entries in every tier
    stats() -> {"host": TierStats, "disk": TierStats}   occupancy, bytes in and out, hits and misses
    cost                                      a CostModel seeded by probe copies, fed by every finished load
    flush() / close()                         wait for every copy and disk write (tests, bench, shutdown)
LoadHandle:
    done() -> bool                            non-blocking; True once the copies completed (then any
                                              later work on any stream sees the KV)
    wait(timeout=None) -> bool / fence()      block the host until done / make the current stream wait
    error, loaded, bytes, seconds, tier_seconds   what failed (the caller recomputes from `loaded` on)
DiskTier(directory, capacity_bytes, layout, model_id)   driven by a HostTier
    contains(hash), put(entries, ready, done), read(hashes, buffers) -> [error | None], discard(hashes),
    flush(), drop_page_cache(method) -> str, probe_gbps(), stats(), close()
CostModel (torch-free):
    seed_bandwidth(tier, gbps), observe_load(tier, bytes, s), observe_prefill(tokens, s)
    should_reload(tier, num_tokens, bytes_per_token) -> bool, break_even_gbps(), reload_seconds(tier, bytes)

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

import json
import logging
import math
import mmap
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from workers.engine.block_pool import BlockPool, runs
from workers.engine.kv_cache import KVLayout

log = logging.getLogger("pdserve.kv_tiers")


@dataclass
class TierStats:
    tier: str
    entries: int = 0
    bytes: int = 0  # held now
    capacity_bytes: int = 0
    stored_bytes: int = 0  # written into this tier, in all
    loaded_bytes: int = 0  # read out of it towards GPU blocks, in all
    hits: int = 0  # lookup: hashes found in this tier
    misses: int = 0  # lookup: hashes looked for here and not found
    evicted: int = 0  # entries pushed out (host: to disk or dropped; disk: files deleted)
    dropped: int = 0  # host: blocks a store found no room for; disk: entries a write failed or skipped
    corrupt: int = 0  # disk: entries refused on read (checksum, short read)


# ---- the cost model ------------------------------------------------------------------------


class CostModel:
    """Reload or recompute: bytes over the tier's measured bandwidth against tokens times the
    measured prefill seconds per token (the seed's break-even link speed as a live decision).
    Both figures are EWMAs (weight `alpha` on each new observation); a tier's bandwidth starts
    from its probe. Before any prefill was observed, or for a tier never measured, reload."""

    def __init__(self, bytes_per_token: int | None = None, alpha: float = 0.2):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.bytes_per_token = bytes_per_token
        self.alpha = alpha
        self._gbps: dict[str, float] = {}
        self._s_per_token: float | None = None
        self._lock = threading.Lock()  # loads are observed from the tiers' threads too

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def seed_bandwidth(self, tier: str, gbps: float) -> None:
        if gbps > 0:
            with self._lock:
                self._gbps[tier] = gbps

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._gbps[tier] = self._mix(self._gbps.get(tier), nbytes / seconds / 1e9)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._s_per_token = self._mix(self._s_per_token, seconds / tokens)

    def bandwidth_gbps(self, tier: str) -> float | None:
        return self._gbps.get(tier)

    @property
    def prefill_s_per_token(self) -> float | None:
        return self._s_per_token

    def reload_seconds(self, tier: str, nbytes: int) -> float | None:
        gbps = self._gbps.get(tier)
        return None if gbps is None else nbytes / (gbps * 1e9)

    def should_reload(self, tier: str, num_tokens: int, bytes_per_token: int | None = None) -> bool:
        if num_tokens <= 0:
            return False
        bpt = bytes_per_token or self.bytes_per_token
        reload_s = self.reload_seconds(tier, num_tokens * bpt) if bpt else None
        if self._s_per_token is None or reload_s is None:
            return True
        return reload_s < num_tokens * self._s_per_token

    def break_even_gbps(self, bytes_per_token: int | None = None) -> float | None:
        """The link speed at which reloading and recomputing cost the same (GB/s)."""
        bpt = bytes_per_token or self.bytes_per_token
        if not bpt or not self._s_per_token:
            return None
        return bpt / self._s_per_token / 1e9


# ---- the disk tier -------------------------------------------------------------------------

MAGIC = b"PDSKV01\n"
HEAD = struct.Struct("<QI")  # header JSON length, its crc32
ALIGN = 4096  # the payload starts on a page boundary


def _layout_fields(layout: KVLayout) -> dict:
    fields = asdict(layout)
    fields.pop("num_blocks")  # a restarted worker may size its pool differently
    return fields


def _crc(h: bytes, data) -> int:
    return zlib.crc32(data, zlib.crc32(h))  # the hash inside: bytes swapped between entries fail too


@dataclass
class _File:
    name: str
    hashes: list[bytes]
    crcs: list[int]
    payload_offset: int
    size: int
    live: int  # entries still indexed from this file


class DiskTier:
    """Entries on local disk. One file per batch of entries written together (what one eviction
    or spill pushed out: typically one request's run, whose blocks were stored and used together),
    split at max_file_bytes: 32k tokens of a 7B model is 2048 blocks, which as one file per block
    costs 2048 creates, renames and inodes and 2048 opens to read back; as files per run it costs
    a few. A block is still addressed alone, (file, index), so a partial hit reads only its
    blocks, and each block carries its own crc32 (over its hash and bytes) so a bad byte costs
    that block, not its file.

    A file: MAGIC, (json length, crc32 of the json), json {model, layout (KVLayout without
    num_blocks), entry_bytes, entries: [[hash hex, crc32], ...]}, padding to 4 KiB, the entries.
    Written to a temporary name and renamed (atomic); no fsync by default: a cache need not survive
    a crash, and a file the crash truncated fails its size or checksum check, so it is refused.
    On start the directory is indexed: files of another model or layout, or with a bad header,
    are logged and left alone (never served, never deleted: the directory is one worker's, but a
    mistake should not cost someone else's cache). LRU by file, bounded by capacity_bytes.
    Reads verify every block; a mismatch is a miss (logged, the entry forgotten), never served."""

    SUFFIX = ".kv"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, layout: KVLayout, model_id: str,
                 *, fsync: bool = False, read_threads: int = 8, max_file_bytes: int = 256 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.model_id = model_id
        self.entry_bytes = layout.num_layers * layout.block_bytes
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.max_file_entries = max(1, max_file_bytes // self.entry_bytes)
        self._meta = {"model": model_id, "layout": _layout_fields(layout), "entry_bytes": self.entry_bytes}
        self._files: OrderedDict[str, _File] = OrderedDict()  # LRU first
        self._where: dict[bytes, tuple[str, int]] = {}  # hash -> (file, index)
        self._bytes = 0
        self._stats = TierStats("disk", capacity_bytes=capacity_bytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # write jobs queued or running
        self._index()
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="pdserve-kv-disk-read")  # reads, crcs
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pdserve-kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- start: what a previous worker left --------------------------------------------------

    def _index(self) -> None:
        for tmp in self.dir.glob(".*.tmp-*"):
            try:
                os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
            except (ValueError, PermissionError):
                continue
            except ProcessLookupError:  # its writer died mid-write
                tmp.unlink(missing_ok=True)
        paths = sorted(self.dir.glob("*" + self.SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                f = self._read_header(path)
            except (OSError, ValueError, KeyError, TypeError) as e:  # a header we did not write
                log.warning("disk tier %s: not serving %s: %s", self.dir, path.name, e)
                continue
            self._add_file(f)
        self._evict_over_capacity()
        if paths:
            log.info("disk tier %s: %d entries in %d files reused", self.dir, len(self._where), len(self._files))

    def _read_header(self, path: Path) -> _File:
        with open(path, "rb") as fh:
            head = fh.read(len(MAGIC) + HEAD.size)
            if len(head) < len(MAGIC) + HEAD.size or head[:len(MAGIC)] != MAGIC:
                raise ValueError("not a pdserve KV file (bad magic)")
            length, crc = HEAD.unpack(head[len(MAGIC):])
            if length > 1 << 28:
                raise ValueError(f"header length {length} is implausible")
            text = fh.read(length)
        if len(text) != length or zlib.crc32(text) != crc:
            raise ValueError("header checksum mismatch (corrupt or truncated)")
        meta = json.loads(text)
        if meta.get("model") != self.model_id:
            raise ValueError(f"written for model {meta.get('model')!r}, this worker serves {self.model_id!r}")
        if meta.get("layout") != self._meta["layout"] or meta.get("entry_bytes") != self.entry_bytes:
            raise ValueError(f"written for layout {meta.get('layout')}, this worker has {self._meta['layout']}")
        entries = meta["entries"]
        offset = _align(len(MAGIC) + HEAD.size + length)
        size = path.stat().st_size
        if size != offset + len(entries) * self.entry_bytes:
            raise ValueError(f"{size} bytes, its header says {offset + len(entries) * self.entry_bytes} (truncated)")
        return _File(path.name, [bytes.fromhex(h) for h, _ in entries], [int(c) for _, c in entries], offset, size, 0)

    def _add_file(self, f: _File) -> None:
        for i, h in enumerate(f.hashes):
            if h not in self._where:
                self._where[h] = (f.name, i)
                f.live += 1
        self._files[f.name] = f
        self._bytes += f.size
        if f.live == 0:
            self._remove_file(f.name)

    def _remove_file(self, name: str) -> None:
        f = self._files.pop(name)
        for i, h in enumerate(f.hashes):
            if self._where.get(h) == (name, i):
                del self._where[h]
        self._bytes -= f.size
        self._stats.evicted += f.live
        try:
            os.unlink(self.dir / name)
        except FileNotFoundError:
            pass

    def _evict_over_capacity(self) -> None:
        while self._bytes > self.capacity_bytes and self._files:
            self._remove_file(next(iter(self._files)))

    # ---- for the host tier -------------------------------------------------------------------

    def contains(self, h: bytes) -> bool:
        return h in self._where

    def put(self, entries: list[tuple[bytes, memoryview]], ready: Callable[[], None] | None = None,
            done: Callable[[bool], None] | None = None) -> None:
        """Write these entries in the background (the writer thread calls ready() first, e.g. to
        wait until the bytes have landed in the buffers, and done(ok) once it no longer reads them)."""
        with self._lock:
            self._pending += 1
        self._queue.put((entries, ready, done))

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            entries, ready, done = job
            ok = False
            try:
                if ready is not None:
                    ready()
                self._write(entries)
                ok = True
            except Exception:
                log.exception("disk tier %s: writing %d entries failed; they are dropped", self.dir, len(entries))
                with self._lock:
                    self._stats.dropped += len(entries)
            finally:
                try:
                    if done is not None:
                        done(ok)
                finally:
                    with self._lock:
                        self._pending -= 1
                        self._idle.notify_all()

    def _write(self, entries: list[tuple[bytes, memoryview]]) -> None:
        with self._lock:
            seen: set[bytes] = set()
            todo = []
            for h, buf in entries:
                if h not in self._where and h not in seen:
                    seen.add(h)
                    todo.append((h, buf))
        for start in range(0, len(todo), self.max_file_entries):
            group = todo[start:start + self.max_file_entries]
            if len(group) * self.entry_bytes > self.capacity_bytes:
                with self._lock:
                    self._stats.dropped += len(group)
                continue
            self._write_file(group)

    def _write_file(self, group: list[tuple[bytes, memoryview]]) -> None:
        crcs = list(self._readers.map(lambda entry: _crc(*entry), group))  # crc32 lets go of the GIL
        text = json.dumps({**self._meta, "entries": [[h.hex(), c] for (h, _), c in zip(group, crcs)]}).encode()
        head = MAGIC + HEAD.pack(len(text), zlib.crc32(text)) + text
        head += b"\0" * (_align(len(head)) - len(head))
        name = f"{uuid.uuid4().hex}{self.SUFFIX}"
        tmp = self.dir / f".{name}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(head))
            for _, buf in group:
                _write_all(fd, buf)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, self.dir / name)
        f = _File(name, [h for h, _ in group], crcs, len(head), len(head) + len(group) * self.entry_bytes, 0)
        with self._lock:
            self._add_file(f)
            self._stats.stored_bytes += len(group) * self.entry_bytes
            self._evict_over_capacity()

    def read(self, hashes: list[bytes], buffers: list[memoryview]) -> list[str | None]:
        """Read each entry into its buffer (entry_bytes, writable) and verify it; per entry None or
        why it was refused. A refused entry is forgotten: the next lookup misses it."""
        errors: list[str | None] = [None] * len(hashes)
        tasks: dict[str, list[tuple[int, int]]] = {}
        with self._lock:
            for k, h in enumerate(hashes):
                where = self._where.get(h)
                if where is None:
                    errors[k] = f"entry {h.hex()[:16]} is not on disk (evicted)"
                    continue
                tasks.setdefault(where[0], []).append((k, where[1]))
                self._files.move_to_end(where[0])
            files = {name: self._files[name] for name in tasks}
        chunk = max(1, (32 << 20) // self.entry_bytes)
        futures = [self._readers.submit(self._read_some, files[name], part[i:i + chunk], hashes, buffers)
                   for name, part in tasks.items() for i in range(0, len(part), chunk)]
        for fut in futures:
            for k, why in fut.result():
                errors[k] = why
        with self._lock:
            for k, why in enumerate(errors):
                h = hashes[k]
                if why is None:
                    self._stats.loaded_bytes += self.entry_bytes
                elif h in self._where and self._where[h][0] in files:
                    log.warning("disk tier %s: refusing entry %s: %s", self.dir, h.hex()[:16], why)
                    self._stats.corrupt += 1
                    self._forget(h)
        return errors

    def _read_some(self, f: _File, part: list[tuple[int, int]], hashes, buffers) -> list[tuple[int, str]]:
        bad = []
        try:
            fd = os.open(self.dir / f.name, os.O_RDONLY)
        except OSError as e:
            return [(k, f"{f.name}: {e}") for k, _ in part]
        try:
            for k, i in part:
                buf = buffers[k]
                got = _read_all(fd, buf, f.payload_offset + i * self.entry_bytes)
                if got != self.entry_bytes:
                    bad.append((k, f"{f.name}: short read, {got} of {self.entry_bytes} bytes"))
                elif f.hashes[i] != hashes[k] or _crc(hashes[k], buf) != f.crcs[i]:
                    bad.append((k, f"{f.name}: checksum mismatch on entry {i}"))
        finally:
            os.close(fd)
        return bad

    def _forget(self, h: bytes) -> None:
        name, _ = self._where.pop(h)
        f = self._files[name]
        f.live -= 1
        if f.live == 0:
            self._remove_file(name)

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1

    def discard(self, hashes: list[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._where:
                    self._forget(h)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**asdict(self._stats))
            s.entries, s.bytes = len(self._where), self._bytes
        return s

    def files(self) -> list[Path]:
        with self._lock:
            return [self.dir / name for name in self._files]

    def drop_page_cache(self, method: str = "fadvise") -> str:
        """Make the next reads come from the device: "fadvise" (fdatasync + POSIX_FADV_DONTNEED on
        each file: only our files) or "drop_caches" (sync + /proc/sys/vm/drop_caches: the whole
        machine's page cache, root only; falls back to fadvise). Returns the method that ran."""
        self.flush()
        if method == "drop_caches":
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as fh:
                    fh.write("1\n")
                return "drop_caches"
            except OSError as e:
                log.info("drop_caches refused (%s); using posix_fadvise(DONTNEED)", e)
        elif method != "fadvise":
            raise ValueError(f"unknown page cache method {method!r}; use fadvise or drop_caches")
        for path in self.files():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"

    def probe_gbps(self, nbytes: int = 16 << 20) -> float:
        """Read bandwidth of a file written, synced and dropped from the page cache (GB/s)."""
        path = self.dir / f".probe-{uuid.uuid4().hex[:8]}.tmp-{os.getpid()}"
        data = os.urandom(nbytes)
        buf = bytearray(nbytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, memoryview(data))
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                _read_all(fd, memoryview(buf), 0)
                seconds = time.perf_counter() - start
            finally:
                os.close(fd)
        finally:
            path.unlink(missing_ok=True)
        return nbytes / max(seconds, 1e-9) / 1e9

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._readers.shutdown(wait=True)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _write_all(fd: int, buf: memoryview) -> None:
    buf = buf.cast("B")
    while buf:
        buf = buf[os.write(fd, buf):]


def _read_all(fd: int, buf: memoryview, offset: int) -> int:
    buf, got = buf.cast("B"), 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


# ---- the host tier -------------------------------------------------------------------------


@dataclass
class _Entry:
    slot: int
    written: object | None = None  # CUDA event: the store's copy into the slot (None: landed)
    read: object | None = None  # CUDA event: the latest copy out of the slot
    discarded: bool = False  # discarded while its disk write was queued


class LoadHandle:
    """One load(): poll done(); `error` set when an entry could not be served (missing, or refused
    on disk: the caller recomputes from block `loaded` on, the blocks before it landed)."""

    def __init__(self, tier: "HostTier", n: int):
        self._tier = tier
        self.n = n
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


class HostTier:
    """Host slots for evicted GPU blocks, LRU, with an optional DiskTier below (see the module
    docstring). staging_bytes: each side stream's device staging buffer (copies go in chunks of
    it). evict_ahead: with a disk, the fraction of slots kept free or on their way to disk, so a
    store finds room while the writer drains (a store that finds too little room keeps its
    leading blocks and counts the rest as dropped; it never waits for the disk)."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, device, pinned: bool = True,
                 disk: DiskTier | None = None, *, staging_bytes: int = 128 << 20, evict_ahead: float = 0.1,
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
        if disk is not None and disk.entry_bytes != self.entry_bytes:
            raise ValueError("the disk tier was made for another layout")
        self.pinned = pinned and self.cuda  # pinned memory needs CUDA; on the CPU it is plain memory
        self.disk = disk
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
        self._leaving: dict[bytes, _Entry] = {}  # queued for disk: still readable, slot freed once written
        self._retired: list = []  # events of copies that touched slots freed since (slot reuse waits)
        self._gpu_reads: dict[int, object] = {}  # GPU block -> the pending store reading it
        self._gpu_writes: dict[int, object] = {}  # GPU block -> the pending load writing it
        self._stats = TierStats("host", capacity_bytes=self.num_slots * self.entry_bytes)
        self._lock = threading.Lock()  # bookkeeping: the caller's thread and the tiers' threads
        self._issue = threading.Lock()  # the load stream and its staging buffer: one chunk at a time
        self.evict_ahead = math.ceil(evict_ahead * self.num_slots) if disk is not None else 0
        if probe:
            self.cost.seed_bandwidth("host", self._probe())
            if disk is not None:
                self.cost.seed_bandwidth("disk", disk.probe_gbps())

    # ---- copies --------------------------------------------------------------------------

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

    # ---- bookkeeping (under self._lock) -----------------------------------------------------

    def _free(self, e: _Entry) -> None:
        self.slots.free([e.slot])
        self._retired += [ev for ev in (e.written, e.read) if ev is not None]

    def _make_room(self, target: int, protect: set[bytes]) -> list[tuple[bytes, _Entry]]:
        """Evict LRU entries until `target` slots are free (no disk), or free + on their way to disk
        (with a disk: entries already there are freed at once); returns the entries to write.
        Called with the slots a copy needs before taking them, then with evict_ahead after."""
        spill: list[tuple[bytes, _Entry]] = []

        def have() -> int:
            return self.slots.num_free + (len(self._leaving) if self.disk is not None else 0)

        if have() >= target:
            return spill
        for h in list(self._entries):
            if have() >= target:
                break
            if h in protect:
                continue
            e = self._entries.pop(h)
            self._stats.evicted += 1
            if self.disk is not None and not self.disk.contains(h):
                self._leaving[h] = e
                spill.append((h, e))
            else:
                self._free(e)
        return spill

    def _send_to_disk(self, spill: list[tuple[bytes, _Entry]]) -> None:
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
                        self.disk.discard([h])

        E = self.entry_bytes
        self.disk.put([(h, self._host_bytes[e.slot * E:(e.slot + 1) * E]) for h, e in spill], ready, done)

    def _wait_retired(self, stream) -> None:
        # kept until complete, not until waited on: a disk read may land in the slot later
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
        self._send_to_disk(spill)
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

    def lookup(self, hashes: list[bytes]) -> list[str]:
        out = []
        with self._lock:
            for h in hashes:
                if h in self._entries or h in self._leaving:
                    self._stats.hits += 1
                    out.append("host")
                    continue
                self._stats.misses += 1
                found = self.disk is not None and self.disk.contains(h)
                if self.disk is not None:
                    self.disk._count(found)
                if not found:
                    break
                out.append("disk")
        return out

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

    def spill(self, hashes: list[bytes]) -> int:
        """Move these resident entries to disk now (already on disk: just dropped from host);
        returns how many left the host tier."""
        if self.disk is None:
            raise ValueError("this host tier has no disk tier to spill to")
        spill, n = [], 0
        with self._lock:
            for h in hashes:
                e = self._entries.pop(h, None)
                if e is None:
                    continue
                n += 1
                if self.disk.contains(h):
                    self._free(e)
                else:
                    self._leaving[h] = e
                    spill.append((h, e))
        self._send_to_disk(spill)
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
            if self.disk is not None:
                self.disk.discard(hashes)

    def stats(self) -> dict[str, TierStats]:
        with self._lock:
            s = TierStats(**asdict(self._stats))
            s.entries = len(self._entries) + len(self._leaving)
            s.bytes = s.entries * self.entry_bytes
            out = {"host": s}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out

    def flush(self) -> None:
        """Wait (host) for every queued copy and disk write."""
        if self.cuda:
            self._out_stream.synchronize()
            self._in_stream.synchronize()
        if self.disk is not None:
            self.disk.flush()

    def __del__(self):  # dropped without close(): unlock the pages before the mapping goes
        if getattr(self, "_registered", False):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            except Exception:  # interpreter teardown: CUDA may be gone already
                pass

    def close(self) -> None:
        self.flush()
        if self.disk is not None:
            self.disk.close()
        if self._registered:  # the pages stay mapped (self.host still views them), no longer locked
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self._registered = False
