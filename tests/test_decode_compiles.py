"""What torch.compile compiles while the decode graphs are taken: the forwards DecodeGraphs captures,
run on the CPU through the same buffers, with the layers compiled as a CUDA worker compiles them
(dynamo's frames and guards do not depend on the backend; "eager" keeps the test fast)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.engine.compile_watch import CompileWatch
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import fusion
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.graphs import DecodeGraphs
from pdserve.workers.engine.runner import compile_decoder_layers


@pytest.mark.timeout(120)
def test_decode_buckets_compile_each_layer_frame_once_and_again_for_batch_1(monkeypatch):
    engine = Engine(EngineConfig(model="tiny", device="cpu", num_blocks=64))
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real(self, **{**kw, "backend": "eager"}))
    fusion.fuse_qkv(engine.runner.model)  # as the runner does on CUDA, before it compiles the layers
    compile_decoder_layers(engine.runner.model)
    # max_num_seqs 40, not 64: the tiny model's hidden size is 64, and duck sizing would tie it to a first
    # batch of 64 (qwen2.5-7b's sizes are 3584, 28, 4 and 128: no batch bucket of 64 meets them)
    graphs = DecodeGraphs(engine.runner, 40, 2048)
    order = graphs.capture_order()
    assert [b for b, _ in order[:7]] == [40, 32, 16, 8, 4, 2, 1]
    torch._dynamo.reset()
    watch = CompileWatch().start()
    try:
        with torch.inference_mode():
            for batch, blocks in order[:14]:  # two table widths: a width is invisible to the compiled code
                graphs._forward(batch, blocks)
    finally:
        got = watch.stop()
        torch._dynamo.reset()
    # Every batch from 40 down to 2 runs the first compile (dynamic sizes); batch 1 is specialised
    # (dynamo's 0/1 rule) and compiles each frame once more. The positions used to sit at storage
    # offset max_num_seqs in the packed buffer, equal to the first batch: dynamo tied the two (duck
    # sizing), so the next batch recompiled every frame, a third compile of the layers (a
    # qwen2.5-7b-shaped model, emulated on the CPU: 15 frames and 9 graphs instead of 12 and 8)
    frames = got["dynamo_frames_compiled"]
    assert frames > 0 and got["dynamo_recompiles"] * 2 == frames, got
    assert all("2 <= " in r.splitlines()[2] for r in got["dynamo_recompile_reasons"]), got["dynamo_recompile_reasons"]
