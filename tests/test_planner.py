"""The P:D planner (bench/load/planner.py, bench/load/plan_sim.py): the simulation's arithmetic on cases worked by hand,
the profile fit against a measured engine JSON, and the recommendation on synthetic profiles where
colocated must win (prefill-bound, loose TPOT) and where xP:yD must (a tight TPOT that colocated prefill
chunks break)."""

import json
import re
import types
from pathlib import Path

import pytest

from pdserve.bench import cli
from pdserve.bench.load.metrics import parse_slos
from pdserve.bench.load.plan_sim import Profile, Req, Split, simulate
from pdserve.bench.load.planner import Workload, compare, plan, predict

ENGINE_JSON = Path(__file__).resolve().parents[1] / "bench/results/engine-nvidia-h200-2026-12-01-4acfb30.json"


def _profile(prefill_ms_at_1024: float, alpha: float, beta: float, gamma: float = 0.0, kv: int = 0) -> Profile:
    """Prefill linear in tokens; decode step alpha + beta x batch + gamma x context tokens, exactly."""
    decode = [(b, c, alpha + beta * b + gamma * b * c) for b in (1, 8, 32) for c in (128, 1024)]
    return Profile.from_points({1024: prefill_ms_at_1024, 4096: 4 * prefill_ms_at_1024}, decode, kv)


def _args(**kw):
    base = dict(input_len="1024", output_len="16", long_fraction=0.0, long_input_len="4096", trace=None, seed=0,
                gpus=2, chunk=512, max_batch=256, link_gbps=100.0, transfer_fixed_ms=0.5, goodput=["ttft:1000"],
                max_batched_tokens=8192,
                goodput_target=0.9, probe_seconds=20.0, probe_min_requests=100, search_precision=0.05,
                search_max_probes=14)
    return types.SimpleNamespace(**{**base, **kw})


def test_the_simulation_adds_up_by_hand():
    prof = _profile(20.0, alpha=5.0, beta=1.0)  # 1024-token prompt: 20 ms; a decode step of b rows: 5 + b ms
    assert prof.prefill(0, 1024) == pytest.approx(20.0) and prof.prefill(1024, 2048) == pytest.approx(20.0)
    assert prof.decode(4, 999) == pytest.approx(9.0)
    # one colocated worker, unchunked, one request of 1024 tokens and 5 out: first token after the prefill,
    # then 4 decode steps of one row (6 ms each)
    [r] = simulate(Split(0, 1, chunk=0), prof, [Req(0, 0.0, 1024, 5)])
    assert r.first_token == pytest.approx(0.020) and r.finish == pytest.approx(0.020 + 4 * 0.006)
    # chunked by 256: four steps of 5 ms, the same first token
    [r] = simulate(Split(0, 1, chunk=256), prof, [Req(0, 0.0, 1024, 5)])
    assert r.first_token == pytest.approx(0.020)
    # two requests at once on one unchunked worker: the second waits for the first's prefill step and shares
    # the next step with its decode row (6 + 20 ms), then both decode together (5 + 2 ms a step)
    a, b = simulate(Split(0, 1, chunk=0), prof, [Req(0, 0.0, 1024, 3), Req(1, 0.0, 1024, 3)])
    assert a.first_token == pytest.approx(0.020) and b.first_token == pytest.approx(0.020 + 0.026)
    assert a.finish == pytest.approx(0.046 + 0.007) and b.finish == pytest.approx(0.053 + 0.006)
    # the longest gap between two tokens: a's second token (26 ms) waits out b's prompt step (20 ms) and the
    # step after it (7 ms) for its third; b's gaps are decode steps only
    assert a.max_gap_s == pytest.approx(0.027) and b.max_gap_s == pytest.approx(0.007)
    # 1P:1D: prefill 20 ms, KV move 1024 x 1000 B at 1 GB/s = 1.024 ms + 0.5 fixed, then 4 steps of 6 ms
    kv = _profile(20.0, alpha=5.0, beta=1.0, kv=1000)
    [r] = simulate(Split(1, 1, link_gbps=1.0, transfer_fixed_ms=0.5), kv, [Req(0, 0.0, 1024, 5)])
    assert r.first_token == pytest.approx(0.020 + 0.001524) and r.finish == pytest.approx(r.first_token + 0.024)
    assert r.max_gap_s == pytest.approx(0.006)  # decode steps alone


