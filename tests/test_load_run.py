"""A short real load run against a live (fake) server: the files it writes agree with its own records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.load import generator
from pdserve.bench.load.fake_server import FakeConfig, FakeServer, free_port
from pdserve.bench.load.plots import plot_all

PNGS = ("cdf_ttft.png", "cdf_itl.png", "latency_vs_load.png", "ttft_split.png")
GOODPUT_PNG = "goodput_vs_rate.png"  # drawn when the run had SLOs


def check_block_against_records(block: dict, slos: dict | None = None):
    """Recompute a result block's numbers from its per-request records."""
    reqs = block["requests"]
    ok = [r for r in reqs if r["success"]]
    assert block["completed"] == len(ok) and block["failed"] == len(reqs) - len(ok)
    assert block["total_output_tokens"] == sum(r["output_len"] for r in ok)
    assert block["total_input_tokens"] == sum(r["prompt_len"] for r in ok)
    assert block["request_throughput"] == pytest.approx(len(ok) / block["duration"])
    assert block["output_throughput"] == pytest.approx(block["total_output_tokens"] / block["duration"])
    ttft = np.array([r["ttft_s"] for r in ok]) * 1e3
    itl = np.array([g for r in ok for g in r["itls_s"]]) * 1e3
    e2e = np.array([r["e2e_s"] for r in ok]) * 1e3
    tpot = np.array([(r["e2e_s"] - r["ttft_s"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]) * 1e3
    for name, values in (("ttft", ttft), ("itl", itl), ("e2el", e2e), ("tpot", tpot)):
        assert block[f"median_{name}_ms"] == pytest.approx(np.percentile(values, 50))
        assert block[f"p90_{name}_ms"] == pytest.approx(np.percentile(values, 90))
        assert block[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99))
        assert block[f"mean_{name}_ms"] == pytest.approx(values.mean())
    # every token was timed: ITLs = output tokens - 1 per request (one token per SSE event here)
    for r in ok:
        assert len(r["itls_s"]) == r["output_len"] - 1
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + sum(r["itls_s"]), abs=0.25)  # + reading [DONE]
    assert block["ttfts"] == [r["ttft_s"] for r in reqs]
    assert block["itls"] == [r["itls_s"] for r in reqs]
    if slos:
        good = [r for r in ok if r["ttft_s"] * 1e3 <= slos["ttft"]
                and (r["tpot_s"] is None or r["tpot_s"] * 1e3 <= slos["tpot"])]
        assert block["request_goodput"] == pytest.approx(len(good) / block["duration"])


def own_span(block: dict) -> float:
    reqs = block["requests"]
    return max(r["start_s"] + r["e2e_s"] for r in reqs) - min(r["scheduled_s"] for r in reqs)


