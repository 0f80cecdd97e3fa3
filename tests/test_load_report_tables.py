"""summary.md's tables render (the main one, capacity, server phases, per turn): every table's header, delimiter and body rows have the same number of cells
(a table with one delimiter short renders as raw text), for any set of percentiles."""

from __future__ import annotations

import pytest

from pdserve.bench.load.report import markdown
from pdserve.bench.load.metrics import SERVER_PHASES, pct_name


def _block(arm: str, phase: str, rate: float, ps: list[str]) -> dict:
    b = {"arm": arm, "policy": arm, "phase": phase, "load_label": f"rate {rate:g}/s", "request_rate": rate,
         "completed": 10, "failed": 1, "duration": 4.2, "request_throughput": 2.4, "output_throughput": 310.0,
         "median_tpot_ms": 8.5, "p99_tpot_ms": 12.0, "median_itl_ms": 8.0, "p99_itl_ms": 20.0,
         "median_e2el_ms": 900.0, "p99_e2el_ms": 1500.0, "request_goodput": 2.0, "goodput_fraction": 0.8,
         "meets_goodput_target": False, "saturation": {"saturated": True, "throughput_ratio": 0.6,
                                                       "lateness_growth": 3.0},
         "timings_reported": 10, "errors": ["HTTP 503: draining"]}
    b |= {f"{p}_ttft_ms": 100.0 + i for i, p in enumerate(ps)}
    b |= {f"mean_{n}_ms": 5.0 for n in SERVER_PHASES} | {f"p99_{n}_ms": 9.0 for n in SERVER_PHASES}
    b["per_turn"] = [{"turn": t, "requests": 4, "completed": 4, "mean_prompt_tokens": 1000.0 * (t + 1),
                      "mean_cached_tokens": None if t == 1 else 990.0 * t, "cached_share": None if t == 1 else 0.9,
                      "mean_queue_ms": 1.0, "mean_prefill_ms": None, "mean_reload_ms": 2.0 if t > 1 else None,
                      "mean_reused_tokens": {"device": 10.0, "host": 980.0} if t > 1 else None,
                      **{f"{p}_ttft_ms": 50.0 for p in ps}}
                     for t in (1, 2, 3)]
    return b


def _run(percentiles) -> dict:
    ps = [pct_name(p) for p in percentiles]
    capacity = {"goodput_target": 0.9, "capacity_rate": 2.0, "first_failing_rate": 4.0, "converged": True,
                "probes": [{"rate": 2.0, "passed": True}, {"rate": 4.0, "passed": False}]}
    return {
        "results": [_block("colocated", "probe", 2.0, ps), _block("colocated", "sweep", 4.0, ps)],
        "environment": {"date": "20261201-000000", "machine": {"hostname": "h", "platform": "p", "gpus": None},
                        "versions": {"python": "3.12"}, "git_commit": "abc"},
        "arms": [{"label": "colocated", "policy": "colocated", "base_url": "http://x", "capacity": capacity}],
        "model": "tiny", "base_url": "http://x", "policies": ["colocated"], "workload": "random",
        "command": "pdserve-bench load", "slos_ms": {"ttft": 1000.0}, "goodput_target": 0.9,
    }


def _tables(text: str) -> list[list[list[str]]]:
    """Each table as its rows, each row as its cells."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def check_tables(text: str) -> list[list[list[str]]]:
    """Every table of a summary.md: one delimiter per header cell, every row as wide as the header."""
    tables = _tables(text)
    for rows in tables:
        header, delimiter, *body = rows
        assert all(set(c) == {"-"} for c in delimiter), rows[:2]
        assert len(delimiter) == len(header), f"{len(header)} header cells, {len(delimiter)} delimiters: {rows[:2]}"
        assert body and all(len(r) == len(header) for r in body), (header, body)
    return tables


@pytest.mark.parametrize("percentiles", [(50.0, 90.0, 99.0), (99.0,), (50.0, 90.0, 95.0, 99.0, 99.9)])
def test_every_table_has_one_delimiter_per_header_cell(percentiles):
    text = markdown(_run(percentiles), percentiles)
    tables = check_tables(text)
    assert len(tables) == 4, text  # capacity, the main table, server phases, per turn
    main = tables[1]
    assert main[0][8:8 + len(percentiles)] == [f"TTFT {pct_name(p)}" for p in percentiles]
    assert main[2][:3] == ["colocated", "probe", "rate 2/s"]
    per_turn = tables[3]
    assert len(per_turn) == 2 + 2 * 3  # a row per block and turn
    assert per_turn[0][8:8 + len(percentiles)] == [f"TTFT {pct_name(p)}" for p in percentiles]
