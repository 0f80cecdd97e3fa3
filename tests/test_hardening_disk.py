"""The disk tier against a local user and against its own folder (issue 28): what it writes is
private, a folder it cannot trust is refused, entries are authenticated with a key (an entry
rewritten by someone without it is never served), files are opened only if they are regular and
never through a link, and a read that never returns costs a miss within the deadline, never a
wedged load, and never a late write into a buffer that was handed back."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

import pytest
import torch

from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.engine.kv_tiers import disk as disk_module
from pdserve.workers.engine.kv_tiers.disk import DiskTier
from pdserve.workers.engine.kv_tiers.host import HostTier

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=16)
ENTRY = LAYOUT.num_layers * LAYOUT.block_bytes
HASHES = [bytes([i]) * 16 for i in range(1, 5)]


def entries(seed: int) -> list[tuple[bytes, memoryview]]:
    g = torch.Generator().manual_seed(seed)
    return [(h, memoryview(torch.randn(ENTRY // 4, generator=g).numpy().tobytes())) for h in HASHES]


def written(folder, seed: int = 0) -> DiskTier:
    tier = DiskTier(folder, 1 << 20, LAYOUT, "tiny")
    tier.store(entries(seed))
    assert tier.flush(10)
    return tier


def read_back(tier: DiskTier) -> tuple[list, list[bytearray]]:
    bufs = [bytearray(b"\xee" * ENTRY) for _ in HASHES]
    return tier.load(HASHES, [memoryview(b) for b in bufs]), bufs


def test_what_the_disk_tier_writes_is_private(tmp_path):
    folder = tmp_path / "cache"
    written(folder).close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = list(folder.iterdir())
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]


def test_a_folder_readable_by_others_is_made_private(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    written(folder).close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_folder_writable_by_others_or_not_ours_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by others"):
        DiskTier(shared, 1 << 20, LAYOUT, "tiny")
    if os.geteuid() == 0:  # root can hand a folder to another user
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
    else:
        foreign = "/usr"  # root's, not writable by others
    with pytest.raises(ValueError, match="not to this user"):
        DiskTier(foreign, 1 << 20, LAYOUT, "tiny")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="not a folder"):
        DiskTier(link, 1 << 20, LAYOUT, "tiny")


def test_entries_forged_with_another_key_are_never_served(tmp_path):
    """Someone who can put a file in the folder, and knows the format, writes entries under the same
    hashes with different bytes (their checksums recomputed): after a restart none is served."""
    mine = tmp_path / "mine"
    written(mine, seed=1).close()
    theirs = tmp_path / "theirs"
    written(theirs, seed=2).close()
    [real] = mine.glob("*.kv")
    [forged] = theirs.glob("*.kv")
    real.unlink()
    shutil.copyfile(forged, mine / forged.name)
    os.chmod(mine / forged.name, 0o600)
    tier = DiskTier(mine, 1 << 20, LAYOUT, "tiny")
    assert not any(tier.contains(h) for h in HASHES)
    errors, bufs = read_back(tier)
    assert all(e is not None for e in errors) and all(b == b"\xee" * ENTRY for b in bufs)
    tier.close()


def test_links_and_fifos_in_the_folder_are_never_opened(tmp_path):
    folder = tmp_path / "cache"
    written(folder).close()
    [path] = folder.glob("*.kv")
    outside = tmp_path / "outside.kv"
    path.rename(outside)
    (folder / path.name).symlink_to(outside)  # the same bytes, through a link
    os.mkfifo(folder / "0000.kv")  # opening it for reading would block until a writer came
    done = []
    t = threading.Thread(target=lambda: done.append(DiskTier(folder, 1 << 20, LAYOUT, "tiny")), daemon=True)
    t.start()
    t.join(10)
    assert done, "indexing the folder hung on a FIFO"
    assert not any(done[0].contains(h) for h in HASHES)
    done[0].close()


def test_a_file_swapped_for_a_fifo_after_indexing_is_a_miss_at_once(tmp_path):
    tier = written(tmp_path / "cache")
    [path] = (tmp_path / "cache").glob("*.kv")
    path.unlink()
    os.mkfifo(path)
    start = time.monotonic()
    out = []
    t = threading.Thread(target=lambda: out.append(read_back(tier)), daemon=True)
    t.start()
    t.join(10)
    assert out, "a read of a FIFO hung"
    errors, bufs = out[0]
    assert all(e is not None for e in errors) and time.monotonic() - start < 2.0
    assert not any(tier.contains(h) for h in HASHES)
    tier.close()


class Hang:
    """A disk whose reads never return until released (a hung mount): patched over the tier's reads."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        real = disk_module.read_all

        def hanging(fd, buf, offset):
            self.release.wait(30)
            return real(fd, buf, offset)

        monkeypatch.setattr(disk_module, "read_all", hanging)