def test_interleaved_two_policies_sweep(tmp_path):
    out = tmp_path / "run"
    with FakeServer(FakeConfig(itl_ms=2.0, prefill_ms_per_token=0.02)) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--policies", "colocated,disaggregated",
                        "--policy-runs", "interleaved",
                        "--request-rates", "40,inf", "--num-prompts", "6", "--input-len", "uniform:20:80",
                        "--output-len", "uniform:3:8", "--long-fraction", "0.3", "--long-input-len", "400",
                        "--warmup-batch", "1", "--warmup-max-batches", "2", "--goodput", "ttft:1000", "tpot:100",
                        "--out", str(out), "--no-progress", "--seed", "5"])
        bodies = list(srv.bodies)
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    blocks = run["results"]
    assert [(b["load_label"], b["policy"]) for b in blocks] == [
        ("rate 40/s", "colocated"), ("rate 40/s", "disaggregated"),
        ("rate inf", "colocated"), ("rate inf", "disaggregated")]
    assert [b["request_rate"] for b in blocks] == [40.0, 40.0, "inf", "inf"]
    assert blocks[0]["policy_request_rate"] == 20.0
    assert run["policy_runs"] == "interleaved" and "interleaved" in run["policy_runs_note"]
    for b in blocks:
        assert b["num_prompts"] == 6 and b["completed"] == 6
        # labelled as the shared run, and its duration is this policy's own requests' span
        assert b["policy_runs"] == "interleaved" and b["duration_basis"] == "own requests' span in the shared run"
        assert b["duration"] == pytest.approx(own_span(b))
        assert sum(r["kind"] == "long" for r in b["requests"]) == 2  # 30% of 6, rounded
        check_block_against_records(b, {"ttft": 1000.0, "tpot": 100.0})
        # the server's own timeline came back, for the policy this block stands for
        assert b["timings_reported"] == 6
        assert {r["timings"]["policy"] for r in b["requests"]} == {b["policy"]}
        assert b["ttft_split_ms"]["prefill"] > 0
        # output lengths as planned (ignore_eos), from the server's usage
        assert [r["output_len"] for r in b["requests"]] == [r["expected_output_len"] for r in b["requests"]]
    by_policy = {p: [r for b in blocks[:2] if b["policy"] == p for r in b["requests"]]
                 for p in ("colocated", "disaggregated")}
    # request i went with policy i mod 2, and each prompt length once per policy
    assert all(r["index"] % 2 == 0 for r in by_policy["colocated"])
    assert all(r["index"] % 2 == 1 for r in by_policy["disaggregated"])
    assert [r["prompt_len"] for r in by_policy["colocated"]] == [r["prompt_len"] for r in by_policy["disaggregated"]]
    assert blocks[1]["mean_transfer_ms"] > 0 and blocks[0]["mean_transfer_ms"] is None
    # open loop: sent on schedule (rate inf: all at 0)
    for r in blocks[2]["requests"]:
        assert r["scheduled_s"] == 0.0 and r["start_s"] < 2.0
    # what went on the wire: 2 warm-up batches of 1 per policy + 24 measured, streamed, ignore_eos, the policy field
    assert len(bodies) == 28
    assert all(b["stream"] and b["ignore_eos"] and b["model"] == "fake-model" for b in bodies)
    assert sorted({b["policy"] for b in bodies}) == ["colocated", "disaggregated"]
    # the files
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "summary.md").read_text()
    for b in blocks:
        row = f"| {b['policy']} | point | {b['load_label']} | {b['completed']} | {b['failed']} | " \
              f"{b['duration']:.1f} | {b['request_throughput']:.2f} | {b['output_throughput']:.0f} | " \
              f"{b['median_ttft_ms']:.1f} | {b['p90_ttft_ms']:.1f} | {b['p99_ttft_ms']:.1f} |"
        assert row in md
    assert "Server phases" in md and "ttft <= 1000 ms" in md and "policy runs: **interleaved**" in md
    assert run["environment"]["machine"]["cpu_count"] and run["environment"]["versions"]["python"]
    assert run["model"] == "fake-model" and run["slos_ms"] == {"ttft": 1000.0, "tpot": 100.0}


