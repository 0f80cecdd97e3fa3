"""The KV tiers below GPU memory: a real KVCache pool, tiny layout, every round trip checked
bitwise against the blocks as they were, into destinations poisoned with NaN first. On the CPU in
CI; on a machine with CUDA every test that takes a pool runs there too (side streams, events,
page-locked slots): `pytest tests/test_kv_tiers.py -k cuda` is the GPU path's quick check."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
import json
import os

import pytest
import torch

from pdserve.protocol.enums import Tier
from pdserve.workers.engine import tiering
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.engine.kv_tiers.base import KVTier, LowerTier, chain
from pdserve.workers.engine.kv_tiers.cost import CostModel
from pdserve.workers.engine.kv_tiers.disk import DiskTier
from pdserve.workers.engine.kv_tiers.disk_format import HEAD, MAGIC
from pdserve.workers.engine.kv_tiers.host import HostTier
from pdserve.workers.engine.kv_tiers.stats import TierStats

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=32)
ENTRY = LAYOUT.num_layers * LAYOUT.block_bytes


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def kv(request):
    cache = KVCache(LAYOUT, request.param)
    cache.pool.copy_(torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def host_tier(kv: KVCache, slots: int, disk: DiskTier | None = None, **kw) -> HostTier:
    return HostTier(LAYOUT, slots * ENTRY, kv.device, below=disk, probe=False, **kw)


def disk_tier(path, entries: int = 64, model: str = "tiny", layout: KVLayout = LAYOUT) -> DiskTier:
    return DiskTier(path, entries * (ENTRY + 8192), layout, model)


def poisoned(pool: torch.Tensor, blocks: list[int]) -> None:
    pool[:, blocks] = float("nan")


def round_trip(tier: HostTier, pool: torch.Tensor, hs: list[bytes], src: list[int], dst: list[int]):
    expected = pool[:, src].clone()
    poisoned(pool, dst)
    handle = tier.load(pool, list(zip(hs, dst)))
    assert handle.wait(10)
    return handle, expected


def test_host_round_trip_is_bitwise(kv):
    tier = host_tier(kv, 16, staging_bytes=3 * ENTRY)  # copies go in chunks of 3 blocks
    hs = hashes("a", 7)
    src = [5, 2, 9, 10, 11, 0, 30]  # scattered GPU blocks, stored into one run of slots
    assert tier.store(kv.pool, list(zip(hs, src))) == 7
    handle, expected = round_trip(tier, kv.pool, hs, src, [12, 13, 20, 21, 22, 3, 4])
    assert handle.error is None and handle.loaded == 7 and handle.bytes == 7 * ENTRY
    assert handle.done() and handle.seconds >= 0 and set(handle.tier_seconds) == {"host"}
    assert torch.equal(kv.pool[:, [12, 13, 20, 21, 22, 3, 4]], expected)
    s = tier.figures()
    assert (s.entries, s.bytes, s.capacity_bytes) == (7, 7 * ENTRY, 16 * ENTRY)
    assert s.stored_bytes == 7 * ENTRY and s.loaded_bytes == 7 * ENTRY
    assert "host" in tier.cost._gbps  # the finished load fed the cost model


def test_a_held_hash_is_not_stored_twice(kv):
    tier = host_tier(kv, 8)
    hs = hashes("a", 3)
    tier.store(kv.pool, list(zip(hs, [0, 1, 2])))
    kv_before = kv.pool[:, [0, 1, 2]].clone()
    kv.pool[:, [0, 1, 2]] = 7.0  # if stored again, the slots would now hold 7s
    assert tier.store(kv.pool, list(zip(hs, [0, 1, 2]))) == 3
    assert tier.figures().stored_bytes == 3 * ENTRY
    handle, _ = round_trip(tier, kv.pool, hs, [0, 1, 2], [5, 6, 7])
    assert handle.error is None and torch.equal(kv.pool[:, [5, 6, 7]], kv_before)


def test_lookup_stops_at_the_first_miss(kv):
    tier = host_tier(kv, 8)
    a, b, c = hashes("x", 3)
    tier.store(kv.pool, [(a, 0), (c, 2)])
    assert tier.lookup([a, b, c]) == ["host"]
    assert tier.lookup([b, a]) == []
    assert tier.lookup([a, c]) == ["host", "host"]
    s = tier.figures()
    assert (s.hits, s.misses) == (3, 2)


def test_lru_eviction_without_disk_drops_the_least_recently_used(kv):
    tier = host_tier(kv, 4)
    old, new = hashes("old", 4), hashes("new", 2)
    tier.store(kv.pool, list(zip(old, [0, 1, 2, 3])))
    tier.load(kv.pool, [(old[0], 10), (old[1], 11)]).wait(10)  # used: now the most recent
    assert tier.store(kv.pool, list(zip(new, [4, 5]))) == 2
    assert [tier.lookup([h]) for h in old] == [["host"], ["host"], [], []]
    assert tier.figures().evicted == 2 and tier.figures().entries == 4


def test_lru_eviction_under_pressure_goes_to_disk_and_comes_back(kv, tmp_path):
    disk = disk_tier(tmp_path)
    tier = host_tier(kv, 8, disk, evict_ahead=0.25)  # 2 slots kept free or on their way to disk
    a, b, c = hashes("a", 6), hashes("b", 2), hashes("c", 2)
    tier.store(kv.pool, list(zip(a, range(6))))
    tier.load(kv.pool, [(a[0], 10), (a[1], 11)]).wait(10)  # used: now the most recent
    tier.store(kv.pool, list(zip(b, [6, 7])))  # fills it: a[2], a[3] leave for disk, in the background
    tier.flush()
    assert tier.lookup(a) == ["host", "host", "disk", "disk", "host", "host"]
    assert tier.below.figures().entries == 2 and len(list(tmp_path.glob("*.kv"))) == 1  # one file per batch
    assert tier.store(kv.pool, list(zip(c, [8, 9]))) == 2  # room was kept: nothing dropped
    tier.flush()
    assert tier.lookup(a[4:]) == ["disk", "disk"] and tier.figures().dropped == 0
    handle, expected = round_trip(tier, kv.pool, a, list(range(6)), [20, 21, 22, 23, 24, 25])
    assert handle.error is None and handle.loaded == 6 and set(handle.tier_seconds) == {"host", "disk"}
    assert torch.equal(kv.pool[:, 20:26], expected)
    assert tier.below.figures().loaded_bytes == 4 * ENTRY and tier.figures().loaded_bytes == (2 + 2) * ENTRY


def test_without_room_kept_the_filling_store_is_dropped_not_waited_for(kv, tmp_path):
    tier = host_tier(kv, 4, disk_tier(tmp_path), evict_ahead=0.0)
    old, new = hashes("old", 4), hashes("new", 2)
    tier.store(kv.pool, list(zip(old, range(4))))
    assert tier.store(kv.pool, list(zip(new, [4, 5]))) == 0  # the LRU pair is still being written
    assert tier.figures().dropped == 2
    tier.flush()
    assert tier.lookup(old[:2]) == ["disk", "disk"] and tier.slots.num_free == 2


def test_evict_ahead_keeps_room_for_the_next_store(kv, tmp_path):
    tier = host_tier(kv, 8, disk_tier(tmp_path), evict_ahead=0.5)
    first, second = hashes("a", 8), hashes("b", 4)
    tier.store(kv.pool, list(zip(first, range(8))))  # fills it; 4 more leave for disk at once
    tier.flush()
    assert tier.slots.num_free == 4
    assert tier.store(kv.pool, list(zip(second, range(8, 12)))) == 4  # room now, no drop
    assert tier.figures().dropped == 0
    tier.flush()
    assert tier.lookup(first[:4]) == ["disk"] * 4


def test_disk_round_trip_promotes_to_host(kv, tmp_path):
    tier = host_tier(kv, 8, disk_tier(tmp_path))
    hs = hashes("d", 5)
    tier.store(kv.pool, list(zip(hs, [1, 3, 5, 7, 9])))
    assert tier.spill(hs) == 5
    tier.flush()
    assert tier.lookup(hs) == ["disk"] * 5 and tier.figures().entries == 0
    handle, expected = round_trip(tier, kv.pool, hs, [1, 3, 5, 7, 9], [20, 21, 22, 23, 24])
    assert handle.error is None and torch.equal(kv.pool[:, 20:25], expected)
    assert tier.lookup(hs) == ["host"] * 5  # read back into host slots, and still on disk
    assert tier.below.figures().entries == 5


def spilled(kv, path, hs, blocks, model="tiny"):
    """A worker that stored these blocks, spilled them to disk and stopped."""
    tier = host_tier(kv, 8, disk_tier(path, model=model))
    tier.store(kv.pool, list(zip(hs, blocks)))
    tier.spill(hs)
    tier.close()


def test_a_restarted_disk_tier_reuses_valid_entries(kv, tmp_path):
    hs = hashes("r", 4)
    spilled(kv, tmp_path, hs, [0, 1, 2, 3])
    tier = host_tier(kv, 8, disk_tier(tmp_path))
    assert tier.lookup(hs) == ["disk"] * 4
    handle, expected = round_trip(tier, kv.pool, hs, [0, 1, 2, 3], [10, 11, 12, 13])
    assert handle.error is None and torch.equal(kv.pool[:, 10:14], expected)


@pytest.mark.parametrize("other", [
    {"model": "smollm2-135m"},
    {"layout": KVLayout(3, 2, 8, "float32", 4, 99)},  # another pool size only: still served
    {"layout": KVLayout(3, 2, 8, "bfloat16", 8, 32)},  # same entry bytes, another dtype and block size
    {"layout": KVLayout(3, 4, 4, "float32", 4, 32)},  # same entry bytes, other heads x dim
])
def test_a_restarted_disk_tier_refuses_another_model_or_layout(kv, tmp_path, other):
    hs = hashes("r", 3)
    spilled(kv, tmp_path, hs, [0, 1, 2])
    layout = other.get("layout", LAYOUT)
    disk = disk_tier(tmp_path, model=other.get("model", "tiny"), layout=layout)
    served = layout.compatible_with(LAYOUT) and "model" not in other
    assert [disk.contains(h) for h in hs] == [served] * 3
    assert len(list(tmp_path.glob("*.kv"))) == 1  # not served, not deleted either


def test_a_corrupt_byte_is_a_miss_never_served(kv, tmp_path):
    hs = hashes("c", 4)
    spilled(kv, tmp_path, hs, [0, 1, 2, 3])
    [path] = tmp_path.glob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 2 * ENTRY + 5] ^= 0x01  # one bit of entry 2 (of 0..3)
    path.write_bytes(bytes(raw))
    tier = host_tier(kv, 8, disk_tier(tmp_path))
    assert tier.lookup(hs) == ["disk"] * 4  # the header is sound: the payload is checked on read
    expected = kv.pool[:, [0, 1, 2, 3]].clone()
    poisoned(kv.pool, [10, 11, 12, 13])
    handle = tier.load(kv.pool, list(zip(hs, [10, 11, 12, 13])))
    assert handle.wait(10)
    assert handle.error is not None and "checksum" in handle.error and handle.loaded == 2
    assert torch.equal(kv.pool[:, [10, 11]], expected[:, :2])
    assert torch.isnan(kv.pool[:, 12]).all()  # the corrupt entry never reached the pool
    assert torch.equal(kv.pool[:, 13], expected[:, 3])  # its intact neighbour did
    assert tier.lookup(hs) == ["host", "host"]  # forgotten: the next lookup stops there
    assert tier.below.figures().corrupt == 1


def test_a_corrupt_header_is_not_indexed(kv, tmp_path):
    hs = hashes("h", 2)
    spilled(kv, tmp_path, hs, [0, 1])
    [path] = tmp_path.glob("*.kv")
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"tiny"')
    raw[at + 1] = ord("T")  # the model name, inside the checksummed header
    path.write_bytes(bytes(raw))
    assert raw.startswith(MAGIC)
    assert not disk_tier(tmp_path).contains(hs[0])
    path.write_bytes(bytes(raw[:len(raw) - 100]))  # truncated, header restored or not
    assert not disk_tier(tmp_path).contains(hs[0])


def test_a_truncated_file_is_not_indexed(kv, tmp_path):
    hs = hashes("t", 2)
    spilled(kv, tmp_path, hs, [0, 1])
    [path] = tmp_path.glob("*.kv")
    os.truncate(path, path.stat().st_size - 1)
    assert not disk_tier(tmp_path).contains(hs[0])


def test_disk_is_lru_by_size(kv, tmp_path):
    one_file = 4096 + 2 * ENTRY  # the header page + two entries
    disk = DiskTier(tmp_path, 2 * one_file + 100, LAYOUT, "tiny")
    tier = host_tier(kv, 8, disk)
    runs = [hashes(f"run{i}", 2) for i in range(3)]
    for i, hs in enumerate(runs):
        tier.store(kv.pool, list(zip(hs, [2 * i, 2 * i + 1])))
        tier.spill(hs)
        tier.flush()
    assert [tier.lookup(hs) for hs in runs] == [[], ["disk"] * 2, ["disk"] * 2]
    assert len(list(tmp_path.glob("*.kv"))) == 2 and disk.figures().bytes <= disk.capacity_bytes


def test_capacity_accounting_returns_to_zero(kv, tmp_path):
    disk = disk_tier(tmp_path)
    tier = host_tier(kv, 6, disk)
    hs = hashes("z", 10)
    tier.store(kv.pool, list(zip(hs[:6], range(6))))
    tier.spill(hs[:3])
    tier.store(kv.pool, list(zip(hs[6:], range(6, 10))))  # evicts to disk under pressure
    tier.flush()
    assert tier.below.figures().entries > 0 and tier.figures().entries > 0
    tier.discard(hs)
    tier.flush()
    host, disk = tier.figures(), tier.below.figures()
    assert (host.entries, host.bytes) == (0, 0) and tier.slots.num_free == 6
    assert (disk.entries, disk.bytes) == (0, 0)
    assert list(tmp_path.glob("*.kv")) == [] and tier.lookup(hs) == []


def test_loading_a_hash_in_no_tier_fails_the_handle(kv):
    tier = host_tier(kv, 4)
    a, b = hashes("m", 2)
    tier.store(kv.pool, [(a, 0)])
    handle = tier.load(kv.pool, [(a, 10), (b, 11)])
    assert handle.wait(10) and handle.loaded == 1 and "in no tier" in handle.error


def test_a_pool_of_another_layout_is_refused(kv):
    tier = host_tier(kv, 4)
    other = KVCache(KVLayout(3, 2, 8, "float32", 8, 8), "cpu")
    with pytest.raises(ValueError, match="does not match"):
        tier.store(other.pool, [(b"x", 0)])
    with pytest.raises(ValueError, match="does not match"):
        tier.load(other.pool, [(b"x", 0)])
    assert tier.slots.num_free == 4 and tier.figures().entries == 0


def test_a_full_store_keeps_its_leading_blocks(kv):
    tier = host_tier(kv, 3)
    hs = hashes("f", 5)
    assert tier.store(kv.pool, list(zip(hs, range(5)))) == 3
    assert tier.lookup(hs) == ["host"] * 3 and tier.figures().dropped == 2


def test_probes_seed_the_cost_model(tmp_path):
    tier = HostTier(LAYOUT, 8 * ENTRY, "cpu", below=DiskTier(tmp_path, 1 << 20, LAYOUT, "tiny"))
    assert tier.cost.bandwidth_gbps("host") > 0 and tier.cost.bandwidth_gbps("disk") > 0
    assert [p.name for p in tmp_path.iterdir()] == ["kv.key"]  # the probe file is gone; the folder's MAC key stays


# ---- the cost model ------------------------------------------------------------------------


def test_cost_model_reloads_before_any_prefill_is_known():
    cost = CostModel(bytes_per_token=57344)
    assert cost.should_reload("host", 1000) and cost.break_even_gbps() is None
    cost.observe_prefill(1000, 0.030)
    assert cost.should_reload("disk", 1000)  # a tier never measured: reload


def test_cost_model_decides_both_ways():
    cost = CostModel(bytes_per_token=57344)
    cost.observe_prefill(32768, 32768 * 37e-6)  # the seed's H100 figure at 32k: 37 us/token
    assert cost.break_even_gbps() == pytest.approx(57344 / 37e-6 / 1e9)  # ~1.55 GB/s
    cost.seed_bandwidth("host", 27.0)
    cost.seed_bandwidth("disk", 0.5)
    assert cost.should_reload("host", 4096) is True
    assert cost.should_reload("disk", 4096) is False
    # smollm2: cheap prefill per token, the break-even climbs past a slow disk
    small = CostModel(bytes_per_token=23040)
    small.observe_prefill(4096, 4096 * 4.2e-6)
    small.seed_bandwidth("disk", 5.0)
    assert small.should_reload("disk", 4096, 23040) is False
    assert small.break_even_gbps() == pytest.approx(23040 / 4.2e-6 / 1e9)
    assert not cost.should_reload("host", 0)


def test_cost_model_follows_observed_loads():
    cost = CostModel(bytes_per_token=1000, alpha=0.5)
    cost.observe_prefill(100, 100 * 1e-6)  # break-even 1 GB/s
    cost.seed_bandwidth("host", 10.0)
    assert cost.should_reload("host", 100)
    cost.observe_load("host", 10**8, 1.0)  # the link turns out to move 0.1 GB/s
    assert cost.bandwidth_gbps("host") == pytest.approx(0.5 * 10.0 + 0.5 * 0.1)
    for _ in range(11):
        cost.observe_load("host", 10**8, 1.0)
    assert cost.bandwidth_gbps("host") == pytest.approx(0.1, rel=0.05)
    assert not cost.should_reload("host", 100)
    cost.observe_prefill(100, 100 * 1e-3)  # prefill got much slower: reload again
    assert cost.should_reload("host", 100)


def test_disk_entries_carry_model_layout_and_checksums(kv, tmp_path):
    hs = hashes("meta", 2)
    spilled(kv, tmp_path, hs, [0, 1])
    [path] = tmp_path.glob("*.kv")
    raw = path.read_bytes()
    meta = json.loads(raw[len(MAGIC) + HEAD.size:raw.index(b"}", raw.index(b'"entries"')) + 1])
    assert meta["model"] == "tiny" and meta["layout"]["block_size"] == 4 and "num_blocks" not in meta["layout"]
    assert [bytes.fromhex(h) for h, _ in meta["entries"]] == hs and all(len(m) == 64 for _, m in meta["entries"])


def test_a_disk_load_without_host_room_goes_through_a_temporary_buffer(kv, tmp_path):
    disk = disk_tier(tmp_path)
    tier = host_tier(kv, 2, disk, evict_ahead=0.0)
    hs = hashes("tmp", 4)
    for pair in (hs[:2], hs[2:]):
        tier.store(kv.pool, list(zip(pair, [hs.index(h) for h in pair])))
        tier.spill(pair)
        tier.flush()
    tier.store(kv.pool, [(b"resident-a", 8), (b"resident-b", 9)])  # the host tier is full again
    handle, expected = round_trip(tier, kv.pool, hs, [0, 1, 2, 3], [20, 21, 22, 23])
    assert handle.error is None and torch.equal(kv.pool[:, 20:24], expected)
    assert tier.lookup(hs) == ["disk"] * 4  # served, not promoted: there was no room


class SlowDisk(DiskTier):
    """A disk tier whose writer waits for the test's go."""

    def __init__(self, *a, **kw):
        import threading

        self.go = threading.Event()
        super().__init__(*a, **kw)

    def _write(self, entries):
        assert self.go.wait(10)
        super()._write(entries)