def test_two_workers_sharing_one_gpu_run_at_their_own_paces():
    """1P:1D on one GPU, the KV move free: while both run a step each advances at its side's pace, and a
    forward that overlaps decoding pays the extra once."""
    prof = _profile(20.0, alpha=5.0, beta=1.0)
    even = dict(shared_decode_slowdown=2.0, shared_prefill_slowdown=2.0, shared_prefill_extra_ms=0.0)
    split = Split(1, 1, shared=True, transfer_fixed_ms=0.0, **even)
    assert split.gpus == 1 and split.label == "1P:1D sharing 1 GPU"
    a, b = simulate(split, prof, [Req(0, 0.0, 1024, 3), Req(1, 0.0, 1024, 3)])
    # an even half: P: a's prefill alone 0-20 ms. Then D's step for a (6 ms of work) beside b's prefill (20):
    # both at half speed, D's step ends at 32 ms and its next at 44 (a's third token: done); b's prefill has
    # 20 - 12 = 8 ms left at 44, alone: 52 ms; then D's two steps for b alone: 64 ms
    assert a.first_token == pytest.approx(0.020) and a.finish == pytest.approx(0.044)
    assert b.first_token == pytest.approx(0.052) and b.finish == pytest.approx(0.064)
    # decode at 1/3, prefill at 1/1.5 and 3 ms more: at 20 ms b's prefill (20 ms of work) meets D's step, its
    # extra 3 ms at the shared pace is 2 ms of work (22 left); D's 6 ms at 1/3 end at 38, P then has 22 - 12 =
    # 10 left, done at 53 (b's first token); D's second step, 5 of its 6 ms done by then at 1/3, ends alone at
    # 54 (a done); then b's two steps alone: 66 ms
    paced = Split(1, 1, shared=True, transfer_fixed_ms=0.0, shared_decode_slowdown=3.0,
                  shared_prefill_slowdown=1.5, shared_prefill_extra_ms=3.0)
    a, b = simulate(paced, prof, [Req(0, 0.0, 1024, 3), Req(1, 0.0, 1024, 3)])
    assert a.first_token == pytest.approx(0.020) and a.finish == pytest.approx(0.054)
    assert b.first_token == pytest.approx(0.053) and b.finish == pytest.approx(0.066)
    with pytest.raises(ValueError):
        Split(2, 1, shared=True)
    with pytest.raises(ValueError, match="factor >= 1"):
        Split(1, 1, shared=True, shared_prefill_slowdown=0.5)


def test_the_profile_fits_a_measured_engine_json():
    data = json.loads(ENGINE_JSON.read_text())
    prof = Profile.from_engine_json(data, source=ENGINE_JSON.name)
    assert prof.kv_bytes_per_token == data["config"]["kv_bytes_per_token"]
    for p in data["prefill"]:  # measured points are reproduced exactly
        assert prof.prefill(0, p["tokens"]) == pytest.approx(p["ours_ms"]["median"])
    for d in data["decode"]:  # the three-term fit holds every measured step within 15%
        if d.get("kind", "uniform") == "uniform":
            measured = d["ours_ms"]["median"]
            assert prof.decode(d["batch"], d["batch"] * d["context"]) == pytest.approx(measured, rel=0.15)
    # a noisy profile where a longer prompt measured cheaper: no segment costs less than nothing
    noisy = Profile.from_points({256: 10.0, 512: 9.0, 1024: 30.0}, [(1, 128, 5.0), (8, 128, 6.0), (1, 512, 5.5)])
    assert noisy.prefill(256, 512) == 0.0 and noisy.prefill(512, 1024) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="engine profile"):
        Profile.from_engine_json({"prefill": []})