@pytest.mark.alone  # its bound is a timing
def test_separate_runs_each_policy_on_its_own_duration(tmp_path):
    """The default: each policy alone, on the same lengths and the same (scaled) schedule, points
    alternating ABBA; the disaggregated requests carry a 200 ms transfer here, so its runs last longer
    and its throughput, from its own duration, is lower (a shared duration would make them equal)."""
    out = tmp_path / "separate"
    with FakeServer(FakeConfig(itl_ms=2.0, prefill_ms_per_token=0.25, transfer_ms_per_token=5.0)) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--policies", "colocated,disaggregated",
                        "--request-rates", "10,20", "--num-prompts", "12", "--input-len", "40", "--output-len", "4",
                        "--long-fraction", "0.25", "--long-input-len", "60", "--warmup-batch", "2",
                        "--warmup-max-batches", "3", "--goodput", "ttft:5000", "--out", str(out), "--no-progress"])
        bodies = list(srv.bodies)
    assert rc == 0
    run = json.loads((out / "results.json").read_text())
    assert run["policy_runs"] == "separate" and run["long_prompts_per_run"] == 3
    blocks = run["results"]
    # ABBA: the second point runs the policies in the other order
    assert [(b["load_label"], b["arm"]) for b in blocks] == [
        ("rate 10/s", "colocated"), ("rate 10/s", "disaggregated"),
        ("rate 20/s", "disaggregated"), ("rate 20/s", "colocated")]
    for b in blocks:
        check_block_against_records(b)
        assert b["policy_runs"] == "separate" and b["duration_basis"] == "own run" and b["phase"] == "point"
        assert b["policy_request_rate"] == b["request_rate"]  # the whole offered rate goes to this policy
        assert b["duration"] == pytest.approx(own_span(b), abs=0.05)  # first send at 0 -> its own last answer
        assert {r["timings"]["policy"] for r in b["requests"]} == {b["policy"]}
        assert sum(r["kind"] == "long" for r in b["requests"]) == 3  # 25% of 12, exactly
        assert b["saturation"]["saturated"] is not None  # judged (its own tests are in test_load_capacity.py)
    by = {(b["load_label"], b["arm"]): b for b in blocks}
    for rate in ("rate 10/s", "rate 20/s"):
        colo, dis = by[(rate, "colocated")], by[(rate, "disaggregated")]
        # the same lengths and the same schedule for both policies
        assert [r["prompt_len"] for r in colo["requests"]] == [r["prompt_len"] for r in dis["requests"]]
        assert [r["scheduled_s"] for r in colo["requests"]] == [r["scheduled_s"] for r in dis["requests"]]
        # each run's own duration: the transfer (200-300 ms here) shows in the disaggregated one only; the
        # same request's end-to-end time differs by about it (the median pair: a stall of this shared host's
        # cores can lengthen one run, which the durations alone would blame on the design)
        assert dis["duration"] - colo["duration"] > 0.12
        paired = sorted(d["e2e_s"] - c["e2e_s"] for c, d in zip(colo["requests"], dis["requests"]))
        assert 0.15 < paired[len(paired) // 2] < 0.45
        assert colo["request_throughput"] > dis["request_throughput"] * 1.05
    # one seeded schedule: at 20/s it is the 10/s one in half the time
    assert np.allclose([r["scheduled_s"] * 2 for r in by[("rate 20/s", "colocated")]["requests"]],
                       [r["scheduled_s"] for r in by[("rate 10/s", "colocated")]["requests"]])
    # fresh text per run: no two measured runs sent the same prompt
    measured = bodies[-48:]
    assert len({b["prompt"] for b in measured}) == 48
    assert [b["policy"] for b in measured] == ["colocated"] * 12 + ["disaggregated"] * 24 + ["colocated"] * 12
    for arm in run["arms"]:
        w = arm["warmup"]
        assert 2 <= w["batches"] <= 3 and w["batch_size"] == 2 and len(w["median_ttft_ms"]) == w["batches"]
    assert len(bodies) == 48 + sum(a["warmup"]["batches"] * 2 for a in run["arms"])
    md = (out / "summary.md").read_text()
    assert "policy runs: **separate**" in md and "3 of 12 prompts long (25%)" in md
    assert "warm-up: " in md and (out / GOODPUT_PNG).is_file()


def test_closed_loop_without_policies_or_timings(tmp_path):
    out = tmp_path / "closed"
    with FakeServer(FakeConfig(itl_ms=1.0, emit_timings=False)) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--model", "fake-model", "--concurrency", "1,3",
                        "--num-prompts", "6", "--input-len", "30", "--output-len", "4", "--warmup-batch", "0",
                        "--out", str(out), "--no-progress"])
        bodies = list(srv.bodies)
    assert rc == 0
    blocks = json.loads((out / "results.json").read_text())["results"]
    assert [(b["load_label"], b["policy"], b["max_concurrency"]) for b in blocks] == [
        ("concurrency 1", None, 1), ("concurrency 3", None, 3)]
    for b in blocks:
        check_block_against_records(b)
        assert b["timings_reported"] == 0 and b["ttft_split_ms"]["ttft"] is None and b["mean_queue_ms"] is None
    # concurrency 1: each request starts after the previous one ended
    reqs = blocks[0]["requests"]
    for a, c in zip(reqs, reqs[1:]):
        assert c["start_s"] >= a["start_s"] + a["e2e_s"] - 1e-6
    assert len(bodies) == 12 and all("policy" not in b for b in bodies)
    assert all((out / name).is_file() for name in PNGS)
    assert "Server phases" not in (out / "summary.md").read_text()


