"""summary.md opens with a verdict in words (bench/load/verdict.py): which arm met the SLOs at the higher
rate and by how much, per point which arm met them and each arm's dominant TTFT phase, and a warning
where arms shared a host's CPU or GPU; and every kind of mark a plot draws is in its legend."""

from __future__ import annotations

import matplotlib.figure
import pytest

from pdserve.bench.load import plots
from pdserve.bench.load.report import markdown
from pdserve.bench.load.metrics import SERVER_PHASES

SPLIT = {"colocated": {"prefill_queue": 900.0, "prefill": 300.0, "client": 10.0},
         "disaggregated": {"prefill_queue": 20.0, "prefill": 290.0, "transfer_exposed": 5.0, "client": 10.0}}


def block(arm: str, rate: float, fraction: float, ttft: float, saturated: bool = False, phase: str = "point"):
    split = dict(SPLIT[arm], ttft=sum(SPLIT[arm].values()), server_ttft=None, first_step=8.0)
    b = {"arm": arm, "policy": arm, "phase": phase, "load_label": f"rate {rate:g}/s", "load_kind": "request rate",
         "request_rate": rate, "completed": 20, "failed": 0, "duration": 10.0, "request_throughput": rate * 0.9,
         "output_throughput": 100.0, "median_ttft_ms": ttft, "p50_ttft_ms": ttft, "p99_ttft_ms": ttft * 2,
         "p90_ttft_ms": ttft * 1.5,
         "median_tpot_ms": 9.0, "p99_tpot_ms": 12.0, "median_itl_ms": 9.0, "p99_itl_ms": 30.0,
         "median_e2el_ms": 900.0, "p99_e2el_ms": 2000.0, "request_goodput": rate * fraction,
         "goodput_fraction": fraction, "goodput_target": 0.9, "meets_goodput_target": fraction >= 0.9,
         "saturation": {"saturated": saturated, "throughput_ratio": 0.9, "lateness_growth": 1.0},
         "timings_reported": 20, "errors": [], "ttft_split_ms": split}
    return b | {f"mean_{n}_ms": 5.0 for n in SERVER_PHASES} | {f"p99_{n}_ms": 9.0 for n in SERVER_PHASES}


def run(blocks, arms=None, gpus=None, policy_runs="separate", base_url="http://127.0.0.1:8000") -> dict:
    return {"results": blocks, "arms": arms or [], "model": "tiny", "base_url": base_url,
            "policies": ["colocated", "disaggregated"], "policy_runs": policy_runs, "workload": "random",
            "environment": {"date": "d", "machine": {"hostname": "h", "platform": "p", "gpus": gpus, "cpu_count": 2},
                            "versions": {}, "git_commit": "abc"},
            "command": "pdserve-bench load", "slos_ms": {"ttft": 3000.0}, "goodput_target": 0.9}


def capacity(rate: float, failing: float) -> dict:
    return {"goodput_target": 0.9, "capacity_rate": rate, "first_failing_rate": failing, "converged": True,
            "probes": [{"rate": rate, "passed": True}, {"rate": failing, "passed": False}]}