def test_an_entry_on_its_way_to_disk_is_still_served_and_its_slot_kept(kv, tmp_path):
    disk = SlowDisk(tmp_path, 1 << 20, LAYOUT, "tiny")
    tier = host_tier(kv, 2, disk, evict_ahead=0.0)
    hs = hashes("slow", 2)
    tier.store(kv.pool, list(zip(hs, [0, 1])))
    tier.spill(hs)  # queued; the writer waits
    assert tier.lookup(hs) == ["host", "host"] and tier.slots.num_free == 0
    assert tier.store(kv.pool, [(b"other", 5)]) == 0  # no slot may be reused before it is written
    handle, expected = round_trip(tier, kv.pool, hs, [0, 1], [20, 21])
    assert handle.error is None and torch.equal(kv.pool[:, 20:22], expected)
    disk.go.set()
    tier.flush()
    assert tier.lookup(hs) == ["disk", "disk"] and tier.slots.num_free == 2
    tier.close()


def test_a_dead_writers_temporary_file_is_removed_on_start(tmp_path):
    stale = tmp_path / ".abc.kv.tmp-999999999"  # no such process
    stale.write_bytes(b"half a file")
    disk_tier(tmp_path)
    assert not stale.exists()


def test_a_store_reads_the_blocks_before_the_caller_overwrites_them(kv):
    tier = host_tier(kv, 16)
    hs = hashes("order", 12)
    expected = kv.pool[:, :12].clone()
    tier.store(kv.pool, list(zip(hs, range(12))))
    tier.before_reuse(list(range(12)))  # the current stream now waits for the store's copies
    kv.pool[:, :12] = 0.0  # at once, on the current stream
    handle = tier.load(kv.pool, list(zip(hs, range(16, 28))))
    assert handle.wait(10) and handle.error is None
    assert torch.equal(kv.pool[:, 16:28], expected)


