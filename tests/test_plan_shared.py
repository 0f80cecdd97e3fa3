"""The planner's shared GPU (1P:1D on one GPU, bench/load/plan_sim.py) against the recorded H200 runs of a prefill
and a decode worker sharing it (bench/results/load-h200-2026-12-01/, read by bench/load/plan_shared.py): the
slowdowns each side measured are the Split's defaults, the runs replay within their measured outcome, and the
colocated predictions do not move."""

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.load import plan_shared
from pdserve.bench.load.plan_shared import compare, replay, sharing
from pdserve.bench.load.plan_sim import Profile, Split, simulate
from pdserve.bench.load.report import read_results

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench/results/load-h200-2026-12-01/results.json"  # committed gzipped: read as results.json.gz
ENGINE_JSON = ROOT / "bench/results/engine-nvidia-h200-2026-12-01-4acfb30.json"


@pytest.fixture(scope="module")
def recorded():
    return read_results(RUNS), Profile.from_engine_json(json.loads(ENGINE_JSON.read_text()))


def _pd_runs(results: dict) -> list[dict]:
    return [b for b in results["results"] if b["arm"] == "disaggregated"]


def test_the_split_defaults_are_the_slowdowns_the_recorded_runs_measured(recorded):
    results, prof = recorded
    fit = sharing(_pd_runs(results), prof)
    # the first run (2 req/s, after the warm-up) prefilled alone at ~3x the profile: cold, left out by name
    assert [x["rate"] for x in fit["left_out"]] == [2.0]
    # the profile holds for each side alone: the comparison is against the right times
    assert 0.9 <= fit["decode_alone"] <= 1.1 and 0.9 <= fit["prefill_alone"] <= 1.1
    assert fit["decode_steps"] > 1000 and fit["prefill_forwards"] > 50 and fit["prefill_fit_error"] < 0.06
    split = Split(1, 1, shared=True)
    assert fit["decode_slowdown"] == pytest.approx(split.shared_decode_slowdown, abs=0.02)
    assert fit["prefill_slowdown"] == pytest.approx(split.shared_prefill_slowdown, abs=0.02)
    assert fit["prefill_extra_ms"] == pytest.approx(split.shared_prefill_extra_ms, abs=0.3)


def test_the_recorded_1p1d_runs_replay_within_their_measured_outcome(recorded):
    """Each warm run (4, 8, 16, 8 req/s; 20 requests, 25% of them 8k-16k tokens) replayed at its own send times
    with one prompt a forward, as the prefill worker ran then: TTFT mean within 10% and p99, TPOT p50 and p99
    within 25%, the same share within the SLOs. An even half (a forward at 2x) put TTFT 19-25% high on the mean,
    p99 +32% at 4 req/s. The TTFT p50 is not held: with 20 requests it falls between the requests queued behind
    a long prompt (~0.5 s) and the rest (~0.05 s), and one order swap moves it across (the router tokenizes a
    long prompt for 20-40 ms, which the simulation does not)."""
    results, prof = recorded
    split = Split(1, 1, shared=True, max_batched_tokens=1)
    warm = [b for b in _pd_runs(results) if b["request_rate"] >= 4]
    assert len(warm) == 4
    for block in warm:
        c = compare(block, split, prof, results["slos_ms"])
        err = c["error"]
        assert abs(err["ttft_mean"]) <= 0.10, c
        for key in ("ttft_p99", "tpot_p50", "tpot_p99"):
            assert abs(err[key]) <= 0.25, (key, c)
        assert c["simulated"]["within_slos"] == c["measured"]["within_slos"], c


def test_colocated_predictions_do_not_depend_on_the_shared_gpu(recorded):
    """The shared fields touch only a 1P:1D split on one GPU: the recorded colocated runs replay alike with any
    of them, and so does a 1P:1D split on two GPUs."""
    results, prof = recorded
    odd = dict(shared_decode_slowdown=7.0, shared_prefill_slowdown=3.0, shared_prefill_extra_ms=50.0)
    blocks = [b for b in results["results"] if b["arm"] == "colocated"] + _pd_runs(results)[:1]
    for block in blocks:
        for base in (Split(0, 1, chunk=512), Split(0, 1, chunk=0), Split(1, 1)):
            a = simulate(base, prof, replay(block))
            b = simulate(Split(base.prefill, base.decode, chunk=base.chunk, **odd), prof, replay(block))
            assert [(r.first_token, r.finish) for r in a] == [(r.first_token, r.finish) for r in b]