def test_prefill_bound_work_with_loose_slos_stays_colocated():
    """4096-token prompts (100 ms of prefill), 4 tokens out, TPOT loose: prefill is the work. Two colocated
    workers both prefill (~20 req/s); 1P:1D has one prefill worker (~10 req/s)."""
    prof = _profile(25.0, alpha=5.0, beta=0.01)
    args = _args(input_len="4096", output_len="4", goodput=["ttft:2000", "tpot:200"])
    result = plan(prof, Workload(args), args)
    arms = {a["split"]: a for a in result["arms"]}
    assert set(arms) == {"colocated x2 chunk 512", "colocated x2 unchunked", "1P:1D"}
    colo, pd = arms["colocated x2 chunk 512"], arms["1P:1D"]
    assert colo["converged"] and pd["converged"]
    assert 16 <= colo["predicted_capacity_rate"] <= 21 and 8 <= pd["predicted_capacity_rate"] <= 10.6
    assert result["recommended"].startswith("colocated")


def test_a_tight_tpot_that_prefill_chunks_break_picks_disaggregation():
    """Decode steps of ~10 ms, a 13 ms TPOT: any prefill chunk in a colocated step (12.5 ms for 512 tokens)
    doubles that step, so colocated workers hold the SLO only at a few req/s; a prefill worker (50 ms a
    prompt, 20 req/s) feeding a decode-only one does not touch its steps."""
    prof = _profile(25.0, alpha=10.0, beta=0.02)
    args = _args(input_len="2048", output_len="64", goodput=["ttft:1000", "tpot:13"])
    result = plan(prof, Workload(args), args)
    arms = {a["split"]: a for a in result["arms"]}
    colo = max(arms["colocated x2 chunk 512"]["predicted_capacity_rate"] or 0,
               arms["colocated x2 unchunked"]["predicted_capacity_rate"] or 0)
    pd = arms["1P:1D"]["predicted_capacity_rate"]
    assert result["recommended"] == "1P:1D" and pd >= 2 * colo and 14 <= pd <= 20.5
    # with 4 GPUs prefill is the 1P:3D split's bottleneck (20 req/s); 2P:2D or 3P:1D does better
    four = plan(prof, Workload(args), _args(**{**vars(args), "gpus": 4}))
    assert four["recommended"] in ("2P:2D", "3P:1D")
    by = {a["split"]: a["predicted_capacity_rate"] for a in four["arms"]}
    assert by["1P:3D"] <= 20.5 < by[four["recommended"]]


def test_an_itl_slo_judges_each_requests_longest_gap():
    """The work above under an ITL instead of a TPOT. A colocated step that carries a 512-token chunk (12.5 ms)
    beside decodes (10 ms) is a 22.5-ms gap for every row in it; the decode worker's longest gap is a step it
    waits out before it adopts a request plus its own (about 20 ms). Under 22 ms only the decode worker holds
    (colocated workers only while prompts rarely meet decodes); under 30 the chunked colocated workers hold
    too, with the prefill capacity of both GPUs."""
    prof = _profile(25.0, alpha=10.0, beta=0.02)
    args = _args(input_len="2048", output_len="64", goodput=["ttft:1000", "itl:22"])
    result = plan(prof, Workload(args), args)
    assert not result["alone"]["misses"] and result["alone"]["ms"]["itl"] == pytest.approx(10.02, abs=0.05)
    arms = {a["split"]: a["predicted_capacity_rate"] or 0 for a in result["arms"]}
    assert result["recommended"] == "1P:1D" and 14 <= arms["1P:1D"] <= 20.5
    assert max(arms["colocated x2 chunk 512"], arms["colocated x2 unchunked"]) <= arms["1P:1D"] / 4
    looser = plan(prof, Workload(args), _args(**{**vars(args), "goodput": ["ttft:1000", "itl:30"]}))
    arms = {a["split"]: a["predicted_capacity_rate"] or 0 for a in looser["arms"]}
    assert looser["recommended"] == "colocated x2 chunk 512" and arms["colocated x2 chunk 512"] > arms["1P:1D"]
    assert arms["colocated x2 unchunked"] <= arms["1P:1D"] / 4  # a 2048-token prompt step is a 50-ms gap
    # a gap limit no decode step alone meets is named, not searched
    tight = plan(prof, Workload(args), _args(**{**vars(args), "goodput": ["itl:5"]}))
    assert tight["alone"]["misses"] == {"itl": pytest.approx(10.02, abs=0.05)}


