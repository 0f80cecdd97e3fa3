"""Fenced reuse in the KV tiers: blocks a reload from disk is still writing into go back to the pool
only once that reload is over (workers/engine/engine.py `_forget`, Tiers.poll(wait=True)), so an abort
while loading never leaves a late copy landing in blocks another request got. The check can fail: with
the wait taken out, the same late copy lands in the freed blocks. (Stores and host slots:
test_kv_tiers.py, test_a_store_reads_the_blocks_before_the_caller_overwrites_them and
test_an_entry_on_its_way_to_disk_is_still_served_and_its_slot_kept; docs/design-fencing.md.)"""

from __future__ import annotations

import time

import pytest
import torch

from test_prefix_tiers import PARAMS, engine, evict_everything, prompt
from pdserve.workers.engine.request import Request, SamplingParams

pytestmark = pytest.mark.timeout(240)

READ_DELAY_S = 0.6  # the disk read of the reload, slowed so that an abort comes while it is in flight


def abort_while_loading(tmp_path, monkeypatch, fenced: bool) -> tuple[float, bool, bool]:
    """(seconds the abort took, whether its blocks went back, whether poison put in them after the abort
    survived the reload's copy)"""
    eng = engine(tmp_path, disk=True, host_gb=0.0001)  # 13 host slots: the prefix ends up on disk only
    p = prompt(4, 70)
    eng.generate([p], PARAMS)
    evict_everything(eng, p)
    eng.tiers.host.below.flush()
    real_read = eng.tiers.host.below.load

    def slow_read(hashes, buffers):
        time.sleep(READ_DELAY_S)
        return real_read(hashes, buffers)

    monkeypatch.setattr(eng.tiers.host.below, "load", slow_read)
    if not fenced:
        real_poll = eng.tiers.poll
        monkeypatch.setattr(eng.tiers, "poll", lambda req, wait=False: real_poll(req, wait=False))
    req = Request("loading", p + [9], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request(req)
    eng.scheduler.schedule()  # admitted: its reload from disk is on its thread
    [(_, tiers, _)] = eng.tiers.loads.values()
    assert tiers == ["disk"] * 4
    blocks = list(req.block_ids[:4])
    start = time.monotonic()
    eng.abort("loading")
    took = time.monotonic() - start
    back = eng.blocks.num_free == eng.blocks.num_blocks
    eng.kv.pool[:, blocks] = float("nan")  # what the next request's KV would be: not the reload's
    time.sleep(READ_DELAY_S + 0.5)
    survived = bool(torch.isnan(eng.kv.pool[:, blocks]).all())
    return took, back, survived


def test_an_abort_while_reloading_from_disk_frees_the_blocks_only_after_the_reload(tmp_path, monkeypatch):
    took, back, survived = abort_while_loading(tmp_path, monkeypatch, fenced=True)
    assert back and survived, (took, back, survived)
    assert took >= READ_DELAY_S * 0.5  # it waited for the read in flight


def test_without_the_wait_the_reloads_late_copy_lands_in_freed_blocks(tmp_path, monkeypatch):
    took, back, survived = abort_while_loading(tmp_path, monkeypatch, fenced=False)
    assert back and not survived and took < READ_DELAY_S, (took, back, survived)
