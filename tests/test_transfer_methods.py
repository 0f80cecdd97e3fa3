"""`pdserve-bench transfer`'s variants beside the plain transports: zmq through CURVE (the bench's
own keys in both processes) and ipc / nixl over fragmented pools (both pools scattered first, as a
prior mixed workload leaves them): exact like every other row, and the fragmented rows really move
many runs where the plain ones move one."""

from __future__ import annotations

import pytest

from pdserve.bench.transfer.pools import parse_method, scatter
from pdserve.settings.worker import EngineConfig
from pdserve.protocol.enums import MODES
from test_transfer_engine import assert_all_exact, run_bench
from pdserve.workers.engine.engine import Engine

pytestmark = pytest.mark.timeout(600)

METHODS = ("ipc", "ipc-fragmented", "nixl-fragmented", "zmq-curve")


def test_curve_and_fragmented_rows_are_exact(tmp_path):
    result = run_bench(tmp_path, "--model", "tiny", "--device", "cpu", "--lengths", "256", "--repeats", "1",
                       "--warmup", "0", "--no-seed-method", "--transports", ",".join(METHODS))
    assert_all_exact(result, {(t, m) for t in METHODS for m in MODES})
    by = {(r["transport"], r["mode"]): r for r in result["lengths"][0]["results"]}
    assert by["ipc", "bulk"]["runs_per_request"] == 1
    assert by["ipc-fragmented", "bulk"]["runs_per_request"] > 1 and by["nixl-fragmented", "bulk"]["runs_per_request"] > 1
    t = result["targets"]
    assert t["fragmented_runs"] == by["ipc-fragmented", "bulk"]["runs_per_request"]
    assert t["zmq-curve_bulk_gbps"] == pytest.approx(by["zmq-curve", "bulk"]["gbps"])
    assert "zmq-curve bulk >= 3 GB/s" in (tmp_path / "transfer.md").read_text()  # issue 35: 3 through CURVE


def test_methods_parse_and_refuse():
    assert parse_method("zmq-curve") == ("zmq", "curve") and parse_method("nixl-fragmented") == ("nixl", "fragmented")
    for bad in ("ipc-curve", "tcp", "zmq-fast"):
        with pytest.raises(ValueError, match="unknown method"):
            parse_method(bad)


def test_scatter_leaves_short_runs_and_gives_every_block_back():
    engine = Engine(EngineConfig(model="tiny", device="cpu", num_blocks=200, prefix_cache=False))
    free = engine.blocks.num_free
    fillers = scatter(engine, 64, seed=4)
    assert 64 <= engine.blocks.num_free < free
    blocks = engine.reserve("r", 64 * engine.layout.block_size)
    runs = sum(1 for a, b in zip(blocks, blocks[1:]) if b != a + 1) + 1
    assert runs > 8, blocks
    engine.release("r")
    for rid in fillers:
        engine.release(rid)
    assert engine.blocks.num_free == free
