"""Block bookkeeping, without torch."""

import random
import sys

import pytest

from pdserve.workers.engine.block_pool import BlockPool, OutOfBlocks, blocks_for, paired_runs, runs


def test_block_pool_does_not_need_torch():
    assert "pdserve.workers.engine.block_pool" in sys.modules
    import importlib
    import subprocess

    code = "import sys; import pdserve.workers.engine.block_pool; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert importlib.import_module("pdserve.workers.engine.block_pool").BlockPool is BlockPool


def test_contiguous_allocation_and_merge_on_free():
    pool = BlockPool(100)
    a = pool.allocate(10)
    b = pool.allocate(20)
    assert a == list(range(10)) and b == list(range(10, 30))
    pool.free(a)
    # smallest extent that fits: the 10-block hole, not the 70-block tail
    c = pool.allocate(7)
    assert c == list(range(7))
    pool.free(b)
    pool.free(c)
    assert pool.num_free == 100 and pool.extents == [(0, 100)]


def test_fragmented_allocation_uses_largest_extents_first():
    pool = BlockPool(10)
    held = [pool.allocate(1) for _ in range(10)]
    for blk in (held[1], held[2], held[5], held[6], held[7], held[9]):
        pool.free(blk)
    got = pool.allocate(5)
    assert sorted(got) == [1, 2, 5, 6, 7] and runs(got) == [(5, 3), (1, 2)]
    assert pool.num_free == 1


def test_out_of_blocks_and_double_free():
    pool = BlockPool(4)
    got = pool.allocate(4)
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.free(got[:2])
    with pytest.raises(ValueError, match="double free"):
        pool.free([1])
    with pytest.raises(ValueError, match="outside pool"):
        pool.free([7])


def test_allocate_after_keeps_a_request_contiguous():
    pool = BlockPool(8)
    first = pool.allocate(2)
    assert pool.allocate_after(first[-1]) == 2
    other = pool.allocate(1)
    assert other == [3]
    assert pool.allocate_after(2) == 4  # 3 is taken: any free block


def test_random_alloc_free_keeps_invariants():
    rng = random.Random(0)
    pool = BlockPool(257)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not pool.can_allocate(1)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 20)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
        owned = [b for h in held for b in h]
        assert len(owned) == len(set(owned))
        assert pool.num_free + len(owned) == 257
        assert sum(ln for _, ln in pool.extents) == pool.num_free
    for h in held:
        pool.free(h)
    assert pool.extents == [(0, 257)]


def test_runs_and_paired_runs():
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert paired_runs([0, 1, 2, 7], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 1), (7, 21, 1)]
    with pytest.raises(ValueError):
        paired_runs([1], [1, 2])
    assert blocks_for(1, 16) == 1 and blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2


def test_shared_pool_of_a_killed_process_is_removed_by_the_next_one():
    import os
    import subprocess

    code = (
        "import os; from pdserve.workers.engine.kv_cache import KVCache, KVLayout; "
        "c = KVCache(KVLayout(2, 2, 8, 'float32', 16, 4), 'cpu', shared=True); "
        "print(c.shm_path, flush=True); os.kill(os.getpid(), 9)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/pdserve-kv-") and os.path.exists(path)
    from pdserve.workers.engine.kv_cache import KVCache, KVLayout

    cache = KVCache(KVLayout(2, 2, 8, "float32", 16, 4), "cpu", shared=True)
    mine = cache.shm_path
    try:
        assert not os.path.exists(path)
        assert os.path.exists(mine)
    finally:
        cache.close()
    assert not os.path.exists(mine)
