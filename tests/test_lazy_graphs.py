"""Graphs taken lazily (EngineConfig.graphs "lazy"): the start captures the largest bucket of each kind only
(decode graphs, piecewise token buckets), the worker takes the others one at a time while it has no request
(decode graphs first), each decode graph with padding rows only, and the ready line says how many are left.
The capture itself is CUDA-only: here a stand-in records what each capture would have captured (its bucket,
and whether a decode graph's buffers held padding alone), on the CPU."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.compiles import ServingWork
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.graphs import DecodeGraphs
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.workers.roles.base import Role


def lazy_engine(monkeypatch, mode: str):
    engine = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64, max_num_seqs=8,
                                 graphs=mode))
    engine.runner.build_forwards(replace(engine.config, graphs=mode), engine.max_model_len,
                                 decode_graphs=True, mixed_graphs=False, compile=False)
    taken = []

    def capture(self, batch, blocks):  # what _capture would capture, recorded
        scratch = self.runner.scratch_block * 2 * self.runner.block_size
        padding = bool((self.k_slots == scratch).all() and (self.table == 0).all() and (self.lens == 1).all())
        taken.append(((batch, blocks), padding))
        self.graphs[(batch, blocks)] = SimpleNamespace(replay=lambda: None)
        self.capture_s[(batch, blocks)] = 0.01
        return self.graphs[(batch, blocks)]

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    return engine, taken


def test_a_lazy_start_takes_the_largest_bucket_and_idle_time_the_rest(monkeypatch):
    engine, taken = lazy_engine(monkeypatch, "lazy")
    graphs = engine.runner.graphs
    order = graphs.capture_order()
    assert len(order) > 2 and order[0] == (graphs.batch_buckets[-1], graphs.block_buckets[-1])
    engine.warmup(decode=True)
    assert [k for k, _ in taken] == order[:1] and engine.start.decode_graphs == 1
    assert engine.start.decode_graphs_left == len(order) - 1
    assert "1 decode graphs 0.0" in engine.start.describe()
    assert f"({len(order) - 1} more while idle)" in engine.start.describe()
    assert engine.graphs_pending()
    # a request on the worker: no idle capture until it is gone
    req = Request("r0", list(range(3, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(req)
    assert engine.capture_idle() == 0.0 and len(taken) == 1
    while engine.has_work():
        engine.step()
    assert not engine.requests and len(taken) == 1  # finished and gone; its steps ran without a graph (CPU)
    # idle: one capture a call, in capture order, each over padding rows only (the last step's rows are gone)
    while engine.graphs_pending():
        assert engine.capture_idle() >= 0.0
    assert [k for k, _ in taken] == order and graphs.idle == set(order[1:])
    assert all(padding for _, padding in taken[1:])
    assert engine.capture_idle() == 0.0 and not engine.graphs_pending()


def test_a_lazy_engine_gives_the_tokens_of_an_engine_without_graphs(monkeypatch):
    engine, taken = lazy_engine(monkeypatch, "lazy")
    engine.warmup(decode=True)
    reqs = [Request(f"r{i}", list(range(5, 5 + 10 * (i + 1))), SamplingParams(max_tokens=4, ignore_eos=True))
            for i in range(3)]
    want = engine.generate([r.prompt_ids for r in reqs], SamplingParams(max_tokens=4, ignore_eos=True))
    eager = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64, max_num_seqs=8))
    got = eager.generate([r.prompt_ids for r in reqs], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [r.output_ids for r in want] == [r.output_ids for r in got]
    assert all(r.error is None for r in want)


def test_all_takes_every_graph_at_start_and_leaves_nothing(monkeypatch):
    engine, taken = lazy_engine(monkeypatch, "all")
    engine.warmup(decode=True)
    order = engine.runner.graphs.capture_order()
    assert [k for k, _ in taken] == order and engine.start.decode_graphs_left == 0
    assert "more while idle" not in engine.start.describe()
    assert not engine.graphs_pending() and engine.capture_idle() == 0.0


def test_a_prefill_worker_never_captures_decode_graphs_idle(monkeypatch):
    engine, taken = lazy_engine(monkeypatch, "lazy")
    engine.warmup(decode=False)
    assert taken == [] and not engine.graphs_pending() and engine.capture_idle() == 0.0


def test_idle_captures_are_not_reported_as_work_while_serving(monkeypatch):
    engine, taken = lazy_engine(monkeypatch, "lazy")
    engine.warmup(decode=True)
    work = ServingWork().start()
    work.mark(engine)
    assert engine.capture_idle() > 0.0 and len(taken) == 2
    assert work.take(engine) is None  # taken with no request on the worker: it held no step
    engine.runner.graphs.capture(engine.runner.graphs.pending()[-1:])  # as a step that needs it captures it
    got = work.take(engine)
    assert got is not None and got["graphs"] == 1 and got["graphs_s"] == pytest.approx(0.01)


def test_the_loop_does_not_block_while_graphs_wait_for_idle_time(monkeypatch):
    engine, _ = lazy_engine(monkeypatch, "lazy")
    engine.warmup(decode=True)
    role = SimpleNamespace(engine=engine, poll_timeout_ms=lambda idle: idle)
    assert Role.wait_ms(role, 50) == 0
    engine.add_request(Request("r", list(range(3, 30)), SamplingParams(max_tokens=2, ignore_eos=True)))
    assert Role.wait_ms(role, 50) == 50  # a request on the worker: the role decides
    while engine.has_work():
        engine.step()
    assert Role.wait_ms(role, 50) == 0
    while engine.graphs_pending():
        engine.capture_idle()
    assert Role.wait_ms(role, 50) == 50


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="graphs must be all or lazy"):
        EngineConfig(graphs="later")
    assert torch.cuda.is_available() or EngineConfig().graphs == "all"


def piecewise_engine(monkeypatch, mode: str):
    """A lazy_engine whose piecewise path replays graphs too, its token buckets' capture a recording stand-in."""
    from pdserve.workers.engine.graphs import MixedGraphs

    engine, taken = lazy_engine(monkeypatch, mode)
    mixed = engine.runner.mixed
    mixed.use_graphs, mixed.graph_limit = True, 128  # buckets 16, 32, 64, 128 replayed as graphs

    def capture(self, bucket):
        taken.append((("piecewise", bucket), None))
        self.graphs[bucket] = [SimpleNamespace(replay=lambda: None)] * self.cut.num_segments
        self.capture_s[bucket] = 0.02
        return self.graphs[bucket]

    monkeypatch.setattr(MixedGraphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return engine, taken


def test_a_lazy_start_takes_the_largest_piecewise_bucket_and_idle_time_the_rest_after_the_decode_graphs(monkeypatch):
    engine, taken = piecewise_engine(monkeypatch, "lazy")
    mixed, decode = engine.runner.mixed, engine.runner.graphs
    assert mixed.graph_buckets == [16, 32, 64, 128] and mixed.pending() == [128, 64, 32, 16]
    engine.warmup(decode=True)
    order = decode.capture_order()
    assert [k for k, _ in taken] == [order[0], ("piecewise", 128)]
    s = engine.start
    assert s.piecewise_buckets_left == 3 and s.piecewise_graphs == mixed.cut.num_segments
    assert "(3 buckets more while idle)" in s.describe()
    while engine.graphs_pending():
        engine.capture_idle()
    # the decode graphs first, then the piecewise buckets, largest first
    assert [k for k, _ in taken[2:]] == order[1:] + [("piecewise", b) for b in (64, 32, 16)]
    assert mixed.idle == {64, 32, 16} and mixed.pending() == [] and not engine.graphs_pending()
    # idle captures held no step: not work while serving; a step's own capture is
    work = ServingWork().start()
    work.mark(engine)
    assert work.take(engine) is None
    del mixed.graphs[16], mixed.capture_s[16]
    mixed.idle.discard(16)
    mixed.capture([16])  # as a step of 16 tokens captures its bucket
    assert work.take(engine)["graphs"] == 1


def test_a_lazy_prefill_worker_takes_its_piecewise_buckets_while_idle(monkeypatch):
    engine, taken = piecewise_engine(monkeypatch, "lazy")
    engine.warmup(decode=False)  # a prefill worker: no decode graph at all
    assert [k for k, _ in taken] == [("piecewise", 128)] and engine.graphs_pending()
    while engine.graphs_pending():
        engine.capture_idle()
    assert [k for k, _ in taken] == [("piecewise", b) for b in (128, 64, 32, 16)]


def test_all_takes_every_piecewise_bucket_at_start(monkeypatch):
    engine, taken = piecewise_engine(monkeypatch, "all")
    engine.warmup(decode=True)
    assert [k for k, _ in taken][-4:] == [("piecewise", b) for b in (128, 64, 32, 16)]
    assert engine.start.piecewise_buckets_left == 0 and not engine.graphs_pending()
    assert "buckets more while idle" not in engine.start.describe()


def test_an_idle_capture_after_a_longer_step_runs_over_padding_rows(monkeypatch):
    """A served step leaves its inputs in the piecewise buffer, its kept rows among them. A smaller bucket
    captured while idle afterwards ran its warm-up forward over them: the head gathered a kept row past the
    bucket's rows (on an H200 a device-side assert that ended the worker). An idle capture runs over
    padding, as the start's does."""
    from pdserve.workers.engine.graphs import MixedGraphs

    engine, taken = piecewise_engine(monkeypatch, "lazy")
    recorded = MixedGraphs._capture

    def capture(self, bucket):  # the real capture's CPU half: its warm-up forward, then the recording
        self.warm(bucket)
        return recorded(self, bucket)

    monkeypatch.setattr(MixedGraphs, "_capture", capture)
    engine.warmup(decode=True)
    mixed = engine.runner.mixed
    assert mixed.pending() == [64, 32, 16]
    req = Request("long", list(range(5, 105)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert req.error is None and int(mixed.cut.keep.max()) == 99  # the 100-token step's last row, past 64
    while engine.graphs_pending():
        engine.capture_idle()
    assert [k for k, _ in taken if k[0] == "piecewise"] == [("piecewise", b) for b in (128, 64, 32, 16)]
    assert not mixed.packed.any()


def test_every_capture_runs_in_thread_local_mode(monkeypatch):
    """A worker's other threads query their own CUDA events while the loop may capture a graph (lazily, or a
    step's missing bucket); in CUDA's default global capture mode such a query fails the capture. Both
    kinds of capture ask for the thread-local mode: run here with torch.cuda's graph, streams and
    synchronise replaced by recorders, the forwards themselves on the CPU."""
    import contextlib

    from pdserve.workers.engine.graphs import CAPTURE_MODE

    modes = []

    class Graph:
        def pool(self):
            return None

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        modes.append(capture_error_mode)
        yield

    for name, value in (("graph", graph), ("CUDAGraph", Graph), ("Stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("current_stream", lambda device=None: Stream()),
                        ("synchronize", lambda device=None: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    engine = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64, max_num_seqs=8))
    engine.runner.build_forwards(engine.config, engine.max_model_len, decode_graphs=True, mixed_graphs=False,
                                 compile=False)
    decode, mixed = engine.runner.graphs, engine.runner.mixed
    with torch.inference_mode():
        decode.capture([(1, decode.block_buckets[0])])
        mixed.use_graphs = True
        mixed.capture([16])
    assert CAPTURE_MODE == "thread_local"
    assert modes == ["thread_local"] * (1 + mixed.cut.num_segments)