def _record(index: int, start: float, prompt: int, before_ms: float, prefill_ms: float, tokens: list[float]) -> dict:
    """A load-bench request record: sent at `start`, its forward after `before_ms` of server phases, its tokens at
    the given client times (the first one its first token)."""
    phases = {"parse": before_ms, "route": 0.0, "inbox": 0.0, "prefill_queue": 0.0}
    return {"index": index, "scheduled_s": start, "start_s": start, "prompt_len": prompt, "output_len": len(tokens),
            "ttft_s": tokens[0] - start, "itls_s": list(np.diff(tokens)), "e2e_s": tokens[-1] - start,
            "success": True, "timings": {"prefill_ms": prefill_ms, "ttft_phases_ms": phases,
                                         "prefill_worker": "prefill-0"}}


def _block(alone_ms: float) -> dict:
    """One request (its own forward alone, at the profile's 10 ms) decoding 0.1-1.0 s, a step 5 ms alone and 10
    ms inside a forward; beside it a batched forward of 1024 + 2048 tokens (60 ms of tokens alone) 0.2-0.3 s and
    one of 4096 (80 ms) 0.5-0.63 s: 10 ms + 1.5x their tokens; after it, a 1024-token forward alone (20 ms on
    the profile) taking alone_ms. request_rate stands for alone_ms, to name the run."""
    times, ms = [], 100  # whole milliseconds, no drift
    while ms < 1000:
        times.append(ms / 1e3)
        ms += 10 if 200 <= ms < 300 or 500 <= ms < 630 else 5
    rows = [_record(0, 0.0, 512, 90.0, 10.0, times),
            _record(1, 0.19, 1024, 10.0, 100.0, [0.305]), _record(2, 0.195, 2048, 5.0, 100.0, [0.305]),
            _record(3, 0.49, 4096, 10.0, 130.0, [0.635]),
            _record(4, 1.19, 1024, 10.0, alone_ms, [1.2 + alone_ms / 1e3 + 0.001])]
    return {"request_rate": alone_ms, "requests": rows}


def test_sharing_reads_batched_forwards_and_leaves_cold_runs_out():
    prof = Profile.from_points({1024: 20.0, 4096: 80.0}, [(b, c, 5.0) for b in (1, 8) for c in (128, 1024)])
    fit = sharing([_block(20.0), _block(60.0)], prof)
    assert fit["decode_slowdown"] == pytest.approx(2.0) and fit["decode_alone"] == pytest.approx(1.0)
    # the two requests that end one forward together are one forward of their tokens: exactly 10 + 1.5 x
    assert fit["prefill_forwards"] == 2
    assert fit["prefill_slowdown"] == pytest.approx(1.5) and fit["prefill_extra_ms"] == pytest.approx(10.0)
    assert fit["prefill_alone"] == pytest.approx(1.0)
    assert fit["left_out"] == [{"rate": 60.0, "why": "its forwards alone took 2.00x the profile's (cold or "
                                                      "host-bound)"}]
    with pytest.raises(ValueError, match="too few"):
        sharing([_block(60.0)], prof)


def test_a_batch_is_one_forward_and_a_request_is_busy_from_its_forwards_end():
    """The requests of one batched forward share its prefill_ms (the batch's start and end stamps) while their
    reconstructed ends spread with each one's HTTP latency; a request keeps the GPU busy from its forward's end
    (transfer, adoption, decode steps) before its first token reaches the client."""
    from pdserve.bench.load.plan_shared import _block_sharing, _forwards

    # one batch: ends 10 ms apart on the client's clock, the same 40 ms forward; then a forward of its own 1 ms
    # after it, 25 ms long
    batch = [_record(0, 0.0, 512, 10.0, 40.0, [0.3]), _record(1, 0.01, 512, 10.0, 40.0, [0.3]),
             _record(2, 0.02, 256, 30.0, 25.0, [0.3])]
    assert [len(f[2]) for f in _forwards(batch)] == [2, 1]
    prof = Profile.from_points({1024: 20.0, 4096: 80.0}, [(b, c, 5.0) for b in (1, 8) for c in (128, 1024)])
    # X's forward ends at 1.0 s, its first token reaches the client at 1.2; Y's forward runs 1.05-1.10: beside
    # X's transfer and first steps, not alone. Z's forward, after X ended, is alone.
    rows = [_record(0, 0.9, 1024, 80.0, 20.0, [1.2, 1.25]), _record(1, 1.0, 1024, 50.0, 50.0, [1.3]),
            _record(2, 2.0, 1024, 10.0, 20.0, [2.1])]
    part = _block_sharing({"request_rate": 1.0, "requests": rows}, prof)
    # X's forward and Z's are alone, at the profile's pace; Y's (2.5x) is not counted alone
    assert part["alone"] == [pytest.approx(1.0), pytest.approx(1.0)]


