"""The engine's decode step on the CPU does the work of its own rows only: the piecewise forward
(graphs.MixedGraphs without graphs) runs the dense layers over the step's tokens, not a graph
bucket's padding, and the LM head over the rows whose logits are kept; the reference attention
gathers up to the longest context it is told of and reads nothing past a request's length."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import attention
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import Request, SamplingParams


def test_a_cpu_decode_step_runs_its_rows_only():
    e = Engine(EngineConfig(model="tiny", num_blocks=64))
    assert e.runner.mixed is not None and not e.runner.mixed.use_graphs  # the CPU's path for every step
    model = e.model
    seen: dict[str, list[int]] = {"mlp": [], "head": []}
    hooks = [model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen["mlp"].append(a[0].shape[-2])),
             model.lm_head.register_forward_pre_hook(lambda m, a: seen["head"].append(a[0].shape[-2]))]
    try:
        reqs = [Request(f"r{i}", [5 + i, 9, 11, 40 + i], SamplingParams(max_tokens=4, ignore_eos=True))
                for i in range(3)]
        for r in reqs[:1]:
            e.add_request(r)
        e.step()  # batch 1: its prompt (4 tokens)
        e.step()  # batch 1: one decode token
        for r in reqs[1:]:
            e.add_request(r)
        e.step()  # one decode and two prompts: 1 + 4 + 4 tokens, three rows kept
        e.step()  # three decodes
    finally:
        for h in hooks:
            h.remove()
    assert seen == {"mlp": [4, 1, 9, 3], "head": [1, 1, 3, 3]}
    while e.has_work():
        e.step()
    assert all(len(r.output_ids) == 4 for r in reqs)


def per_request(q, pool_layer, table, lens, scale):
    """Each request alone: its first n keys gathered block by block, softmax over them by hand."""
    bs, kvh = pool_layer.shape[2], pool_layer.shape[3]
    outs = []
    for i, n in enumerate(lens):
        blocks = [pool_layer[int(b)] for b in table[i, :math.ceil(n / bs)]]  # [2, bs, KVH, D] each
        k = torch.cat([b[0] for b in blocks])[:n]  # [n, KVH, D]
        v = torch.cat([b[1] for b in blocks])[:n]
        qg = q[i].view(kvh, -1, q.shape[-1])  # [KVH, G, D]
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, k) * scale, dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", w, v).reshape(-1, q.shape[-1]))
    return torch.stack(outs)


@pytest.mark.parametrize("lens", [[37], [37, 5, 64, 16], [16, 16]])
def test_reference_decode_reads_nothing_past_a_length(lens):
    gen = torch.Generator().manual_seed(len(lens))
    blocks, bs, kvh, heads, d = 40, 16, 2, 4, 8
    pool = torch.full((blocks, 2, bs, kvh, d), float("nan"))  # every byte past a length is poison
    table = torch.randperm(blocks, generator=gen)[:len(lens) * 6].view(len(lens), 6)  # wider than any context
    for i, n in enumerate(lens):
        for p in range(n):
            pool[table[i, p // bs], :, p % bs] = torch.randn(2, kvh, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    ctx = torch.tensor(lens)
    want = per_request(q, pool, table, lens, 0.3)
    for host in (lens, None):  # told the lengths on the host (an eager step), or not (a graph's replay)
        got = attention.reference_decode(q, pool, table, ctx, 0.3, host)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_cpu_engine_stores_widening_weights_transposed_with_the_same_values():
    import copy

    from pdserve.workers.engine.models import load_model

    loaded = load_model("tiny", None, "cpu")
    model = loaded.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    twin = copy.deepcopy(model, {id(p): p for p in model.parameters()})  # shares the weight tensors
    e = Engine(EngineConfig(model="tiny", num_blocks=64), loaded=loaded)
    after = dict(e.model.named_parameters(remove_duplicate=False))
    assert before.keys() == after.keys()
    for name, p in after.items():
        assert torch.equal(p, before[name]), name
    up, down = model.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.down_proj.weight
    assert up.shape == (128, 64) and up.t().is_contiguous() and not up.is_contiguous()  # 64 -> 128: re-laid
    assert down.is_contiguous()  # 128 -> 64: as it was
    head = model.lm_head.weight
    assert head.t().is_contiguous() and model.model.embed_tokens.weight is head  # still one tensor
    # the tree sharing the old tensors keeps them as they were
    assert twin.lm_head.weight.is_contiguous() and twin.model.layers[0].mlp.up_proj.weight.is_contiguous()
    # a second engine over the same model: nothing more to re-lay, no copy
    ptr = head.data_ptr()
    Engine(EngineConfig(model="tiny", num_blocks=64), loaded=loaded)
    assert model.lm_head.weight.data_ptr() == ptr
    # and the engine still gives transformers' tokens (the tree that kept the old layout)
    prompt = [5, 9, 11, 40, 7, 3]
    [req] = e.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    with torch.inference_mode():
        want = twin.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert req.output_ids == want[0, len(prompt):].tolist()
