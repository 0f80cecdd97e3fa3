"""Cold runs: a run whose first requests are much slower than its later ones, or an arm's first run after a
warm-up that never got steady, is flagged cold (with its reason) and still reported; a steady run is not.
Alone on made-up records, then against the fake server with slow first requests."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.capacity import COLD_MIN_COMPARED, COLD_RATIO, early_slowdown, warmup_not_steady
from pdserve.bench.load.fake_server import FakeConfig, FakeServer
from pdserve.bench.load.metrics import RequestRecord

pytestmark = pytest.mark.alone  # a fake server's latencies against SLOs: a neighbour's CPU burst reads as load


def _records(ttfts_ms, *, kind="short", itl_ms=None, out_len=4):
    recs = []
    for i, t in enumerate(ttfts_ms):
        itl = (itl_ms[i] if itl_ms else 5.0) / 1e3
        recs.append(RequestRecord(index=i, policy=None, prompt_len=10, expected_output_len=out_len,
                                  output_len=out_len, start_s=i * 0.01, ttft_s=t / 1e3,
                                  e2e_s=t / 1e3 + itl * (out_len - 1), success=True,
                                  kind=kind if isinstance(kind, str) else kind[i]))
    return recs


def test_early_slowdown_flags_a_slow_first_quarter_and_not_a_steady_run():
    n = 40
    slow = early_slowdown(_records([100.0] * 10 + [20.0] * 30))
    assert slow["judged"] and slow["ttft_ratio"] == pytest.approx(5.0)
    assert len(slow["reasons"]) == 1 and "TTFT" in slow["reasons"][0] and "5.0x" in slow["reasons"][0]
    # just at the limit is not cold, just past it is
    assert not early_slowdown(_records([40.0] * 10 + [20.0] * 30))["reasons"]
    assert early_slowdown(_records([40.5] * 10 + [20.0] * 30))["reasons"]
    steady = early_slowdown(_records([20.0 + (i % 7) for i in range(n)]))
    assert steady["judged"] and not steady["reasons"] and steady["ttft_ratio"] < COLD_RATIO
    # later requests slower (a queue growing past saturation) is not cold
    assert not early_slowdown(_records([10.0 + 5 * i for i in range(n)]))["reasons"]
    # a slow decode at the start (a graph captured on the first steps) shows in TPOT
    tpot = early_slowdown(_records([20.0] * n, itl_ms=[50.0] * 10 + [5.0] * 30))
    assert [r.split(" (")[0] for r in tpot["reasons"]] == ["the first quarter's median TPOT"]
    assert tpot["tpot_ratio"] == pytest.approx(10.0)


def test_early_slowdown_needs_enough_requests_and_compares_one_kind():
    few = early_slowdown(_records([100.0] * 7 + [20.0] * 24))
    assert few["compared"] == COLD_MIN_COMPARED - 1 and not few["judged"] and not few["reasons"]
    # failed requests do not count
    recs = _records([100.0] * 10 + [20.0] * 30)
    for r in recs[10:20]:
        r.success = False
    assert not early_slowdown(recs)["judged"]
    # long prompts sent first, short ones after: compared within the short ones only, not cold
    kinds = ["long"] * 10 + ["short"] * 40
    mixed = early_slowdown(_records([400.0] * 10 + [20.0] * 40, kind=kinds))
    assert mixed["kind"] == "short" and mixed["compared"] == 40 and not mixed["reasons"]


def test_warmup_not_steady_reason():
    assert warmup_not_steady(None) is None
    assert warmup_not_steady({"steady": True, "median_ttft_ms": [9.0, 9.1]}) is None
    reason = warmup_not_steady({"steady": False, "median_ttft_ms": [300.0, 12.0], "batches": 2, "max_batches": 2,
                                "tolerance": 0.1})
    assert "2 of --warmup-max-batches 2" in reason and "300, 12 ms" in reason


COMMON = ["--num-prompts", "40", "--input-len", "20", "--output-len", "3", "--burstiness", "50", "--no-progress",
          "--no-plots", "--seed", "3"]
# each prefill 5 ms, one at a time: 20 req/s is 10% of what the fake server serves, no queue to speak of
SERVER = dict(itl_ms=1.0, prefill_ms_per_request=5.0, prefill_ms_per_token=0.0)


def _run(tmp_path, cfg: FakeConfig, extra: list[str]) -> dict:
    out = tmp_path / "run"
    with FakeServer(cfg) as srv:
        rc = generator.main(["--base-url", srv.base_url, *COMMON, *extra, "--out", str(out)])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    run["_md"] = (out / "summary.md").read_text()
    return run


def _row(md: str, block: dict) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {block['arm']} | {block['phase']} | "
                                                                  f"{block['load_label']} |"))


def test_a_server_whose_first_requests_are_slow_gets_its_run_flagged_cold(tmp_path):
    """No warm-up, so the run meets the slow first requests itself: its first quarter's TTFT is many times
    the rest's; flagged with the reason, and reported in full all the same."""
    run = _run(tmp_path, FakeConfig(**SERVER, cold_requests=10, cold_ms=150.0),
               ["--request-rate", "20", "--warmup-batch", "0"])
    (b,) = run["results"]
    assert b["completed"] == 40 and b["cold"] is True
    check = b["cold_check"]
    assert check["judged"] and check["compared"] == 40 and check["ttft_ratio"] > COLD_RATIO
    assert "first quarter's median TTFT" in b["cold_reason"] and "warm-up" not in b["cold_reason"]
    assert b["median_ttft_ms"] is not None  # still reported, nothing left out
    row = _row(run["_md"], b)
    assert row.endswith(f"| **yes** ({b['cold_reason']}) |")
    assert "Cold: the run still carries start-up effects" in run["_md"]