def test_the_reader_runs_on_a_results_json(recorded, tmp_path, capsys):
    out = tmp_path / "sharing.json"
    argv = [str(RUNS), "--profile", str(ENGINE_JSON), "--max-batched-tokens", "1"]
    assert plan_shared.main(argv + ["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["rate"] for r in data["runs"]] == [4.0, 8.0, 16.0, 8.0]
    worst = {name: max(abs(r[name]["error"]["ttft_mean"]) for r in data["runs"]) for name in ("even_half", "defaults")}
    assert worst["defaults"] < 0.10 < worst["even_half"], worst
    assert "1.99x the profile" in capsys.readouterr().out
    assert plan_shared.main(argv + ["--arm", "nope"]) == 2
    assert "no runs of arm 'nope'" in capsys.readouterr().err


def test_the_plan_takes_the_shared_slowdowns_of_another_gpu(tmp_path, capsys):
    import argparse

    from pdserve.bench import cli
    from pdserve.bench.load import planner

    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    args = p.parse_args(["--gpus", "1", "--shared-slowdowns", "2,2,0"])
    args.chunk = 8192
    [shared] = [s for s in planner.splits_for(1, args) if s.shared]
    assert (shared.shared_decode_slowdown, shared.shared_prefill_slowdown, shared.shared_prefill_extra_ms) == (2, 2, 0)
    args = p.parse_args(["--gpus", "1"])
    args.chunk = 8192
    assert [s for s in planner.splits_for(1, args) if s.shared] == [Split(1, 1, shared=True)]
    out = tmp_path / "plan.json"
    base = ["plan", "--profile", str(ENGINE_JSON), "--gpus", "1", "--input-len", "uniform:256:1024",
            "--output-len", "16", "--goodput", "ttft:2000", "tpot:100", "--probe-seconds", "5"]
    assert cli.main(base + ["--shared-slowdowns", "2.5,1.5,4", "--out", str(out)]) == 0
    [arm] = [a for a in json.loads(out.read_text())["arms"] if a["split"] == "1P:1D sharing 1 GPU"]
    assert arm["shared_slowdowns"] == [2.5, 1.5, 4.0]
    capsys.readouterr()
    for bad, says in (("2,2", "DECODE,PREFILL,EXTRA_MS"), ("0.5,2,0", "factor >= 1")):
        assert cli.main(base + ["--shared-slowdowns", bad]) == 2
        assert says in capsys.readouterr().err


def test_a_colocated_arm_replays_and_a_stopped_probe_is_named_not_replayed(tmp_path):
    """`--colocated CHUNK` replays a colocated arm's runs through that split (bench/results/defaults-gpu-b051920,
    the H200 default arm: its first probe stopped early and is left out by its rate); the measured side is the
    run's own outcome."""
    results = ROOT / "bench/results/defaults-gpu-b051920/mixed/default/results.json.gz"
    engine = ROOT / "bench/results/engine-nvidia-h200-2026-12-06-b051920.json"
    out = tmp_path / "replay.json"
    assert plan_shared.main([str(results), "--profile", str(engine), "--arm", "default", "--colocated", "8192",
                             "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["split"] == "colocated x1 chunk 8192" and got["left_out_rates"] == [10.0]
    assert [r["rate"] for r in got["runs"]] == [5.0, 7.5, 8.75, 9.375]
    data = read_results(results)
    block = next(b for b in data["results"] if b["request_rate"] == 5.0)
    ttft = sorted(r["ttft_s"] * 1e3 for r in block["requests"])
    assert got["runs"][0]["measured"]["ttft_p50"] == pytest.approx(float(np.percentile(ttft, 50)))
    assert all(r["simulated"]["ttft_p50"] > 0 for r in got["runs"])
    # the workers' part of TTFT: the server's less the router's phases and the flights
    row = block["requests"][0]
    phases = row["timings"]["ttft_phases_ms"]
    assert plan_shared.worker_ttft_ms(row) == pytest.approx(row["timings"]["ttft_ms"] - phases["parse"] - phases["route"]
                                                            - phases["hops"] - phases["first_token_send"])
    workers = [plan_shared.worker_ttft_ms(r) for r in block["requests"]]
    assert got["runs"][0]["measured"]["worker_ttft_p50"] == pytest.approx(float(np.percentile(workers, 50)))
    assert got["runs"][0]["measured"]["worker_ttft_p50"] < got["runs"][0]["measured"]["ttft_p50"]
    w = got["runs"][0]["workers"]  # by kind of prompt: the 5 req/s run's short prompts, and their prefill phase
    short = [r for r in block["requests"] if r["kind"] == "short"]
    assert w["by_kind"]["short"]["requests"] == len(short) == 225
    assert w["by_kind"]["short"]["prefill_phase_p50"] == pytest.approx(
        float(np.median([r["timings"]["prefill_ms"] for r in short])))
    assert list(w["quantiles"]) == ["25", "50", "75", "90", "99"]  # JSON keys
    assert w["quantiles"]["50"][0] == pytest.approx(got["runs"][0]["measured"]["worker_ttft_p50"])
    assert plan_shared.worker_ttft_ms({"timings": None}) is None
    assert plan_shared.main([str(results), "--profile", str(engine), "--arm", "nobody", "--colocated", "0"]) == 2
