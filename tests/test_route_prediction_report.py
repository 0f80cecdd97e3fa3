"""The multi-turn report sets the KV-aware router's predicted TTFT (timings.route.predicted_ttft_ms) beside the
TTFT the client measured, per turn: the error of the means and the median per-request error; least-loaded
requests (no prediction) leave the cells '-'."""

from __future__ import annotations

import pytest

from pdserve.bench.load.metrics import RequestRecord, pct_name, per_turn, predicted_ttft
from pdserve.bench.load.report import markdown
from pdserve.protocol.timings import Route, Timings
from test_load_report_tables import _block, _run, _tables, check_tables  # pytest puts tests/ on sys.path


def _record(i: int, turn: int, ttft_ms: float, predicted: float | None, rule: str = "kv") -> RequestRecord:
    route = Route(worker="w0", rule=rule, predicted_ttft_ms=predicted)
    timings = Timings(policy="colocated", queue_ms=ttft_ms * 0.2, prefill_ms=ttft_ms * 0.7, route=route)
    return RequestRecord(index=i, policy="colocated", prompt_len=1000, expected_output_len=4, output_len=4,
                         ttft_s=ttft_ms / 1e3, e2e_s=ttft_ms / 1e3 + 0.03, itls_s=[0.01] * 3, success=True,
                         timings=timings.to_dict(), cached_tokens=0 if turn == 1 else 900, conversation=i,
                         turn=turn)


def test_prediction_beside_the_measured_ttft():
    recs = [_record(0, 2, 100.0, 80.0), _record(1, 2, 200.0, 260.0), _record(2, 2, 300.0, 300.0),
            _record(3, 2, 50.0, None)]  # the worker had measured nothing yet: no prediction, left out
    p = predicted_ttft(recs)
    assert p["predicted_reported"] == 3
    assert p["mean_predicted_ttft_ms"] == pytest.approx(640 / 3)
    assert p["mean_measured_ttft_ms"] == pytest.approx(200.0)
    assert p["predicted_ttft_error"] == pytest.approx(640 / 600 - 1)
    assert p["median_predicted_ttft_abs_error"] == pytest.approx(0.2)  # |errors| 0.2, 0.3, 0.0
    assert p["mean_server_queue_prefill_ms"] == pytest.approx(0.9 * 200.0)
    # a failed request's prediction is not judged against a TTFT it never had
    failed = _record(4, 2, 10.0, 5000.0)
    failed.success = False
    assert predicted_ttft(recs + [failed]) == p


def test_per_turn_rows_and_table_show_the_error_and_dash_without_predictions():
    kv = [_record(0, 1, 900.0, 1000.0), _record(1, 1, 1100.0, 1000.0), _record(2, 2, 100.0, 150.0),
          _record(3, 2, 100.0, 150.0)]
    ll = [_record(i, t, 500.0, None, rule="least-loaded") for i, t in ((0, 1), (1, 1), (2, 2), (3, 2))]
    rows_kv, rows_ll = per_turn(kv), per_turn(ll)
    assert [r["predicted_reported"] for r in rows_kv] == [2, 2]
    assert rows_kv[0]["predicted_ttft_error"] == pytest.approx(0.0)
    assert rows_kv[0]["median_predicted_ttft_abs_error"] == pytest.approx((100 / 900 + 100 / 1100) / 2)
    assert rows_kv[1]["predicted_ttft_error"] == pytest.approx(0.5)
    assert all(r["predicted_reported"] == 0 and r["predicted_ttft_error"] is None for r in rows_ll)

    run = _run((50.0, 90.0, 99.0))
    run["results"] = [_block("kv", "probe", 2.0, [pct_name(p) for p in (50.0, 90.0, 99.0)]) | {"per_turn": rows_kv},
                      _block("least-loaded", "probe", 2.0, [pct_name(p) for p in (50.0, 90.0, 99.0)]) | {"per_turn": rows_ll}]
    text = markdown(run)
    check_tables(text)
    (table,) = [t for t in _tables(text) if "turn" in t[0]]
    head = table[0]
    col_p, col_e = head.index("predicted TTFT (mean, n)"), head.index("pred. error (mean; median abs)")
    kv_turn2 = [r for r in table[2:] if r[0] == "kv" and r[2] == "2"][0]
    assert kv_turn2[col_p] == "150.0 (2)" and kv_turn2[col_e] == "+50%; 50%"
    assert all(r[col_p] == "-" and r[col_e] == "-" for r in table[2:] if r[0] == "least-loaded")
