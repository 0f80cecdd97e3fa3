"""Each worker's step trace (--step-trace, workers/engine/step_trace.py) and `pdserve-bench trace`
(bench/load/trace.py): a line per step that accounts for every token the steps computed, the forward
each took, the prefill worker's batches, the served workers' files; the summary's grouping, its
prediction by the planner's rule and its reading of two workers sharing a device."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.bench.load import trace as tr
from pdserve.bench.load.plan_sim import Profile
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.workers.engine.step_trace import trace_path

pytestmark = pytest.mark.timeout(180)


def _lines(path) -> tuple[dict, list[dict]]:
    [segment] = tr.read(path)
    return segment


@pytest.mark.parametrize("overlap", [False, True])
def test_every_token_a_step_computed_is_in_its_line(tmp_path, overlap):
    """Chunked prompts and decodes: the lines' chunks cover each prompt once, in order; the decode rows add
    up to the tokens generated after the first; one line a step, each complete (overlapped steps are read
    back a step late: their lines too)."""
    engine = Engine(EngineConfig(model="tiny", num_blocks=64, chunk_tokens=32, step_trace=str(tmp_path),
                                 overlap=overlap))
    assert engine.trace_steps("colocated-7", "colocated") == trace_path(str(tmp_path), "colocated-7")
    prompts = [[5 + i % 200 for i in range(70)], [9 + i % 100 for i in range(20)]]
    out = 6
    reqs = engine.generate(prompts, SamplingParams(max_tokens=out, ignore_eos=True))
    assert all(len(r.output_ids) == out for r in reqs)
    engine.close()
    header, steps = _lines(tmp_path / "steps-colocated-7.jsonl")
    assert header["worker"] == "colocated-7" and header["role"] == "colocated" and header["chunk_tokens"] == 32
    assert header["overlap"] is overlap and header["device"] == "cpu"
    assert [s["i"] for s in steps] == list(range(len(steps)))
    chunks = [c for s in steps for c in s["chunks"]]
    # prompt 0 in 32-token chunks, prompt 1 beginning in the third step
    assert chunks == [[0, 32], [32, 64], [64, 70], [0, 20]]
    assert sum(s["decode"] for s in steps) == len(prompts) * (out - 1)
    assert all(s["tokens"] == s["decode"] + sum(b - a for a, b in s["chunks"]) for s in steps)
    assert all(s["chunks"] or s["decode"] for s in steps)
    # decode rows read their context: prompt + tokens so far, both requests at their first decode step
    first_decode = next(s for s in steps if s["decode"] == 2)
    assert first_decode["decode_ctx"] == (70 + 1) + (20 + 1)
    for s in steps:
        assert s["path"] == "piecewise"  # the CPU: the piecewise segments run directly, no graphs
        assert s["device_ms"] is None and s["gap_ms"] is None  # no CUDA events on the CPU
        assert s["launch_ms"] > 0 and s["schedule_ms"] >= 0 and s["wait_ms"] >= 0 and s["done_t"] >= s["t"]
        assert s["startup_work"] == 0  # nothing compiles here (no torch.compile on the CPU by default)
        assert s["launch_cpu_ms"] >= 0 and s["launch_gc_ms"] >= 0 and s["launch_sync_ms"] == 0  # no device waits
        assert s["launch_csw"] is None or (len(s["launch_csw"]) == 2 and min(s["launch_csw"]) >= 0)
    assert all(a["t"] <= b["t"] for a, b in zip(steps, steps[1:]))


def test_a_prefill_workers_batch_is_one_line_and_its_prompt_logprobs_run_eagerly(tmp_path):
    engine = Engine(EngineConfig(model="tiny", num_blocks=64, step_trace=str(tmp_path)))
    engine.trace_steps("prefill-0", "prefill")
    reqs = [Request(f"r{i}", [3 + i + j % 50 for j in range(n)], SamplingParams(max_tokens=2))
            for i, n in enumerate((40, 17))]
    results = engine.prefill_batch(reqs)
    assert all(not isinstance(r, Exception) for r in results)
    asks = Request("asks", [7] * 12, SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.prefill_only(asks)
    engine.flush_trace()  # requests are still on the worker (their transfers): not flushed yet
    assert _lines(tmp_path / "steps-prefill-0.jsonl")[1] == []
    for r in (*reqs, asks):
        engine.release(r.request_id)
    engine.flush_trace()  # none left: the lines are written
    _, steps = _lines(tmp_path / "steps-prefill-0.jsonl")
    assert [(s["kind"], s["chunks"], s["decode"], s["path"]) for s in steps] == [
        ("prefill", [[0, 40], [0, 17]], 0, "piecewise"), ("prefill", [[0, 12]], 0, "eager")]
    engine.close()


def test_a_step_that_compiled_while_it_launched_says_so(tmp_path):
    import torch

    from pdserve.workers.engine.step_trace import StepTrace

    count = [0]
    trace = StepTrace(str(tmp_path / "steps-x.jsonl"), torch.device("cpu"), {"worker": "x"}, lambda: count[0])
    for compiled in (2, 0):
        entry = trace.begin("step", [], time.monotonic(), time.monotonic())
        count[0] += compiled  # a compile or capture inside the launch
        trace.launched(entry, "eager")
        trace.settled(entry, 0.0)
    trace.close()
    assert [s["startup_work"] for s in _lines(tmp_path / "steps-x.jsonl")[1]] == [2, 0]


def test_a_launch_says_where_its_host_time_went(tmp_path):
    """A launch that sleeps, collects garbage and waits on an event: its line tells the three apart from the
    thread's own CPU time, and `pdserve-bench trace` shows them per make of step."""
    import gc

    import torch

    from pdserve.workers.engine.step_trace import StepTrace, host_wait

    class SlowEvent:  # a device wait of 30 ms, slept
        def synchronize(self):
            time.sleep(0.03)

    trace = StepTrace(str(tmp_path / "steps-x.jsonl"), torch.device("cpu"), {"worker": "x", "role": "colocated"})
    kinds = []
    gc.disable()  # no collection but the one asked for (another thread's allocations could start one)
    try:
        for kind in ("sleep", "gc", "wait", "spin"):
            entry = trace.begin("step", [], time.monotonic(), time.monotonic())
            if kind == "sleep":
                time.sleep(0.05)
            elif kind == "gc":
                garbage = [[i] for i in range(200_000)]  # a collection with something to walk
                gc.collect()
                del garbage
            elif kind == "wait":
                host_wait(SlowEvent())
            else:
                end = time.thread_time() + 0.03
                while time.thread_time() < end:
                    pass
            trace.launched(entry, "eager")
            trace.settled(entry, 0.0)
            kinds.append(kind)
    finally:
        gc.enable()
    trace.close()
    lines = dict(zip(kinds, _lines(tmp_path / "steps-x.jsonl")[1]))
    sleep, collected, waited, spun = lines["sleep"], lines["gc"], lines["wait"], lines["spin"]
    assert sleep["launch_ms"] >= 50 and sleep["launch_cpu_ms"] < 0.5 * sleep["launch_ms"]
    assert sleep["launch_gc_ms"] == 0 and sleep["launch_sync_ms"] == 0
    assert collected["launch_gc_ms"] > 0 and collected["launch_gc_ms"] <= collected["launch_ms"]
    assert waited["launch_sync_ms"] >= 30 and waited["launch_sync_ms"] <= waited["launch_ms"]
    assert spun["launch_cpu_ms"] >= 30 and spun["launch_sync_ms"] == 0
    if sleep["launch_csw"] is not None:  # Linux: the sleep gave the core up
        assert sleep["launch_csw"][0] >= 1
    out = tr.report([str(tmp_path)], None, [])
    [row] = out["workers"][0]["makes"]
    assert row["host"]["launch_sync_ms_p90"] > 0 and row["host"]["launch_ms_p90"] >= 30  # one step in four waited
    text = tr.render(out)
    assert "where the launches' host time went" in text and "| decode b1 | eager |" in text


