"""A worker's start, measured: the ready line's parts (workers/engine/start_times.py), the decode graphs'
buckets.

- start_engine on a tiny CPU worker: its ready line names every part (no graphs on the CPU), the parts
  are the record's and never sum past the total; a prefill worker captures nothing, --no-warmup runs
  no request.
- decode_buckets: no block-table bucket wider than the pool (a request never holds more blocks); a
  limit under the first bucket size is a bucket of its own (it looped forever).
"""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.graphs import decode_buckets
from pdserve.workers.engine.start_times import PARTS
from pdserve.workers.status_log import startup_line
from pdserve.workers.warmup import start_engine

PART_NAMES = ("model load", "KV pool", "KV tiers", "engine set-up", "decode graphs", "piecewise graphs",
              "warm-up request", "other")


def shown(line: str) -> dict[str, float]:
    """The seconds the ready line gives each part, by name."""
    figures = {}
    m = re.search(r"ready ([\d.]+) s after start \(model load ([\d.]+) s, then ([\d.]+) s: (.*)\)$", line)
    assert m, line
    figures["total"], figures["model load"], figures["after load"] = float(m[1]), float(m[2]), float(m[3])
    for part in m[4].split(", "):
        name, s = re.fullmatch(r"(?:\d+ )?(.+) ([\d.]+) s", part).groups()
        figures[name] = float(s)
    return figures


def test_ready_line_names_each_part_and_they_sum_to_at_most_the_total():
    engine = start_engine(EngineConfig(model="tiny", num_blocks=64), "colocated")
    s = engine.start
    line = startup_line("colocated-0", "colocated", engine)
    figures = shown(line)
    assert set(PART_NAMES) <= set(figures), line
    assert "; ready " in line and "0 decode graphs 0.00 s" in line and "0 piecewise graphs 0.00 s" in line  # CPU
    assert s.decode_graphs == s.piecewise_graphs == 0
    parts = s.parts()
    assert set(parts) == {attr for attr, _ in PARTS}
    assert all(v >= 0 for v in parts.values()) and s.load_s > 0 and s.warmup_s > 0 and s.kv_pool_s > 0
    assert sum(parts.values()) <= s.total_s and s.other_s >= 0
    assert s.after_load_s == pytest.approx(s.total_s - s.load_s)
    # the line's figures are the record's, rounded to 10 ms
    for attr, name in PARTS:
        assert figures[name] == pytest.approx(getattr(s, attr), abs=0.006), name
    assert figures["total"] == pytest.approx(s.total_s, abs=0.006)
    assert figures["other"] == pytest.approx(s.other_s, abs=0.006)
    assert engine.requests == {} and engine.blocks.num_free == engine.blocks.num_blocks  # the warm-up left nothing


def test_a_prefill_worker_without_warm_up_runs_no_request_and_captures_nothing():
    engine = start_engine(EngineConfig(model="tiny", num_blocks=64), "prefill", warmup=False)
    s = engine.start
    assert s.warmup_s == 0 and s.decode_graphs == 0 and s.total_s >= sum(s.parts().values())
    assert "warm-up request 0.00 s" in startup_line("prefill-0", "prefill", engine)


def test_a_line_before_the_start_is_over_says_nothing_of_it():
    from pdserve.workers.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", num_blocks=64))
    assert engine.start.total_s is None and "ready" not in startup_line("w", "colocated", engine)


def test_decode_buckets_stop_at_the_widest_table_the_pool_holds():
    # qwen2.5-7b's 32k context: 2048 blocks, 8 table buckets, when the pool holds that many or more
    batches, blocks = decode_buckets(64, 2048, 40_000)
    assert batches == [1, 2, 4, 8, 16, 32, 48, 64] and blocks == [16, 32, 64, 128, 256, 512, 1024, 2048]
    # a pool of 100 blocks: no request's table is wider than 100, so no graph wider than that is taken
    assert decode_buckets(64, 2048, 100)[1] == [16, 32, 64, 100]
    assert decode_buckets(64, 2048, 10)[1] == [10]
    assert decode_buckets(64, 50, 1000)[1] == [16, 32, 50]


@pytest.mark.timeout(20)
def test_buckets_below_the_first_size_end_at_the_limit():
    # a limit under the first size (a table bucket for --max-model-len 128: 8 blocks) looped forever,
    # stepping from 0, before a CUDA worker with such a context could take its graphs
    from pdserve.workers.engine.graphs import _buckets

    assert _buckets(8, [16], lambda b: b * 2) == [8]
    assert _buckets(2048, [16], lambda b: b * 2) == [16, 32, 64, 128, 256, 512, 1024, 2048]