def test_a_probe_is_judged_on_its_queue():
    """Past capacity with SLOs a short window still meets, the queue's growth fails the probe."""
    prof = _profile(25.0, alpha=5.0, beta=0.01)
    args = _args(input_len="1024", output_len="2")
    slos = parse_slos(["ttft:100000"])  # no SLO binds: only the queue can fail a probe
    # one prompt a forward: each request's 25 ms prefill step, then its 5.01 ms decode step
    cap, probes = predict(Split(0, 1, chunk=0, max_batched_tokens=1), prof, Workload(args), slos, probe_seconds=20,
                          min_requests=50, precision=0.05, max_probes=14)
    assert 1000 / 30.1 / 1.1 <= cap.rate <= 1000 / 30.1 * 1.06
    failed = [b for b in probes if not b["probe_passed"]]
    assert failed and all(b["goodput_fraction"] >= 0.9 and b["saturation"]["queue_growing"] for b in failed)


def test_a_profile_that_prices_steps_at_nothing_stops_the_search_at_its_ceiling():
    """A CI run's measured tiny profile (a loaded 2-core CPU: 256 prompt tokens no dearer than 64, decode cost
    falling with context) fitted prompt tokens at 0 ms and long-context decode steps at 0 ms, so every probe
    passed and the doubling search simulated millions of requests (600 s, killed). The search stops once a
    probe would send more than MAX_PROBE_REQUESTS, the capacity a lower bound."""
    from pdserve.bench.load.planner import MAX_PROBE_REQUESTS

    prof = Profile.from_points({64: 7.12, 256: 6.70}, [(1, 128, 31.59), (4, 128, 12.02), (1, 256, 6.36),
                                                      (4, 256, 9.55)], fixed_ms=None)
    assert prof.tokens(0, 256) == 0.0 and prof.decode(8, 8 * 1000) == 0.0  # the degenerate fit, as it came
    args = _args(input_len="uniform:64:256", output_len="8")
    probe_seconds = 5.0
    cap, probes = predict(Split(0, 2, chunk=512), prof, Workload(args), parse_slos(["ttft:5000", "tpot:2000"]),
                          probe_seconds=probe_seconds)
    assert cap.first_fail is None and cap.out_of_time and all(b["probe_passed"] for b in probes)
    assert max(b["num_prompts"] for b in probes) <= MAX_PROBE_REQUESTS
    assert cap.rate * 2 * probe_seconds > MAX_PROBE_REQUESTS  # stopped because the next probe would pass it


