"""Start-up work while serving (workers/engine/compiles.py): a worker reports the compiles and graph
captures that happen after it is ready, each of which held a step, and says nothing when none did."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.workers.engine.compiles import ServingWork, describe
from pdserve.workers.worker import Worker


def _engine(decode=None, mixed=None):
    return SimpleNamespace(runner=SimpleNamespace(graphs=decode, mixed=mixed))


def test_nothing_since_ready_is_nothing_and_a_compile_after_it_is_reported():
    work = ServingWork().start()
    engine = _engine(decode=SimpleNamespace(capture_s={(1, 16): 0.2}), mixed=SimpleNamespace(capture_s={16: 0.1}))
    f = torch.compile(lambda x: x * 3 + 1, backend="eager")
    f(torch.ones(2))  # compiled before ready: the start's, not reported
    work.mark(engine)
    assert work.take(engine) is None
    f(torch.ones(2))  # the same shape: no compile
    assert work.take(engine) is None
    g = torch.compile(lambda x: x.sum() * 2, backend="eager")
    g(torch.ones(3))  # a frame compiled while serving
    got = work.take(engine)
    assert got is not None and got["dynamo_frames"] == 1 and got["dynamo_s"] > 0
    assert got["graphs"] == 0 and got["triton"] == {}
    assert work.take(engine) is None  # each take reports what came since the last


def test_a_triton_compile_and_graph_captures_are_counted_by_kernel():
    import triton.compiler as tc

    work = ServingWork().start()
    wrapped = tc.compile
    assert getattr(wrapped, "_pdserve_timed", False)
    ServingWork().start()  # a second watcher (two workers in one process) wraps nothing twice
    assert tc.compile is wrapped
    decode, mixed = SimpleNamespace(capture_s={}), SimpleNamespace(capture_s={})
    engine = _engine(decode, mixed)
    work.mark(engine)

    class Src:  # what triton.compiler.compile is handed names its kernel; this one fails to compile
        name = "_prefix_kernel"

    for _ in range(2):
        with pytest.raises(Exception):
            tc.compile(Src())
    decode.capture_s[(4, 64)] = 0.25  # a decode graph captured at its first step
    mixed.capture_s[256] = 0.5
    got = work.take(engine)
    assert got["triton"]["_prefix_kernel"]["compiles"] == 2 and got["triton"]["_prefix_kernel"]["s"] >= 0
    assert got["graphs"] == 2 and got["graphs_s"] == pytest.approx(0.75)
    text = describe(got)
    assert "Triton _prefix_kernel x2" in text and "2 graphs captured 0.75 s" in text
    assert work.take(engine) is None


def test_describe_names_each_kind_once():
    text = describe({"dynamo_frames": 2, "dynamo_s": 3.414, "graphs": 1, "graphs_s": 0.5,
                     "triton": {f"k{i}": {"compiles": 1, "s": float(i)} for i in range(8)}})
    assert text.startswith("2 torch.compile frames 3.41 s; Triton k7 7.00 s, k6 6.00 s")  # slowest first
    assert "and 2 more" in text and text.endswith("1 graph captured 0.50 s")


def test_the_worker_logs_a_warning_only_when_something_happened(caplog):
    decode = SimpleNamespace(capture_s={})
    engine = _engine(decode, None)
    work = ServingWork().start()
    work.mark(engine)
    me = SimpleNamespace(serving_work=work, engine=engine, worker_id="colocated-0", _work_checked=0.0)
    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        assert Worker.check_serving_work(me) is None
        decode.capture_s[(8, 128)] = 0.3
        text = Worker.check_serving_work(me)
    assert text == "1 graph captured 0.30 s" and me._work_checked > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.worker"]
    assert lines == ["colocated-0: start-up work while serving (the steps waited for it): 1 graph captured 0.30 s"]


def test_a_real_worker_start_reports_nothing_after_ready():
    # the tiny model on the CPU: its start does everything it needs, so a request afterwards compiles nothing
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.request import SamplingParams
    from pdserve.workers.warmup import start_engine

    work = ServingWork().start()
    engine = start_engine(EngineConfig(model="tiny", device="cpu", num_blocks=64), "colocated")
    work.mark(engine)
    t = time.monotonic()
    [req] = engine.generate([list(range(3, 40))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert req.error is None and time.monotonic() - t < 30
    assert work.take(engine) is None


def test_the_load_report_names_the_warnings_an_arms_server_logged(tmp_path):
    from pdserve.bench.load import report, session

    (tmp_path / "server-a.log").write_text(
        "2026-12-06 20:18:59,466 INFO pdserve.worker: colocated-0: colocated on cuda:0 ... ready\n"
        "2026-12-06 20:19:09,755 WARNING pdserve.worker: colocated-0: start-up work while serving (the steps "
        "waited for it): 1 torch.compile frame 2.10 s; Triton _paged_attention 0.61 s\n"
        "2026-12-06 20:19:19,757 INFO pdserve.worker: colocated-0: prompt throughput 19840.1 tokens/s\n")
    info = {"label": "a", "policy": "colocated", "server": {"command": "pdserve ...", "log": "server-a.log",
                                                            "startup_s": 41.0}}
    session.serving_work(SimpleNamespace(out=tmp_path), info)
    assert info["server"]["serving_work_count"] == 1 and "Triton _paged_attention" in info["server"]["serving_work"][0]
    [line] = report._arm_lines({"arms": [info]})
    assert ("**1 warning(s) of start-up work while serving** in its log (the first: 1 torch.compile frame 2.10 s; "
            "Triton _paged_attention 0.61 s)") in line
    quiet = {"label": "b", "server": {"command": "pdserve ...", "log": "server-b.log", "startup_s": 5.0}}
    (tmp_path / "server-b.log").write_text("nothing of the kind\n")
    session.serving_work(SimpleNamespace(out=tmp_path), quiet)
    assert quiet["server"]["serving_work_count"] == 0 and "start-up work" not in report._arm_lines({"arms": [quiet]})[0]
