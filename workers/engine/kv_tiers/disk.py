"""DiskTier: KV entries on local disk, below a HostTier (tiering.build makes it; the HostTier drives it).

One file per batch of entries written together, each file naming the model and the layout and
each block carrying its keyed MAC, so a restarted worker serves only what matches, what it (or its
deployment) wrote, and a bad byte costs one block (disk_format.py: the format, and what a start
keeps and reclaims). KV bytes
are the prompt in another form (layer 0's values are a function of the token alone), so the folder
is private (0700, this user's, no one else may write it: refused otherwise), its files 0600, opened
without following links and only if regular, and every read has a deadline. Its own module because it is the one
tier with a file format and threads of its own (a writer, a pool of readers), and it touches
no tensor: it writes and reads bytes from and into the host slots the HostTier hands it.
    DiskTier(directory, capacity_bytes, layout, model_id, key=None)   key: the deployment's MAC key
    build(setting, below) -> DiskTier | None       what the config asks for (tiering.build)
    name ("disk"), below, contains(hash), lookup(hashes), discard(hashes), names(), figures() -> TierStats
    store(entries, ready, done)                    the host slots' bytes written, in the background
    load(hashes, buffers) -> [error | None]        read and verified into the host's buffers
    flush(), drop_page_cache(method) -> str, probe_gbps(), files(), close()
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pdserve.protocol.auth import Throttle
from pdserve.protocol.enums import Tier
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.kv_tiers.base import LowerTier, TierSetting
from pdserve.workers.engine.kv_tiers.disk_format import SUFFIX, DiskFile, header, layout_fields, survey
from pdserve.workers.engine.kv_tiers.files import (TMP_MARK, folder_key, mac, open_regular, private_dir, read_all,
                                                   read_gbps, run_with_deadline, write_all)
from pdserve.workers.engine.kv_tiers.stats import TierStats

log = logging.getLogger("pdserve.kv_tiers")

READ_TIMEOUT_S = 10.0  # a read (a hung mount, a FIFO) that takes longer is a miss, and the file forgotten


class DiskTier:
    """Entries on local disk. One file per batch of entries written together (what one eviction
    or spill pushed out: typically one request's run, whose blocks were stored and used together),
    split at max_file_bytes: 32k tokens of a 7B model is 2048 blocks, which as one file per block
    costs 2048 creates, renames and inodes and 2048 opens to read back; as files per run it costs
    a few. A block is still addressed alone, (file, index), so a partial hit reads only its
    blocks, and each block carries its own HMAC-SHA256 (over its hash and bytes, keyed) so a bad
    byte costs that block, not its file, and an entry rewritten by anyone without the key is refused.

    A file: disk_format.py. The key: the deployment's (`key`), else the folder's own KEY_FILE (0600,
    made on first use; `pdserve`, whose deployment keys are new at each start, uses it).
    Written to a temporary name and renamed (atomic); no fsync by default: a cache need not survive
    a crash, and a file the crash truncated fails its size or checksum check, so it is refused.
    On start the directory is indexed (disk_format.survey): what no key of the deployment serves
    (another key, truncated, a writer's leftovers) is deleted; files of another model or layout are
    kept, never served, and counted against capacity_bytes (evicted first). LRU by file.
    Reads verify every block; a mismatch is a miss (logged, throttled; the entry forgotten), never
    served. A read that outlasts read_timeout_s is a miss too: its file is forgotten (never waited on
    again), and the bytes it may still bring land in a buffer of its own, never in the caller's."""

    name = Tier.DISK.value
    SUFFIX = SUFFIX

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, layout: KVLayout, model_id: str,
                 *, fsync: bool = False, read_threads: int = 8, max_file_bytes: int = 256 << 20,
                 key: bytes | None = None, read_timeout_s: float = READ_TIMEOUT_S, below: LowerTier | None = None):
        self.below = below  # entries leave this tier only by eviction: none move down; lookup, discard, flush reach it
        self.dir = private_dir(Path(directory))
        self._key = key if key is not None else folder_key(self.dir)
        self.read_timeout_s = read_timeout_s
        self.read_threads = read_threads
        self._warn = Throttle(log)
        self.layout = layout
        self.model_id = model_id
        self.entry_bytes = layout.num_layers * layout.block_bytes
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.max_file_entries = max(1, max_file_bytes // self.entry_bytes)
        self._meta = {"model": model_id, "layout": layout_fields(layout), "entry_bytes": self.entry_bytes}
        self._files: OrderedDict[str, DiskFile] = OrderedDict()  # LRU first
        self._other: OrderedDict[str, int] = OrderedDict()  # another model or layout's files: name -> bytes
        self._where: dict[bytes, tuple[str, int]] = {}  # hash -> (file, index)
        self._bytes = 0
        self._stats = TierStats(self.name, capacity_bytes=capacity_bytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # write jobs queued or running
        self._index()
        self._macs = ThreadPoolExecutor(read_threads, thread_name_prefix="pdserve-kv-disk-mac")  # writes' MACs
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pdserve-kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- start: what a previous worker left --------------------------------------------------

    def _index(self) -> None:
        found = survey(self.dir, self._key, self._meta, self.entry_bytes)
        for f in found.files:
            self._add_file(f)
        self._other = OrderedDict(found.other)
        self._bytes += sum(found.other.values())
        self._evict_over_capacity()
        if found.files:
            log.info("disk tier %s: %d entries in %d files reused", self.dir, len(self._where), len(self._files))

    def _add_file(self, f: DiskFile) -> None:
        for i, h in enumerate(f.hashes):
            if h not in self._where:
                self._where[h] = (f.name, i)
                f.live += 1
        self._files[f.name] = f
        self._bytes += f.size
        if f.live == 0:
            self._remove_file(f.name)

    def _remove_file(self, name: str, unlink: bool = True) -> None:
        f = self._files.pop(name)
        for i, h in enumerate(f.hashes):
            if self._where.get(h) == (name, i):
                del self._where[h]
        self._bytes -= f.size
        self._stats.evicted += f.live
        if unlink:
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass

    def _evict_over_capacity(self) -> None:
        while self._bytes > self.capacity_bytes and self._other:  # what this worker cannot serve goes first
            name, size = self._other.popitem(last=False)
            self._bytes -= size
            (self.dir / name).unlink(missing_ok=True)
        while self._bytes > self.capacity_bytes and self._files:
            self._remove_file(next(iter(self._files)))

    # ---- for the host tier -------------------------------------------------------------------

    def contains(self, h: bytes) -> bool:
        return h in self._where

    def lookup(self, hashes: list[bytes]) -> list[str]:
        out = []
        for h in hashes:
            with self._lock:
                found = h in self._where
                self._stats.hits += found
                self._stats.misses += not found
            got = [self.name] if found else self.below.lookup([h]) if self.below is not None else []
            if not got:
                break
            out += got
        return out

    def store(self, entries: list[tuple[bytes, memoryview]], ready: Callable[[], None] | None = None,
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
        macs = list(self._macs.map(lambda entry: mac(self._key, *entry), group))
        head = header(self._key, self._meta, [(h, m) for (h, _), m in zip(group, macs)])
        name = f"{uuid.uuid4().hex}{self.SUFFIX}"
        tmp = self.dir / f".{name}{TMP_MARK}{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, memoryview(head))
            for _, buf in group:
                write_all(fd, buf)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, self.dir / name)
        f = DiskFile(name, [h for h, _ in group], macs, len(head), len(head) + len(group) * self.entry_bytes, 0)
        with self._lock:
            self._add_file(f)
            self._stats.stored_bytes += len(group) * self.entry_bytes
            self._evict_over_capacity()

    def load(self, hashes: list[bytes], buffers: list[memoryview]) -> list[str | None]:
        """Read each entry into its buffer (entry_bytes, writable) and verify it; per entry None or
        why it was refused. A refused entry is forgotten: the next lookup misses it. Returns within
        read_timeout_s (plus the copies in progress): what has not been read by then is refused."""
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
        parts = [(files[name], part[i:i + chunk]) for name, part in tasks.items() for i in range(0, len(part), chunk)]
        late = self._read_parts(parts, hashes, buffers, errors)
        with self._lock:
            for name in late:  # a read that hung (a FIFO, a hung mount): never waited on again
                if name in self._files:
                    self._remove_file(name, unlink=False)
            for k, why in enumerate(errors):
                h = hashes[k]
                if why is None:
                    self._stats.loaded_bytes += self.entry_bytes
                elif h in self._where and self._where[h][0] in files:
                    self._warn("refused", logging.WARNING, "disk tier %s: refusing entry %s: %s", self.dir,
                               h.hex()[:16], why)
                    self._stats.corrupt += 1
                    self._forget(h)
        return errors

    def _read_parts(self, parts: list[tuple[DiskFile, list[tuple[int, int]]]], hashes, buffers, errors) -> set[str]:
        """Read the parts, each entry into a buffer of the reading thread's own, verified, then copied
        into the caller's buffer unless the deadline passed (a read that returns after the caller gave
        up writes nothing the caller handed out). The files whose reads were late."""

        def job(f: DiskFile, part: list[tuple[int, int]]):
            def deliver(k: int, data, why: str | None) -> None:
                if why is None:
                    buffers[k].cast("B")[:] = data
                errors[k] = why
            return lambda guard: self._read_some(f, part, hashes, lambda k, data, why: guard(deliver, k, data, why))

        late = run_with_deadline([job(f, part) for f, part in parts], self.read_threads, self.read_timeout_s)
        why = f"read timed out after {self.read_timeout_s:.0f}s (a hung mount or a file that is not one)"
        for j in late:
            f, part = parts[j]
            for k, _ in part:
                if errors[k] is None:
                    errors[k] = f"{f.name}: {why}"
        return {parts[j][0].name for j in late}

    def _read_some(self, f: DiskFile, part: list[tuple[int, int]], hashes, deliver) -> None:
        try:
            fd = open_regular(self.dir / f.name)
        except OSError as e:
            for k, _ in part:
                deliver(k, None, f"{f.name}: {e}")
            return
        own = bytearray(self.entry_bytes)
        try:
            for k, i in part:
                try:
                    got = read_all(fd, memoryview(own), f.payload_offset + i * self.entry_bytes)
                except OSError as e:
                    why = f"{f.name}: {e}"
                else:
                    why = None if got == self.entry_bytes else f"{f.name}: short read, {got} of {self.entry_bytes} bytes"
                if why is None and (f.hashes[i] != hashes[k] or
                                    not hmac.compare_digest(mac(self._key, hashes[k], own), f.macs[i])):
                    why = f"{f.name}: checksum (MAC) mismatch on entry {i}"
                if not deliver(k, own, why):
                    return
        finally:
            os.close(fd)

    def _forget(self, h: bytes) -> None:
        name, _ = self._where.pop(h)
        f = self._files[name]
        f.live -= 1
        if f.live == 0:
            self._remove_file(name)

    def discard(self, hashes: list[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._where:
                    self._forget(h)
        if self.below is not None:
            self.below.discard(hashes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed); False on timeout."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._pending == 0, timeout)
        if self.below is not None:
            self.below.flush()
        return done

    def names(self) -> list[bytes]:
        """The names this tier holds now (the router's index)."""
        with self._lock:
            return list(self._where)

    def figures(self) -> TierStats:
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
                fd = open_regular(path)
            except OSError:
                continue
            try:
                os.fdatasync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"

    def probe_gbps(self, nbytes: int = 16 << 20) -> float:
        """Read bandwidth of a file written, synced and dropped from the page cache (GB/s)."""
        return read_gbps(self.dir, nbytes)

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._macs.shutdown(wait=True)
        if self.below is not None:
            self.below.close()


def build(setting: TierSetting, below: LowerTier | None) -> DiskTier | None:
    """The disk tier, if the config asks for one (--disk-cache-dir)."""
    config = setting.config
    if not config.disk_cache_dir:
        return None
    return DiskTier(config.disk_cache_dir, int(config.disk_cache_gb * 2**30), setting.layout, setting.model_name,
                    key=setting.key, below=below)