@pytest.mark.parametrize("blocks", [[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26]])
def test_runs_and_scattered_blocks_both_round_trip(kv, blocks):
    """Few runs of consecutive blocks go as strided copies, many as one index kernel."""
    tier = host_tier(kv, 16, staging_bytes=5 * ENTRY)
    assert (len(blocks) > tier.MAX_RUN_COPIES) == (blocks[1] - blocks[0] == 2)
    hs = hashes(f"runs{len(blocks)}", len(blocks))
    tier.store(kv.pool, list(zip(hs, blocks)))
    dst = [b + 1 for b in blocks] if blocks[1] - blocks[0] == 2 else [20, 21, 22, 9, 10, 11]
    handle, expected = round_trip(tier, kv.pool, hs, blocks, dst)
    assert handle.error is None and torch.equal(kv.pool[:, dst], expected)


class MemoryTier:
    """A tier below the host that is not a disk: entries in a dict (what host.py must not need to know)."""

    name, below = "memory", None

    def __init__(self):
        self.entry_bytes, self.held = ENTRY, {}

    def contains(self, h):
        return h in self.held

    def lookup(self, hs):
        return [self.name for _ in itertools.takewhile(self.held.__contains__, hs)]

    def store(self, entries, ready=None, done=None):
        ready and ready()
        self.held.update((h, bytes(buf)) for h, buf in entries)
        done and done(True)

    def load(self, hs, buffers):
        for h, buf in zip(hs, buffers):
            buf.cast("B")[:] = self.held[h]
        return [None] * len(hs)

    def discard(self, hs):
        for h in hs:
            self.held.pop(h, None)

    def names(self):
        return list(self.held)

    def figures(self):
        return TierStats(self.name, entries=len(self.held))

    def probe_gbps(self):
        return 1.0

    def flush(self):
        pass

    def close(self):
        pass