def test_a_trace_from_before_the_host_fields_reads_without_them(tmp_path):
    (tmp_path / "steps-old.jsonl").write_text("\n".join(json.dumps(x) for x in (
        {"trace": "pdserve steps", "version": 1, "worker": "old", "role": "colocated", "device": "cpu"},
        {"i": 0, "kind": "step", "path": "eager", "t": 0.0, "decode": 1, "decode_ctx": 5, "chunks": [], "tokens": 1,
         "schedule_ms": 0.1, "launch_ms": 2.0, "startup_work": 0, "device_ms": None, "gap_ms": None,
         "wait_ms": 0.0, "done_t": 0.01})) + "\n")
    out = tr.report([str(tmp_path)], None, [])
    assert out["workers"][0]["makes"][0]["host"] is None
    assert "host time went" not in tr.render(out)


def test_device_and_gap_times_come_from_the_events_in_stream_order(tmp_path, monkeypatch):
    """On CUDA a step's device_ms runs from its start event to its end event, and gap_ms from the previous
    step's end to its start; with overlap step N+1 is begun before step N is settled. A stand-in for
    torch.cuda.Event on a clock the test moves (the stream's time at each record)."""
    import torch

    from pdserve.workers.engine import step_trace

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            assert self.at is not None

        def elapsed_time(self, other):
            return (other.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    trace = step_trace.StepTrace(str(tmp_path / "steps-g.jsonl"), torch.device("cuda:0"), {"worker": "g"})
    now = time.monotonic()
    a = trace.begin("step", [], now, now)  # the stream reaches step A's start at 1.000 s, its end at 1.010
    clock[0] = 1.000
    a["_start"].record()
    clock[0] = 1.010
    trace.launched(a, "decode-graph")
    b = trace.begin("step", [], now, now)  # B launched before A is read back; the stream idles 2 ms before it
    clock[0] = 1.012
    b["_start"].record()
    trace.settled(a, 0.001)
    clock[0] = 1.042
    trace.launched(b, "piecewise-graph")
    trace.settled(b, 0.0)
    trace.close()
    steps = _lines(tmp_path / "steps-g.jsonl")[1]
    assert [(s["device_ms"], s["gap_ms"]) for s in steps] == [(pytest.approx(10.0), None),
                                                                (pytest.approx(30.0), pytest.approx(2.0))]


def test_a_trace_stops_at_its_bound_and_says_so(tmp_path, monkeypatch):
    import torch

    from pdserve.workers.engine import step_trace

    monkeypatch.setattr(step_trace, "MAX_STEPS", 2)
    trace = step_trace.StepTrace(str(tmp_path / "steps-b.jsonl"), torch.device("cpu"), {"worker": "b"})
    for _ in range(4):
        entry = trace.begin("step", [], time.monotonic(), time.monotonic())
        trace.launched(entry, "eager")
        trace.settled(entry, 0.0)
    trace.close()
    lines = (tmp_path / "steps-b.jsonl").read_text().splitlines()
    assert len(_lines(tmp_path / "steps-b.jsonl")[1]) == 2
    assert json.loads(lines[-1]) == {"truncated": True, "steps": 2} and len(lines) == 4


def test_no_trace_without_the_flag_and_a_worker_name_cannot_leave_the_directory(tmp_path):
    engine = Engine(EngineConfig(model="tiny", num_blocks=64))
    assert engine.trace_steps("w", "colocated") is None and engine.trace is None
    assert trace_path(str(tmp_path), "../x/y") == str(tmp_path / "steps-.._x_y.jsonl")
    assert EngineConfig(step_trace="rel/dir").step_trace.startswith("/")  # a worker may start elsewhere


def test_a_restarted_worker_appends_a_segment_of_its_own(tmp_path):
    """pdserve restarts a dead worker under the same id: its trace is appended to, and read as two segments
    (each step's times on its own segment's clock), not overwritten."""
    for run in range(2):
        engine = Engine(EngineConfig(model="tiny", num_blocks=64, step_trace=str(tmp_path)))
        engine.trace_steps("decode-0", "colocated")
        engine.generate([[5] * 10], SamplingParams(max_tokens=2 + run, ignore_eos=True))
        engine.close()
    segments = tr.read(tmp_path / "steps-decode-0.jsonl")
    assert [sum(s["decode"] for s in steps) for _, steps in segments] == [1, 2]
    assert [steps[0]["i"] for _, steps in segments] == [0, 0]
    out = tr.report([str(tmp_path)], None)
    assert [w["file"].endswith(suffix) for w, suffix in zip(out["workers"], (".jsonl", ".jsonl#1"))] == [True, True]


def test_the_served_workers_each_write_their_steps(tiny_pdserve):
    """The shared tiny pdserve runs with --step-trace: a request each way leaves prefill lines on the
    prefill worker and step lines on the decode and colocated workers, on disk once they are idle."""
    for policy in ("colocated", "disaggregated"):
        r = tiny_pdserve.post("/v1/completions", {"model": "tiny", "prompt": f"trace me {policy} " * 6,
                                                  "max_tokens": 3, "ignore_eos": True, "policy": policy})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    kinds: dict[str, set] = {}
    while time.monotonic() < deadline:
        kinds = {}
        for f in sorted(tiny_pdserve.step_trace.glob("steps-*.jsonl")):
            header, steps = _lines(f)
            kinds[header["role"]] = {s["kind"] for s in steps}
        if kinds.get("prefill") and kinds.get("decode") and kinds.get("colocated"):
            break
        time.sleep(0.2)
    assert kinds.get("prefill") == {"prefill"} and kinds.get("decode") == {"step"} and kinds.get("colocated") == {"step"}
    out = tr.report([str(tiny_pdserve.step_trace)], None)
    assert {w["role"] for w in out["workers"]} == {"prefill", "decode", "colocated"}


def _write(path, header: dict, steps: list[dict]) -> None:
    base = {"kind": "step", "path": "decode-graph", "decode": 1, "decode_ctx": 100, "chunks": [], "tokens": 1,
            "schedule_ms": 0.1, "launch_ms": 0.2, "device_ms": 10.0, "gap_ms": 0.0, "wait_ms": 1.0}
    rows = [{"trace": "pdserve steps", "version": 1, "device": "cuda:0", "unix_time": 1000.0, **header}]
    rows += [{**base, "i": i, **s} for i, s in enumerate(steps)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"i\": 9, \"cut sho")  # a dying worker's last line


def test_the_summary_groups_predicts_and_reads_sharing(tmp_path):
    profile = Profile.from_points({512: 20.0, 1024: 40.0}, [(1, 1000, 5.0), (8, 1000, 6.0), (1, 4000, 5.3),
                                                            (8, 4000, 8.4)], fixed_ms=2.0)
    profile.chunk_step_ms = 3.0
    # the prefill worker: two forwards, the first while the decode worker stepped, the second alone
    _write(tmp_path / "steps-prefill-0.jsonl", {"worker": "prefill-0", "role": "prefill"}, [
        {"kind": "prefill", "path": "piecewise-graph", "decode": 0, "decode_ctx": 0, "chunks": [[0, 512]],
         "tokens": 512, "t": 0.0, "done_t": 1.0, "device_ms": 44.0},
        {"kind": "prefill", "path": "piecewise-graph", "decode": 0, "decode_ctx": 0, "chunks": [[0, 1024]],
         "tokens": 1024, "t": 5.0, "done_t": 6.0, "device_ms": 40.0}])
    # the decode worker, its clock's zero 0.5 s later: a step over [0, 2] on its clock, [0.5, 2.5] on the other's
    _write(tmp_path / "steps-decode-0.jsonl", {"worker": "decode-0", "role": "decode", "unix_time": 1000.5}, [
        {"t": 0.0, "done_t": 2.0}])
    # a colocated worker on another device: chunked, a chunk beside 4 decodes
    _write(tmp_path / "steps-colocated-0.jsonl", {"worker": "colocated-0", "role": "colocated", "device": "cuda:1",
                                                  "chunked_prefill": True}, [
        {"decode": 4, "decode_ctx": 8000, "chunks": [[512, 1024]], "tokens": 516, "t": 0.0, "done_t": 0.1,
         "path": "piecewise-graph", "device_ms": 30.0, "gap_ms": 2.0}])
    out = tr.report([str(tmp_path)], profile)
    by = {w["worker"]: w for w in out["workers"]}
    pre = by["prefill-0"]
    assert [(m["make"], m["steps"]) for m in pre["makes"]] == [("prompt 1-1024", 2)]
    # predicted: the fixed cost + the tokens' (no chunk step cost: a prefill worker's forward)
    p512, p1024 = profile.prefill(0, 512), profile.prefill(0, 1024)
    assert pre["makes"][0]["predicted_ms_p50"] == pytest.approx((p512 + p1024) / 2)
    # the first forward ran beside the decode step for 0.5 of its 1 s; the second alone
    share = pre["beside_other"]
    assert share["steps_alone"] == 1 and share["steps_shared"] == 0
    assert share["ratio_alone_p50"] == pytest.approx(40.0 / p1024)
    dec = by["decode-0"]
    # the decode step, [0.5, 2.5] on the prefill worker's clock, had the forward [0, 1] beside it for 0.5 s of 2
    assert dec["beside_other"] == {"steps_alone": 0, "steps_shared": 0, "ratio_alone_p50": None,
                                   "ratio_shared_p50": None}
    assert dec["makes"][0]["make"] == "decode b1" and dec["makes"][0]["ratio_p50"] == pytest.approx(
        10.0 / profile.decode(1, 100))
    colo = by["colocated-0"]
    assert "beside_other" not in colo  # alone on its device
    assert colo["makes"][0]["make"] == "prompt 1-1024 + decodes"
    assert colo["makes"][0]["predicted_ms_p50"] == pytest.approx(
        profile.decode(4, 8000) + profile.tokens(512, 1024) + 3.0)
    assert colo["device_busy_share"] == pytest.approx(0.030 / 0.1) and colo["device_gap_share"] == pytest.approx(0.02)
    text = tr.render(out)
    assert "prefill-0 (prefill, cuda:0): 2 steps" in text and "| prompt 1-1024 + decodes | piecewise-graph |" in text


def test_a_load_runs_wall_clock_window_splits_the_trace_by_run(tmp_path):
    """--results: each run of the load bench (its wall_s window) gets the steps that began inside it."""
    _write(tmp_path / "steps-colocated-0.jsonl", {"worker": "colocated-0", "role": "colocated", "unix_time": 1000.0}, [
        {"t": 0.5, "done_t": 0.6, "device_ms": 100.0, "startup_work": 3}, {"t": 1.5, "done_t": 1.6, "device_ms": 50.0},
        {"t": 12.0, "done_t": 12.1, "device_ms": 10.0}, {"t": 13.0, "done_t": 13.1, "device_ms": 10.0}])
    results = {"results": [
        {"arm": "default", "phase": "probe", "load_label": "rate 10/s", "cold": True, "wall_s": [1000.0, 1002.0]},
        {"arm": "default", "phase": "probe", "load_label": "rate 5/s", "cold": False, "wall_s": [1011.0, 1014.0]},
        {"arm": "old", "phase": "point", "load_label": "x"}]}  # written before wall_s: no window, no line
    prof = Profile.from_points({512: 20.0, 1024: 40.0}, [(1, 100, 5.0), (8, 100, 6.0), (1, 400, 5.3), (8, 400, 8.4)],
                               fixed_ms=2.0)
    [w] = tr.report([str(tmp_path)], prof, [results])["workers"]
    cold, warm = w["runs"]
    assert (cold["run"], cold["steps"], cold["with_startup_work"], cold["cold"]) == ("default probe rate 10/s", 2, 1, True)
    assert cold["device_busy_share"] == pytest.approx(0.150 / 2.0) and warm["steps"] == 2
    assert warm["ratio_p50"] == pytest.approx(10.0 / prof.decode(1, 100))
    assert "run default probe rate 10/s (cold): 2 steps, device busy 8%" in tr.render(tr.report([str(tmp_path)], prof,
                                                                                               [results]))


def test_beside_counts_overlap_exactly():
    steps = [{"t": 0.0, "done_t": 2.0}, {"t": 3.0, "done_t": 4.0}]
    other = [{"t": 0.5, "done_t": 1.0}, {"t": 1.5, "done_t": 3.5}, {"t": 9.0, "done_t": 10.0}]
    assert tr.beside(steps, other) == [pytest.approx(0.5 / 2 + 0.5 / 2), pytest.approx(0.5)]
    # two other workers' steps overlapping each other count once: [0, 1] and [0.5, 1.5] cover 1.5 s of 2
    assert tr.beside([{"t": 0.0, "done_t": 2.0}], [{"t": 0.0, "done_t": 1.0}, {"t": 0.5, "done_t": 1.5}]) == \
        [pytest.approx(0.75)]
    assert tr.beside(steps, []) == [0.0, 0.0]


def test_the_cli_reads_a_directory_and_refuses_what_is_not_a_trace(tmp_path, capsys):
    _write(tmp_path / "steps-decode-0.jsonl", {"worker": "decode-0", "role": "decode"}, [{"t": 0.0, "done_t": 0.5}])
    assert tr.main([str(tmp_path), "--out", str(tmp_path / "s.json")]) == 0
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["provenance"]["commit"] and saved["workers"][0]["steps"] == 1
    (tmp_path / "steps-bad.jsonl").write_text("{}\n")
    assert tr.main([str(tmp_path)]) == 2
    assert "not a pdserve step trace" in capsys.readouterr().err
    assert tr.main([str(tmp_path / "nothing")]) == 2