def test_the_command_writes_its_plan(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024 + 512 * (i % 3),
                                         "output_length": 16, "hash_ids": []}) + "\n" for i in range(30)))
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--profile", str(ENGINE_JSON), "--gpus", "2", "--trace", str(trace), "--goodput",
                   "ttft:1000", "tpot:25", "--probe-seconds", "10", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["recommended"] in {a["split"] for a in result["arms"]} and "Mooncake" in result["workload"]
    assert all(p["requests"] >= 200 for a in result["arms"] for p in a["probes"])
    assert "recommended:" in capsys.readouterr().out
    assert cli.main(["plan", "--goodput", "ttft:10"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_a_prediction_beside_a_measured_capacity(tmp_path):
    run = tmp_path / "results.json"
    run.write_text(json.dumps({"command": "pdserve-bench load ...", "workload": "w", "arms": [
        {"label": "colo", "capacity": {"capacity_rate": 8.0, "bracket": [8.0, 9.0], "probe_seconds": 60.0}},
        {"label": "broken", "error": "did not start"}]}))
    arms = [{"split": "colocated x1 chunk 512", "predicted_capacity_rate": 10.0}]
    [v] = compare(arms, [f"colocated x1 chunk 512={run}:colo"], {"ttft": 2000.0}, 0.9)
    assert v["error"] == pytest.approx(0.25) and v["measured_bracket"] == [8.0, 9.0]
    for bad in (f"1P:1D={run}:colo", f"colocated x1 chunk 512={run}:broken", "colocated x1 chunk 512"):
        with pytest.raises(ValueError):
            compare(arms, [bad], {"ttft": 2000.0}, 0.9)


def test_a_prediction_beside_fixed_rate_runs(tmp_path):
    """An arm that ran fixed rates (an atlas piece) is judged on its grid under the plan's SLOs: its capacity is
    the highest rate below which every rate passed, and the prediction's error is read against that bracket."""
    def request(ttft_s: float) -> dict:  # 11 tokens 10 ms apart after the first: TPOT 10 ms
        return {"success": True, "ttft_s": ttft_s, "tpot_s": 0.01, "itls_s": [0.01] * 10, "e2e_s": ttft_s + 0.1}

    def point(rate: float, slow: int, growing: bool = False) -> dict:  # `slow` of 10 requests take 3 s to start
        return {"arm": "pd", "phase": "point", "request_rate": rate, "saturation": {"queue_growing": growing},
                "requests": [request(3.0 if i < slow else 0.2) for i in range(10)]}

    run = tmp_path / "results.json"
    run.write_text(json.dumps({"command": "pdserve-bench atlas ...", "workload": "w", "args": {"run_seconds": 45},
                               "arms": [{"label": "pd"}],
                               "results": [point(5, 0), point(10, 1), point(15, 0, growing=True)]}))
    arms = [{"split": "1P:1D sharing 1 GPU", "predicted_capacity_rate": 12.0, "seed_range": [9.0, 14.0]}]
    [v] = compare(arms, [f"1P:1D sharing 1 GPU={run}:pd"], {"ttft": 2000.0, "tpot": 100.0}, 0.9)
    assert v["measured_bracket"] == [10, 15] and v["bracket_error"] == 0.0  # 12 lies in [10, 15)
    assert v["error"] == pytest.approx(0.2) and v["measured_probe_seconds"] == 45
    # a 95% target: 10 req/s (one request of ten over the TTFT) fails, 5 passes
    [v] = compare(arms, [f"1P:1D sharing 1 GPU={run}:pd"], {"ttft": 1000.0, "tpot": 100.0}, 0.95)
    assert v["measured_bracket"] == [5, 10] and v["bracket_error"] == pytest.approx(12.0 / 10 - 1)
    # every rate failing: no capacity, the bracket below the lowest rate
    [v] = compare(arms, [f"1P:1D sharing 1 GPU={run}:pd"], {"ttft": 100.0, "tpot": 100.0}, 0.9)
    assert v["measured_capacity_rate"] is None and v["measured_bracket"] == [None, 5]
    assert v["error"] is None and v["bracket_error"] == pytest.approx(12.0 / 5 - 1)
    with pytest.raises(ValueError):
        compare(arms, [f"1P:1D sharing 1 GPU={run}:other"], {"ttft": 2000.0}, 0.9)


def test_the_planner_measures_a_profile_itself(tmp_path, capsys):
    """--measure runs `pdserve-bench engine` on the tiny model first (a smaller grid than its CPU default) and plans
    from it; SLOs loose enough for a loaded 2-core CPU (torch's threads oversubscribed there make a tiny decode
    step take up to ~0.5 s)."""
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--measure", "tiny", "--device", "cpu", "--measure-args",
                   "--lengths 64,256 --pairs 1 --batches 1,4 --contexts 128,256 --repeats 2", "--gpus", "2",
                   "--input-len", "uniform:64:256",
                   "--output-len", "8", "--goodput", "ttft:5000", "tpot:2000", "--probe-seconds", "5",
                   "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    assert result["profile"]["source"] == "measured: tiny on cpu"
    assert sorted(result["profile"]["prefill_points"]) == ["256", "64"]
    assert result["recommended"] in {a["split"] for a in result["arms"]}


def test_measuring_a_profile_fits_the_device_or_is_refused_up_front(capsys):
    """plan --measure's own grid on a CPU is the profile's and small (the engine bench's defaults, 32k prompts and
    64 x 16k contexts, need ~100 GiB of host memory for smollm2-135m); a model whose grid needs more than
    --measure-memory-gb is refused before anything loads, saying what it needs and what to give instead."""
    from pdserve.bench.load.plan_measure import GRIDS, engine_argv, needs

    argv = engine_argv("tiny", "cpu", "--pairs 1")
    assert argv[:5] == ["engine", "--model", "tiny", "--device", "cpu"] and argv[5:-2] == GRIDS["cpu"]
    assert argv[-2:] == ["--pairs", "1"]  # --measure-args come last and win
    assert "--chunk-decodes" in GRIDS["cpu"] and "--hf-decode-context" in GRIDS["cpu"]  # only what the plan reads
    assert needs(argv)["total"] < 2 and needs(engine_argv("qwen2.5-7b", "cpu"))["weights"] > 14  # bf16 7.6B
    engine_defaults = needs(["engine", "--model", "qwen2.5-7b", "--device", "cpu"])
    assert engine_defaults["kv_pool"] > 8 * needs(engine_argv("qwen2.5-7b", "cpu"))["kv_pool"]
    rc = cli.main(["plan", "--measure", "qwen2.5-7b", "--device", "cpu", "--goodput", "ttft:1000"])
    err = capsys.readouterr().err
    need = re.search(r"measuring qwen2.5-7b's profile on cpu with this grid needs about ([\d.]+) GiB \(weights 14", err)
    assert rc == 2 and need and float(need.group(1)) > 8, err
    assert "over --measure-memory-gb 8" in err and "measuring the profile:" not in err  # refused before it ran


def test_slos_a_request_alone_misses_are_named_not_searched_into_a_bracket_of_nothing():
    """A decode step of 500 ms (a slow CPU's) cannot meet TPOT 100 ms at any rate: the plan says which SLO a
    request alone already misses and by how much, where it said only '< lowest probe'."""
    slow = _profile(20.0, alpha=500.0, beta=1.0)
    result = plan(slow, Workload(_args()), _args(goodput=["ttft:1000", "tpot:100"], search_max_probes=4))
    assert result["recommended"] is None
    assert result["alone"]["misses"] == {"tpot": pytest.approx(501.0)}
    assert result["alone"]["ms"]["ttft"] == pytest.approx(20.0)
    assert all(a["probes"] == [] and a["predicted_capacity_rate"] is None for a in result["arms"])  # not searched
    fast = plan(_profile(20.0, alpha=5.0, beta=1.0), Workload(_args()), _args(goodput=["ttft:1000", "tpot:100"]))
    assert fast["alone"]["misses"] == {} and fast["recommended"] is not None


def test_a_prediction_is_the_median_of_its_draws_beside_their_range():
    """--seeds N: each split is searched over N draws of the lengths and arrivals (seeds --seed .. --seed + N - 1);
    its prediction is the median draw's search, its range the draws' lowest and highest; one draw is the
    prediction of --seed alone."""
    prof = _profile(25.0, alpha=5.0, beta=0.01)
    args = _args(input_len="uniform:1024:4096", output_len="8", goodput=["ttft:500", "tpot:200"], gpus=1, seeds=3,
                 shared_slowdowns=None)
    three = {a["split"]: a for a in plan(prof, Workload(args), args)["arms"]}
    for seed in range(3):
        alone = _args(**{**vars(args), "seed": seed, "seeds": 1})
        for a in plan(prof, Workload(alone), alone)["arms"]:
            assert three[a["split"]]["capacity_by_seed"][seed] == a["predicted_capacity_rate"]
    for a in three.values():
        rates = a["capacity_by_seed"]
        assert a["seeds"] == [0, 1, 2] and a["predicted_capacity_rate"] == sorted(rates)[1]
        assert a["seed_range"] == [min(rates), max(rates)]
    assert len({r for a in three.values() for r in a["capacity_by_seed"]}) > 3  # the draws differ