def test_every_tier_answers_its_interface(tmp_path):
    members = [m for m in vars(KVTier) if not m.startswith("_")] + list(KVTier.__annotations__)
    host, disk = host_tier(KVCache(LAYOUT, "cpu"), 2, disk_tier(tmp_path)), MemoryTier()
    for tier in (host, host.below, disk):
        assert [m for m in members if not hasattr(tier, m)] == [], type(tier).__name__
    for tier in (host.below, disk):  # the tiers under another: store and load bytes, as LowerTier says
        for m in ("store", "load"):
            want = list(inspect.signature(getattr(LowerTier, m)).parameters)[1:]
            assert len(inspect.signature(getattr(tier, m)).parameters) == len(want), (type(tier).__name__, m)
    assert [t.name for t in chain(host)] == ["host", "disk"]
    assert all(callable(importlib.import_module(tiering.MODULES[t]).build) for t in Tier)
    host.close()


def test_the_host_tier_drives_any_tier_below_it(kv):
    below = MemoryTier()
    tier = HostTier(LAYOUT, 2 * ENTRY, kv.device, below=below, probe=False, evict_ahead=0.0)
    hs = hashes("below", 4)
    tier.store(kv.pool, list(zip(hs[:2], [0, 1])))
    assert tier.spill(hs[:2]) == 2  # down to the tier below
    tier.flush()
    tier.store(kv.pool, list(zip(hs[2:], [2, 3])))
    assert tier.lookup(hs) == ["memory", "memory", "host", "host"] and len(below.held) == 2
    handle, expected = round_trip(tier, kv.pool, hs, [0, 1, 2, 3], [20, 21, 22, 23])
    assert handle.error is None and torch.equal(kv.pool[:, 20:24], expected)
    assert set(handle.tier_seconds) == {"host", "memory"}
    tier.discard(hs)
    assert below.held == {} and tier.lookup(hs) == []
