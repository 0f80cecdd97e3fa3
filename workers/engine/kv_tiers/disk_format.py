"""The disk tier's file format, and what a start finds in its folder (disk.py writes, indexes, reads).

A file: MAGIC, (json length, HMAC of the json), json {model, layout (KVLayout without num_blocks),
entry_bytes, entries: [[hash hex, HMAC hex], ...]}, padding to 4 KiB, the entries (entry_bytes each).
    header(key, meta, entries) -> bytes           what a new file starts with (page-aligned)
    read_header(path, key, meta, entry_bytes) -> DiskFile   or Unservable / OtherSetting
    survey(folder, key, meta, entry_bytes) -> Survey         at start: what earlier workers left

What a start keeps, and what it reclaims (a folder is one deployment's, so what its key cannot serve is
nobody's: without this, every start under new keys left its predecessor's entries on disk, unserved and
outside the tier's size):
    files of this model and layout under this key    indexed: served, LRU by file
    files under this key of another model or layout  kept (a worker of that setting can serve them) and
                                                     counted against the tier's size, evicted first
    files no key of ours can serve: another key (or  deleted, logged in one line
    a header rewritten), truncated, an older format
    temporary files of a writer that is gone (its    deleted
    pid is not alive, or it is older than STALE_TMP_S)
Anything else in the folder (kv.key, a file that is not a regular file of this user) is left alone.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.kv_tiers.files import MAC, MAC_BYTES, TMP_MARK, align, is_own_regular, open_regular

log = logging.getLogger("pdserve.kv_tiers")

MAGIC = b"PDSKV02\n"  # 01: crc32s, not keyed; such files are reclaimed
HEAD = struct.Struct(f"<Q{MAC_BYTES}s")  # header JSON length, its MAC
SUFFIX = ".kv"
STALE_TMP_S = 3600.0  # a write takes seconds: a temporary file this old is left over, whoever has its pid now


class Unservable(ValueError):
    """A file no key of this deployment serves: another key, a rewritten header, truncated, another format."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind} ({detail})" if detail else kind)
        self.kind = kind


class OtherSetting(ValueError):
    """A sound file of this deployment, written for another model or layout."""


@dataclass
class DiskFile:
    name: str
    hashes: list[bytes]
    macs: list[str]
    payload_offset: int
    size: int
    live: int = 0  # entries still indexed from this file


@dataclass
class Survey:
    files: list[DiskFile] = field(default_factory=list)  # servable, oldest first
    other: dict[str, int] = field(default_factory=dict)  # another model or layout: name -> bytes, oldest first
    reclaimed_files: int = 0
    reclaimed_bytes: int = 0


def layout_fields(layout: KVLayout) -> dict:
    fields = asdict(layout)
    fields.pop("num_blocks")  # a restarted worker may size its pool differently
    return fields


def header(key: bytes, meta: dict, entries: list[tuple[bytes, str]]) -> bytes:
    """MAGIC, the signed JSON of `meta` and the entries' (hash, MAC), padded to a page."""
    text = json.dumps({**meta, "entries": [[h.hex(), m] for h, m in entries]}).encode()
    head = MAGIC + HEAD.pack(len(text), hmac.digest(key, text, MAC)) + text
    return head + b"\0" * (align(len(head)) - len(head))


def read_header(path: Path, key: bytes, meta: dict, entry_bytes: int) -> DiskFile:
    """The file's index, if this key signed it for `meta`'s model and layout; OSError if it cannot be
    opened as a regular file of ours."""
    fd = open_regular(path)
    with open(fd, "rb") as fh:
        head = fh.read(len(MAGIC) + HEAD.size)
        if len(head) < len(MAGIC) + HEAD.size or head[:len(MAGIC)] != MAGIC:
            raise Unservable("not a pdserve KV file of this version", "bad magic")
        length, signed = HEAD.unpack(head[len(MAGIC):])
        if length > 1 << 28:
            raise Unservable("header unreadable", f"length {length} is implausible")
        text = fh.read(length)
        size = os.fstat(fd).st_size
    if len(text) != length or not hmac.compare_digest(hmac.digest(key, text, MAC), signed):
        raise Unservable("header MAC mismatch", "written with another key, rewritten, or truncated")
    try:
        theirs = json.loads(text)
        entries = [(bytes.fromhex(h), str(m)) for h, m in theirs["entries"]]
    except (ValueError, KeyError, TypeError) as e:  # signed by us, so never in practice
        raise Unservable("header unreadable", str(e)) from None
    if theirs.get("model") != meta["model"]:
        raise OtherSetting(f"written for model {theirs.get('model')!r}, this worker serves {meta['model']!r}")
    if theirs.get("layout") != meta["layout"] or theirs.get("entry_bytes") != entry_bytes:
        raise OtherSetting(f"written for layout {theirs.get('layout')}, this worker has {meta['layout']}")
    offset = align(len(MAGIC) + HEAD.size + length)
    if size != offset + len(entries) * entry_bytes:
        raise Unservable("truncated", f"{size} bytes, its header says {offset + len(entries) * entry_bytes}")
    return DiskFile(path.name, [h for h, _ in entries], [m for _, m in entries], offset, size)


def survey(folder: Path, key: bytes, meta: dict, entry_bytes: int) -> Survey:
    """What a start finds in `folder` (the module docstring's table); deletes what no key serves."""
    out = Survey()
    why: Counter[str] = Counter()
    now = time.time()
    for tmp in folder.glob(f".*{TMP_MARK}*"):
        if is_own_regular(tmp) and _left_over(tmp, now):
            why["partial (its writer is gone)"] += _reclaim(tmp, out)
    paths = sorted((p for p in folder.glob("*" + SUFFIX) if is_own_regular(p)), key=lambda p: p.lstat().st_mtime)
    for path in paths:
        try:
            out.files.append(read_header(path, key, meta, entry_bytes))
        except OtherSetting as e:
            out.other[path.name] = path.lstat().st_size
            log.info("disk tier %s: keeping %s, not serving it: %s", folder, path.name, e)
        except Unservable as e:
            why[e.kind] += _reclaim(path, out)
        except OSError as e:  # vanished, or not ours to open: left alone
            log.warning("disk tier %s: not serving %s: %s", folder, path.name, e)
    if out.reclaimed_files:
        log.info("disk tier %s: reclaimed %d files (%.1f MiB) that no key of this deployment serves: %s", folder,
                 out.reclaimed_files, out.reclaimed_bytes / 2**20, ", ".join(f"{w}: {n}" for w, n in why.items() if n))
    return out


def _left_over(tmp: Path, now: float) -> bool:
    """A temporary file of ours (.NAME.tmp-PID) whose writer is gone, or that is too old to be written still."""
    try:
        os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
    except (ValueError, OverflowError):
        return False  # not a name we write
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process has that pid now
        pass
    return now - tmp.lstat().st_mtime > STALE_TMP_S


def _reclaim(path: Path, out: Survey) -> int:
    try:
        size = path.lstat().st_size
        path.unlink()
    except OSError:
        return 0
    out.reclaimed_files += 1
    out.reclaimed_bytes += size
    return 1