def test_a_steady_server_is_not_flagged(tmp_path):
    run = _run(tmp_path, FakeConfig(**SERVER), ["--request-rate", "20", "--warmup-batch", "0"])
    (b,) = run["results"]
    assert b["completed"] == 40 and b["cold"] is False and b["cold_reason"] is None
    assert b["cold_check"]["judged"] and b["cold_check"]["ttft_ratio"] < COLD_RATIO
    assert _row(run["_md"], b).endswith(f"| no ({b['cold_check']['ttft_ratio']:.2f} / "
                                        f"{b['cold_check']['tpot_ratio']:.2f}) |")


def test_an_unsteady_warmup_makes_the_first_run_cold_and_the_capacity_says_it_rests_on_it(tmp_path):
    """The warm-up meets the one slow request and stops at its limit of 2 batches unsteady; the slow request
    is spent, so only the arm's first run (the capacity search's first probe, which is its answer here) is
    cold, by the warm-up rule; the sweep run after it is not."""
    run = _run(tmp_path, FakeConfig(**SERVER, cold_requests=1, cold_ms=300.0),
               ["--capacity-search", "--search-start-rate", "20", "--search-max-probes", "1", "--sweep-factors", "1",
                "--goodput", "ttft:2000", "--warmup-batch", "1", "--warmup-max-batches", "2",
                "--probe-seconds", "0"])  # 40-prompt runs: what is judged here is the warm-up, not the probe length
    (arm,) = run["arms"]
    assert arm["warmup"]["steady"] is False and arm["warmup"]["batches"] == 2
    probe, sweep = run["results"]
    assert (probe["phase"], sweep["phase"]) == ("probe", "sweep")
    assert probe["cold"] and probe["cold_reason"].startswith("first run after a warm-up that ended at its limit")
    assert probe["cold_check"]["judged"] and not probe["cold_check"]["reasons"]  # its own requests were steady
    assert sweep["cold"] is False
    cap = arm["capacity"]
    assert cap["capacity_rate"] == 20.0
    assert cap["rests_on_cold"] == [{"run": "capacity", "rate": 20.0, "reason": probe["cold_reason"]}]
    md = run["_md"]
    cap_row = next(line for line in md.splitlines() if line.startswith("| default | 20.000 |"))
    assert "**capacity run** (20/s)" in cap_row
    assert _row(md, probe).endswith(f"| **yes** ({probe['cold_reason']}) |")
