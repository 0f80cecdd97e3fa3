"""Decode graphs that run the piecewise path's segments (EngineConfig.decode_graph_forward "cut"): the same
logits as transformers' forward ("layers"), and one compile of the layers' code for a whole start.

The graphs' forwards run on the CPU through the graphs' own buffers (DecodeGraphs.decode runs a bucket's
forward directly where there is no CUDA): the capture is CUDA-only, what it captures is not."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.bench.engine.compile_watch import CompileWatch
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import fusion, step_inputs
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import Request, SamplingParams

PROMPTS = [3, 17, 40, 70, 9]  # prompt lengths: contexts of 1 to 5 blocks of 16


def decode_graphs(engine: Engine, forward: str, compile: bool = False):
    """The DecodeGraphs a CUDA worker with this decode_graph_forward would build (and its MixedGraphs)."""
    cfg = replace(engine.config, decode_graph_forward=forward)
    engine.runner.build_forwards(cfg, engine.max_model_len, decode_graphs=True, mixed_graphs=False,
                                 compile=compile)
    return engine.runner.graphs


def running(engine: Engine) -> list[Request]:
    """Requests of different contexts, each with its prompt's KV in the pool and a token to decode."""
    reqs = [Request(f"r{i}", [(7 + 13 * i + 5 * j) % 500 for j in range(n)],
                    SamplingParams(max_tokens=50, ignore_eos=True)) for i, n in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    while not all(r.output_ids and r.num_computed == r.num_tokens - 1 for r in reqs):
        engine.step()
    return reqs


@pytest.mark.timeout(120)
def test_cut_decode_forward_gives_the_layers_forwards_logits_at_every_bucket():
    engine = Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64, max_num_seqs=8))
    reqs = running(engine)
    cut, layers = decode_graphs(engine, "cut"), decode_graphs(engine, "layers")
    assert cut.cut is not None and layers.cut is None and cut.batch_buckets == [1, 2, 4, 8]
    with torch.inference_mode():
        # batches of 1 (its segments over 2 rows), 2, 3 and 5 (buckets 4 and 8: padding rows)
        for batch in ([reqs[2]], reqs[:2], reqs[1:4], reqs):
            work = [(r, 1) for r in batch]
            got, want = cut.decode(work).clone(), layers.decode(work).clone()
            eager = engine.runner._run_eager(step_inputs.build(work, engine.layout.block_size), None, None)
            assert got.shape == (len(batch), engine.vocab_size) and torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        # the overlapped step's feed: a row's input token written on the device into the graph's ids
        work = [(r, 1) for r in reqs[:3]]
        feed = ([1], [0], torch.tensor([123]))
        plain, fed_cut, fed_layers = cut.decode(work).clone(), cut.decode(work, feed).clone(), layers.decode(work, feed)
        torch.testing.assert_close(fed_cut, fed_layers, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain[1], fed_cut[1]) and torch.equal(plain[0], fed_cut[0])


def start_compiles(forward: str, monkeypatch) -> tuple[dict, dict]:
    """Dynamo's compiles over a start's forwards, the layers compiled as on CUDA ("eager" backend: frames and
    guards do not depend on it): (the piecewise buckets alone, the decode buckets and then the piecewise ones)."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", num_blocks=64, max_num_seqs=40))
    real_compile, real_module_compile = torch.compile, torch.nn.Module.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: real_module_compile(self, **{**kw, "backend": "eager"}))
    fusion.fuse_qkv(engine.runner.model)  # as the runner does on CUDA, before it compiles anything
    graphs = decode_graphs(engine, forward, compile=True)
    mixed = engine.runner.mixed
    pieces = [b for b in mixed.buckets if b <= mixed.graph_limit][::-1]  # capture order: largest first
    assert pieces[0] == 1024 and pieces[-1] == 16

    def watched(decodes) -> dict:
        torch._dynamo.reset()
        watch = CompileWatch().start()
        try:
            with torch.inference_mode():
                for batch, blocks in decodes:
                    graphs._forward(batch, blocks)
                for b in pieces:
                    mixed.warm(b)
        finally:
            got = watch.stop()
            torch._dynamo.reset()
        return got

    # two table widths, every batch bucket (40 down to 1): a start's decode graphs, as Engine.warmup takes them
    return watched([]), watched(graphs.capture_order()[:14])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("forward", ["cut", "layers"])
def test_a_start_compiles_the_layers_code_once(forward, monkeypatch):
    alone, start = start_compiles(forward, monkeypatch)
    assert alone["dynamo_frames_compiled"] > 0 and alone["dynamo_recompiles"] == 0, alone
    if forward == "layers":  # the decode graphs compile transformers' layers apart from the segments
        assert start["dynamo_frames_compiled"] > alone["dynamo_frames_compiled"], (alone, start)
        return
    # the decode graphs add no frame and no recompile (batch 1 included: its segments run over 2 rows)
    assert start["dynamo_frames_compiled"] == alone["dynamo_frames_compiled"], start
    assert start["dynamo_graphs"] == alone["dynamo_graphs"] and start["dynamo_recompiles"] == 0, start