def test_failures_are_recorded_not_fatal(tmp_path):
    out = tmp_path / "fail"
    with FakeServer(FakeConfig(itl_ms=1.0)) as srv:
        # "sideways" is refused by the server for every request of that policy
        rc = generator.main(["--base-url", srv.base_url, "--policies", "colocated,sideways", "--num-prompts", "3",
                        "--input-len", "10", "--output-len", "3", "--warmup-batch", "0", "--out", str(out),
                        "--no-progress", "--no-plots"])
    assert rc == 1  # one policy completed nothing
    blocks = json.loads((out / "results.json").read_text())["results"]
    assert blocks[0]["completed"] == 3 and blocks[1]["completed"] == 0 and blocks[1]["failed"] == 3
    assert all("policy must be one of" in e for e in blocks[1]["errors"])
    assert blocks[1]["median_ttft_ms"] is None
    assert "First errors" in (out / "summary.md").read_text()
    plot_all(blocks, out)  # plots cope with a policy that has no data
    assert all((out / name).is_file() for name in PNGS)


def test_warmup_failure_and_unreachable_server_stop_the_run(tmp_path, capsys):
    with FakeServer(FakeConfig(itl_ms=1.0)) as srv:
        rc = generator.main(["--base-url", srv.base_url, "--policies", "bogus", "--num-prompts", "2", "--input-len", "5",
                        "--output-len", "2", "--out", str(tmp_path / "w"), "--no-progress"])
    assert rc == 1 and "warmup request (bogus" in capsys.readouterr().err
    rc = generator.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                    "--out", str(tmp_path / "u"), "--no-progress"])
    assert rc == 1 and "cannot reach the server" in capsys.readouterr().err
    assert generator.main(["--input-len", "uniform:9:1", "--out", str(tmp_path / "x")]) == 2
    assert "bad length spec" in capsys.readouterr().err


def test_an_arm_that_fails_does_not_cost_the_others(tmp_path, capsys):
    """Three arms with their own (fake) servers, the middle one's server refuses its flags: the other two are
    measured and written, the failed one is recorded with its error, and the run exits 1."""
    import sys
    out = tmp_path / "arms"
    server = f"{sys.executable} -m pdserve.bench.load.fake_server --port 0 --itl-ms 1"
    rc = generator.main(["--arm", "a=colocated:", "--arm", "broken=colocated:--no-such-flag", "--arm", "c=colocated:",
                    "--server-command", server, "--num-prompts", "3", "--input-len", "10", "--output-len", "2",
                    "--warmup-batch", "1", "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 1
    assert "arm broken failed, the other arms go on" in capsys.readouterr().err
    run = json.loads((out / "results.json").read_text())
    assert [b["arm"] for b in run["results"]] == ["a", "c"] and all(b["completed"] == 3 for b in run["results"])
    broken = run["arms"][1]
    assert broken["label"] == "broken" and "exited with code 2 before it was ready" in broken["error"]
    assert "**broken**" in (summary := (out / "summary.md").read_text()) and "failed, not measured" in summary