def test_a_read_that_never_returns_is_a_miss_within_the_deadline_and_writes_nothing_late(tmp_path, monkeypatch):
    tier = written(tmp_path / "cache")
    tier.read_timeout_s = 0.5
    hang = Hang(monkeypatch)
    out = []
    start = time.monotonic()
    t = threading.Thread(target=lambda: out.append(read_back(tier)), daemon=True)
    t.start()
    t.join(10)
    took = time.monotonic() - start
    assert out, "the read waited past 10 s on a disk that does not answer"
    errors, bufs = out[0]
    assert took < 3.0 and all(e is not None and "timed out" in e for e in errors), (took, errors)
    assert not any(tier.contains(h) for h in HASHES)  # forgotten: never waited on again
    hang.release.set()  # the hung reads come back now: the buffers they were for stay untouched
    time.sleep(0.5)
    assert all(b == b"\xee" * ENTRY for b in bufs)
    tier.close()


def test_a_load_over_a_hung_disk_ends_and_the_request_recomputes(tmp_path, monkeypatch):
    """The engine's view: a load from disk on a disk that hangs completes (with an error: recompute)
    within the deadline, so an abort that fences the load never waits unbounded."""
    kv = KVCache(LAYOUT, "cpu")
    kv.pool.copy_(torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(3)))
    disk = DiskTier(tmp_path / "cache", 1 << 20, LAYOUT, "tiny")
    disk.read_timeout_s = 0.5
    tier = HostTier(LAYOUT, 8 * ENTRY, "cpu", below=disk, probe=False)
    tier.store(kv.pool, list(zip(HASHES, [0, 1, 2, 3])))
    tier.spill(HASHES)
    tier.flush()
    assert tier.lookup(HASHES) == ["disk"] * 4
    Hang(monkeypatch)
    kv.pool[:, 8:12] = float("nan")
    start = time.monotonic()
    handle = tier.load(kv.pool, list(zip(HASHES, [8, 9, 10, 11])))
    finished = threading.Thread(target=handle.fence, daemon=True)
    finished.start()
    finished.join(10)
    assert not finished.is_alive(), "fencing a load on a hung disk waited past 10 s"
    assert time.monotonic() - start < 3.0
    assert handle.wait(1) and handle.error is not None and handle.loaded == 0
    assert torch.isnan(kv.pool[:, 8:12]).all()


def test_entries_are_keyed_by_the_deployment_not_by_the_folder(tmp_path):
    """With the deployment's key (WorkerKeys.disk_key, what a worker passes its engine), entries written
    by this deployment are served after a restart, and none written under another deployment's key is,
    even with the folder's own key file in place; the key never lands in the folder."""
    from pdserve.settings.keys import new_deployment
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine

    _, ours = new_deployment()
    _, other = new_deployment()
    assert ours.disk_key() != other.disk_key() and len(ours.disk_key()) == 32
    tier = DiskTier(tmp_path, 1 << 20, LAYOUT, "tiny", key=ours.disk_key())
    tier.store(entries(3))
    assert tier.flush(10)
    tier.close()
    again = DiskTier(tmp_path, 1 << 20, LAYOUT, "tiny", key=ours.disk_key())
    errors, bufs = read_back(again)
    assert all(e is None for e in errors) and [bytes(b) for b in bufs] == [bytes(m) for _, m in entries(3)]
    again.close()
    stranger = DiskTier(tmp_path, 1 << 20, LAYOUT, "tiny", key=other.disk_key())
    errors, bufs = read_back(stranger)
    assert all(e is not None for e in errors) and all(b == b"\xee" * ENTRY for b in bufs)
    stranger.close()
    assert all(ours.disk_key() not in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    # the engine hands the key it was given to its disk tier
    e = Engine(EngineConfig(model="tiny", num_blocks=32, host_cache_gb=0.01, disk_cache_dir=str(tmp_path / "e")),
               disk_key=ours.disk_key())
    try:
        assert e.tiers.host.below._key == ours.disk_key()
    finally:
        e.close()
