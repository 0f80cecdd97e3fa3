"""Load-run metric math on hand-built request records."""

from __future__ import annotations

import pytest

from pdserve.bench.load.metrics import RequestRecord, meets_slos, parse_slos, stats_ms, summarize, ttft_split_ms
from pdserve.protocol.phases import NAMES as PHASE_NAMES


def rec(i, ttft, itls, out_len, policy="colocated", prompt_len=100, success=True, timings=None):
    e2e = None if ttft is None else ttft + sum(itls)
    return RequestRecord(index=i, policy=policy, prompt_len=prompt_len, expected_output_len=out_len,
                         output_len=out_len, ttft_s=ttft, itls_s=list(itls), e2e_s=e2e, success=success,
                         error=None if success else "boom", timings=timings)


def test_percentiles_interpolate_linearly():
    s = stats_ms("ttft", [100.0, 200.0, 300.0, 400.0])
    assert s["mean_ttft_ms"] == 250.0 and s["median_ttft_ms"] == 250.0
    # rank p/100 * (n-1): p90 -> 2.7 -> 300 + 0.7 * 100; p99 -> 2.97
    assert s["p90_ttft_ms"] == pytest.approx(370.0) and s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["p50_ttft_ms"] == 250.0
    assert s["std_ttft_ms"] == pytest.approx(111.80339887)
    assert stats_ms("x", [], percentiles=(99.9,)) == {"mean_x_ms": None, "median_x_ms": None, "std_x_ms": None,
                                                      "p99.9_x_ms": None}


def test_tpot_is_decode_time_per_token_after_the_first():
    r = rec(0, 0.1, [0.05, 0.15, 0.1], 4)  # e2e = 0.4
    assert r.tpot_s == pytest.approx((0.4 - 0.1) / 3)
    assert rec(1, 0.1, [], 1).tpot_s is None  # one token: no decode time
    assert rec(2, 0.1, [0.1], 2, success=False).tpot_s is None


def test_summary_fields_from_hand_built_trace():
    records = [
        rec(0, 0.100, [0.010, 0.030], 3, prompt_len=10),
        rec(1, 0.300, [0.020], 2, prompt_len=20),
        rec(2, 0.200, [], 1, prompt_len=30),
        rec(3, None, [], 0, prompt_len=40, success=False),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["num_prompts"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 6  # failed request not counted
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 33.0
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["mean_ttft_ms"] == pytest.approx(200.0)
    # ITLs pooled over requests: 10, 30, 20 ms
    assert s["mean_itl_ms"] == pytest.approx(20.0) and s["median_itl_ms"] == pytest.approx(20.0)
    # TPOT only for output_len > 1: (0.14-0.1)/2 = 20 ms, (0.32-0.3)/1 = 20 ms
    assert s["mean_tpot_ms"] == pytest.approx(20.0)
    assert s["mean_e2el_ms"] == pytest.approx((140 + 320 + 200) / 3)
    assert s["request_goodput"] is None and s["goodput_fraction"] is None
    # vllm's per-request arrays: seconds, every request (failed ones as 0 / [])
    assert s["ttfts"] == [0.1, 0.3, 0.2, 0.0] and s["itls"] == [[0.01, 0.03], [0.02], [], []]
    assert s["input_lens"] == [10, 20, 30, 40] and s["output_lens"] == [3, 2, 1, 0]
    assert s["errors"] == ["", "", "", "boom"]
    assert [r["tpot_s"] for r in s["requests"]][2:] == [None, None]


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0, 0.100, [0.010, 0.010], 3),  # ttft 100, tpot 10
        rec(1, 0.600, [0.010], 2),  # ttft too slow
        rec(2, 0.100, [0.080], 2),  # tpot too slow
        rec(3, 0.050, [], 1),  # one token: any TPOT SLO holds
        rec(4, None, [], 0, success=False),
    ]
    slos = parse_slos(["ttft:500", "tpot:50"])
    assert slos == {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=4.0, slos=slos)
    assert s["request_goodput"] == 0.5 and s["goodput_fraction"] == 2 / 5
    # E2E: 120, 610, 180, 50 ms -> two within 150 ms
    assert summarize(records, 4.0, parse_slos(["e2el:150"]))["request_goodput"] == 0.5


def test_parse_slos_rejects_bad_input():
    for bad in (["ttft"], ["e2e:5"], ["ttft:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    assert parse_slos(None) == {}


def test_server_phases_and_ttft_split():
    colo = {"policy": "colocated", "queue_ms": 10.0, "prefill_ms": 50.0, "transfer_ms": None,
            "transfer_exposed_ms": None, "first_decode_step_ms": 5.0, "ttft_ms": 62.0, "e2e_ms": 100.0,
            "ttft_phases_ms": {"parse": 1.0, "route": 2.0, "inbox": 3.0, "prefill_queue": 4.0, "prefill": 50.0,
                               "transfer_exposed": None, "decode_pickup": None, "hops": 1.5,
                               "first_token_send": 0.5, "unattributed": 0.0}}
    disagg = {"policy": "disaggregated", "queue_ms": 0.0, "prefill_ms": 40.0, "transfer_ms": 8.0,
              "transfer_exposed_ms": 2.0, "first_decode_step_ms": 6.0, "ttft_ms": 44.0, "e2e_ms": 90.0}
    records = [rec(0, 0.070, [0.01], 2, timings=colo),
               rec(1, 0.080, [0.01], 2, timings=dict(colo, queue_ms=20.0, ttft_ms=72.0,
                                                     ttft_phases_ms=dict(colo["ttft_phases_ms"], inbox=13.0))),
               rec(2, 0.050, [0.01], 2, timings=disagg), rec(3, 0.090, [0.01], 2, timings=None)]
    split = ttft_split_ms(records[:2])
    assert list(split)[:len(PHASE_NAMES)] == list(PHASE_NAMES)
    assert split["inbox"] == 8.0 and split["prefill"] == 50.0 and split["transfer_exposed"] == 0.0
    assert split["first_step"] == 5.0 and split["ttft"] == pytest.approx(75.0) and split["server_ttft"] == 67.0
    assert split["client"] == pytest.approx(75.0 - 67.0)  # the client's TTFT less the server's
    parts = sum(split[k] for k in (*PHASE_NAMES, "client"))
    assert parts == pytest.approx(split["ttft"])
    d = ttft_split_ms(records[2:])  # without phases: prefill and exposed transfer placed, the rest unattributed
    assert (d["prefill"], d["transfer_exposed"], d["hops"]) == (40.0, 2.0, 0.0)
    assert d["unattributed"] == pytest.approx(44.0 - 42.0) and d["client"] == pytest.approx(50.0 - 44.0)
    assert d["first_step"] == 6.0  # beside the split: it makes token 2
    assert ttft_split_ms([records[3]]) == dict.fromkeys(d)
    s = summarize(records, 1.0)
    assert s["timings_reported"] == 3
    assert s["mean_queue_ms"] == pytest.approx(10.0) and s["mean_transfer_ms"] == 8.0
    assert s["mean_transfer_exposed_ms"] == 2.0 and s["mean_server_ttft_ms"] == pytest.approx((62 + 72 + 44) / 3)