def verdict(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("**Verdict** (from the tables below):")
    return [line for line in lines[start + 1:start + 12] if line.startswith("- ")]


def test_the_verdict_says_which_arm_won_where_by_how_much_and_why():
    blocks = [block("colocated", 4, 0.40, 13400.0), block("disaggregated", 4, 0.95, 1700.0),
              block("colocated", 1, 0.95, 900.0), block("disaggregated", 1, 1.0, 600.0)]
    arms = [{"label": "colocated", "policy": "colocated", "server": {"command": "pdserve"},
             "capacity": capacity(1.5, 2)},
            {"label": "disaggregated", "policy": "disaggregated", "server": {"command": "pdserve"},
             "capacity": capacity(16, 32)}]
    lines = verdict(markdown(run(blocks, arms)))
    assert lines.pop(0).startswith("- SLOs judged: TTFT <= 3000 ms; latencies compared at p99")
    assert lines[0] == ("- capacity: **disaggregated** met the SLOs at the higher rate, 16/s against colocated "
                        "1.5/s: 10.67x, +14.5 req/s")
    assert lines[1].startswith("- rate 4/s: **disaggregated** met the SLOs and colocated did not (requests within "
                               "them: colocated 40%, disaggregated 95%)")
    assert "dominant TTFT phase: colocated prefill_queue (74% of TTFT), disaggregated prefill (89% of TTFT)" in lines[1]
    assert lines[2].startswith("- rate 1/s: every arm met the SLOs (colocated 95%, disaggregated 100%); "
                               "**disaggregated** lower on TTFT p99 (1.50x, 1.20 s against 1.80 s), higher on none; "
                               "within 5% on TPOT p99, ITL p99, E2E p99")
    assert any("one CPU for everything" in line and "2 CPU cores" in line for line in lines)


@pytest.mark.parametrize("kw,words", [
    ({"policy_runs": "interleaved"}, "shared at once"),
    ({}, "one server for every arm"),
    ({"gpus": "NVIDIA H200, 143771 MiB, 580.1"}, "one GPU"),
])
def test_shared_hosts_are_warned_about(kw, words):
    blocks = [block("colocated", 2, 0.9, 100.0), block("disaggregated", 2, 0.9, 90.0)]
    arms = [{"label": a, "policy": a, "base_url": "http://127.0.0.1:8000"} for a in ("colocated", "disaggregated")]
    assert any(words in line for line in verdict(markdown(run(blocks, arms, **kw))))


def test_every_mark_a_plot_draws_is_in_its_legend(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: None)
    # only the second arm saturates: its red x must still be named in the legend
    blocks = [block("colocated", r, 0.95, 100.0 * r) for r in (1, 2)] + \
             [block("disaggregated", r, 0.5, 80.0 * r, saturated=r == 2) for r in (1, 2)]
    plots.plot_latency_vs_load(blocks, tmp_path)
    plots.plot_goodput_vs_rate(blocks, tmp_path)
    plots.plot_ttft_split(blocks, tmp_path)
    assert len(figures) == 3
    for fig in figures:
        for ax in fig.axes:
            named = set(ax.get_legend_handles_labels()[1])
            marks = [line for line in ax.lines if line.get_marker() == "x"]
            assert not marks or "past saturation" in named, (ax.get_title(), named)
            unnamed = [c for c in ax.containers if not c.get_label() or c.get_label().startswith("_")]
            drawn = {c.get_label() for c in ax.containers} - {None}
            assert len(ax.containers) == 0 or (unnamed and drawn & named), (ax.get_title(), named)


# ---- every SLO judged: a verdict never rests on TTFT alone --------------------------------------------


def measured(arm: str, ttft_ms: float, gap_ms: float, stall_ms: float = 0.0, n: int = 20, tokens: int = 16) -> dict:
    """A block summarised from per-request records (bench/load/metrics.py): every request's first token after
    ttft_ms (+1 ms per request), then gaps of gap_ms; with stall_ms, one gap of each request is that long."""
    from pdserve.bench.load.metrics import RequestRecord, summarize

    records = []
    for i in range(n):
        gaps = [gap_ms / 1e3] * (tokens - 1)
        if stall_ms:
            gaps[i % len(gaps)] = stall_ms / 1e3
        ttft = (ttft_ms + i) / 1e3
        records.append(RequestRecord(i, arm, 100, tokens, output_len=tokens, start_s=i * 0.1, scheduled_s=i * 0.1,
                                     ttft_s=ttft, itls_s=gaps, e2e_s=ttft + sum(gaps), success=True))
    return {"arm": arm, "policy": arm, "phase": "point", "load_label": "rate 2/s", "request_rate": 2.0,
            **summarize(records, 5.0)}


def no_slo_run(blocks) -> dict:
    arms = [{"label": b["arm"], "policy": b["arm"], "server": {"command": "pdserve"}} for b in blocks]
    return run(blocks, arms) | {"slos_ms": {}, "goodput_target": None}


def test_ttft_for_one_arm_and_tpot_for_the_other_is_a_split_verdict():
    """The CPU report that said "colocated 1.08x lower TTFT" while its decode was the slower: TTFT favours
    colocated, TPOT and ITL favour disaggregated, both within the assumed SLOs: no single winner, and the SLOs
    it assumed (no --goodput) are named."""
    from pdserve.bench.load.verdict import ASSUMED_SLOS_MS, judge

    blocks = [measured("colocated", ttft_ms=600.0, gap_ms=60.0), measured("disaggregated", ttft_ms=650.0, gap_ms=20.0)]
    text = markdown(no_slo_run(blocks))
    lines = verdict(text)
    assert lines[0].startswith("- SLOs judged: TTFT <= 2000 ms, TPOT <= 100 ms, ITL (longest gap of a request) <= "
                               "500 ms (**assumed**: no --goodput was given")
    point = next(line for line in lines if line.startswith("- rate 2/s"))
    assert "every arm met the SLOs (colocated 100%, disaggregated 100%)" in point
    assert "**split, no single winner**: **colocated** lower on TTFT p99" in point
    assert "**disaggregated** lower on TPOT p99 (3.00x, 20 ms against 60 ms), ITL p99 (3.00x" in point
    assert "TTFT p50 is" not in text and "higher on none" not in point
    [judged] = judge(no_slo_run(blocks))["points"]
    assert judged["outcome"] == "split" and judged["winner"] is None
    assert judged["favours"] == {"colocated": ["ttft"], "disaggregated": ["tpot", "itl", "e2el"]}
    assert judge(no_slo_run(blocks))["slos_ms"] == ASSUMED_SLOS_MS and judge(no_slo_run(blocks))["assumed"]


def test_a_stall_past_the_assumed_itl_slo_decides_against_the_lower_ttft():
    """The same report's other half: colocated's TTFT was lower but its streams stalled (ITL p99 1558 ms against
    199): under the assumed ITL SLO colocated misses and disaggregated wins, and the line says which SLO."""
    blocks = [measured("colocated", ttft_ms=1800.0, gap_ms=20.0, stall_ms=1558.0, tokens=64),
              measured("disaggregated", ttft_ms=1940.0, gap_ms=20.0, stall_ms=199.0, tokens=64)]
    point = next(line for line in verdict(markdown(no_slo_run(blocks))) if line.startswith("- rate 2/s"))
    assert point.startswith("- rate 2/s: **disaggregated** met the SLOs and colocated did not (requests within them: "
                            "colocated 0%, disaggregated 100%) (colocated missed ITL (longest gap of a request) "
                            "<= 500 ms (0% within))"), point


def test_given_slos_are_judged_each_and_every_latency_compared():
    """--goodput ttft:1000 tpot:50: both arms meet it; TTFT even, TPOT lower for one arm: that arm is better on
    TPOT and no worse elsewhere (a winner by every latency, not by one alone)."""
    from pdserve.bench.load.verdict import judge

    blocks = [measured("colocated", ttft_ms=500.0, gap_ms=30.0), measured("disaggregated", ttft_ms=505.0, gap_ms=10.0)]
    r = run(blocks, [{"label": b["arm"], "policy": b["arm"], "server": {"command": "x"}} for b in blocks])
    r["slos_ms"] = {"ttft": 1000.0, "tpot": 50.0}
    [judged] = judge(r)["points"]
    assert not judge(r)["assumed"] and judged["outcome"] == "better" and judged["winner"] == "disaggregated"
    assert judged["shares"]["colocated"] == {"each": {"ttft": 1.0, "tpot": 1.0}, "all": 1.0}
    assert [c["lower"] for c in judged["latency"]] == [None, "disaggregated", "disaggregated", "disaggregated"]
    point = next(line for line in verdict(markdown(r)) if line.startswith("- rate 2/s"))
    assert "**disaggregated** lower on TPOT p99" in point and "within 5% on TTFT p99" in point
