"""The disk tier across restarts: a deployment's key is kept (an entry written before a restart is
served after it, also under `pdserve`, which makes new CURVE keys at each start), and what no key of
the deployment serves is reclaimed at start, so the folder stays within the tier's size however often
it restarts; files of another model are kept but counted against that size."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.server import cli
from pdserve.settings.keys import new_deployment
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.kv_tiers.disk import DiskTier
from pdserve.workers.engine.kv_tiers.disk_format import MAGIC
from pdserve.workers.engine.kv_tiers.files import KEY_FILE, folder_key

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=16)
ENTRY = LAYOUT.num_layers * LAYOUT.block_bytes  # 1 KiB
FILE = 4096 + 4 * ENTRY  # a file of 4 entries: a page of header, then the entries
CAPACITY = 5 * FILE // 2  # room for two such files, not three


def batch(tag: str, seed: int) -> list[tuple[bytes, memoryview]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"{tag}-{i}".encode().ljust(16, b"."), memoryview(torch.randn(ENTRY // 4, generator=g).numpy().tobytes()))
            for i in range(4)]


def fill(tier: DiskTier, tag: str, files: int = 3) -> list[tuple[bytes, memoryview]]:
    """More files than the tier holds, one batch each; the last batch (still on disk)."""
    for k in range(files):
        last = batch(f"{tag}{k}", k)
        tier.store(last)
        assert tier.flush(10)
    return last


def on_disk(folder: Path) -> int:
    """Bytes of everything in the folder but the key file."""
    return sum(p.lstat().st_size for p in folder.iterdir() if p.name != KEY_FILE)


def served(tier: DiskTier, entries) -> bool:
    bufs = [bytearray(ENTRY) for _ in entries]
    errors = tier.load([h for h, _ in entries], [memoryview(b) for b in bufs])
    return all(e is None for e in errors) and [bytes(b) for b in bufs] == [bytes(m) for _, m in entries]


def test_restarts_under_new_keys_keep_the_folder_within_its_size(tmp_path):
    """What `pdserve` did at each start: a new deployment key. Before: each start's files stayed, unserved
    and uncounted (3 starts: 3x the tier's size on disk). Now each start reclaims what its key cannot serve."""
    for start in range(3):
        tier = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny", key=new_deployment()[1].disk_key())
        assert tier.figures().entries == 0  # nothing of an earlier key is served
        assert on_disk(tmp_path) == 0, f"start {start}: {on_disk(tmp_path)} bytes another key wrote are still there"
        fill(tier, f"s{start}")
        assert tier.figures().bytes == on_disk(tmp_path) <= CAPACITY
        tier.close()
    assert on_disk(tmp_path) <= CAPACITY


def test_an_entry_written_before_a_restart_is_served_after_it(tmp_path):
    """The key kept (the deployment's, or the folder's own): two restarts, the entries of the first start
    are still served, and the folder never passes the tier's size."""
    for key in (new_deployment()[1].disk_key(), None):
        folder = tmp_path / ("deployment" if key else "own")
        tier = DiskTier(folder, CAPACITY, LAYOUT, "tiny", key=key)
        kept = fill(tier, "a")
        tier.close()
        for _ in range(2):
            tier = DiskTier(folder, CAPACITY, LAYOUT, "tiny", key=key)
            assert served(tier, kept) and on_disk(folder) <= CAPACITY
            tier.close()


def test_another_models_files_are_kept_but_count_against_the_size(tmp_path):
    """A restart with another model keeps the first model's files (a switch back serves them) while
    there is room, and evicts them first when there is not: the folder stays within its size."""
    tier = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny")
    first = fill(tier, "t", files=1)
    tier.close()
    other = DiskTier(tmp_path, CAPACITY, LAYOUT, "smollm2-135m")
    assert other.figures().entries == 0 and other.figures().bytes == FILE  # counted, not served
    other.store(batch("o", 9))
    assert other.flush(10)
    other.close()
    back = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny")
    assert served(back, first)  # room for both: kept
    back.close()
    other = DiskTier(tmp_path, CAPACITY, LAYOUT, "smollm2-135m")
    fill(other, "p", files=2)  # no room for three files: the other model's goes first
    assert on_disk(tmp_path) <= CAPACITY and other.figures().bytes == on_disk(tmp_path)
    other.close()
    back = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny")
    assert back.figures().entries == 0
    back.close()


def test_partial_and_foreign_files_are_reclaimed_at_start(tmp_path):
    """A file truncated by a crash, one of an older format, a writer's temporary file whose pid is gone:
    deleted at start. What is not a file of ours (the key, another name, a link) is left alone."""
    tier = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny")
    fill(tier, "x", files=2)
    tier.close()
    truncated, intact = sorted(tmp_path.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    os.truncate(truncated, truncated.stat().st_size - 1)
    (tmp_path / "old.kv").write_bytes(b"PDSKV01\n" + bytes(8192))
    dead = tmp_path / f".{'a' * 32}.kv.tmp-{2**22 + 12345}"  # above pid_max's default: no such process
    dead.write_bytes(bytes(FILE))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    (tmp_path / "link.kv").symlink_to(notes)
    assert MAGIC != b"PDSKV01\n"
    again = DiskTier(tmp_path, CAPACITY, LAYOUT, "tiny")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([KEY_FILE, intact.name, "notes.txt", "link.kv"]), left
    assert again.figures().bytes == intact.stat().st_size
    again.close()


def test_workers_that_start_together_agree_on_the_folders_key(tmp_path):
    keys, start = [], threading.Barrier(8)

    def first_use():
        start.wait()
        keys.append(folder_key(tmp_path))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE]
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600


def publishing(folder: Path, key: bytes) -> Path:
    """The key as another worker leaves it between os.link and removing its temporary name: two links."""
    tmp = folder / f".{KEY_FILE}.0123abcd.tmp-{os.getpid()}"
    tmp.write_bytes(key)
    tmp.chmod(0o600)
    os.link(tmp, folder / KEY_FILE)
    return tmp


def test_a_worker_that_meets_the_key_mid_publication_waits_for_it(tmp_path, monkeypatch):
    """The race the test above can lose: the key is linked but its temporary name not yet removed (two links,
    which open_regular refuses). folder_key waits while that name is there and reads the key once it goes; a
    publisher that died there leaves the two links for good, and the key is refused after the wait."""
    from pdserve.workers.engine.kv_tiers import files

    monkeypatch.setattr(files, "PUBLISH_WAIT_S", 0.5)
    key = os.urandom(32)
    tmp = publishing(tmp_path, key)
    got = []
    reader = threading.Thread(target=lambda: got.append(folder_key(tmp_path)))
    reader.start()
    threading.Event().wait(0.1)  # the reader meets two links and waits
    assert reader.is_alive() and not got
    tmp.unlink()
    reader.join(5)
    assert got == [key]

    stuck = tmp_path / "stuck"
    stuck.mkdir(mode=0o700)
    publishing(stuck, key)
    with pytest.raises(OSError, match="one link"):
        folder_key(stuck)


def test_pdserve_workers_serve_after_a_restart_what_they_wrote_before(tmp_path):
    """Two starts of `pdserve`, each with the new CURVE keys it makes and the worker config it writes:
    the second start's worker serves the disk entries of the first (before: refused, and left on disk)."""
    from pdserve.workers.worker import Worker

    args = cli.pdserve_parser().parse_args(["--model", "tiny", "--num-blocks", "32", "--host-cache-gb", "0.001",
                                            "--disk-cache-dir", str(tmp_path / "disk"), "--disk-cache-gb", "0.01",
                                            "--no-warmup", "--threads", "1"])
    written = None
    for start in range(2):
        [spec] = cli.plan(args, ["cpu"], {"colocated": 1}, "ipc:///nowhere", str(tmp_path / "run"))
        worker = Worker(replace(spec, keys=new_deployment()[1]))
        try:
            disk = worker.engine.tiers.host.below
            entries = [(h, memoryview(os.urandom(disk.entry_bytes))) for h in (b"p" * 16, b"q" * 16)]
            if written is None:
                disk.store(entries)
                assert disk.flush(10)
                written = entries
            else:
                bufs = [bytearray(disk.entry_bytes) for _ in written]
                errors = disk.load([h for h, _ in written], [memoryview(b) for b in bufs])
                assert errors == [None, None], errors
                assert [bytes(b) for b in bufs] == [bytes(m) for _, m in written]
        finally:
            worker.close()
