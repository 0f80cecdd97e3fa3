"""The engine against transformers' own generate(), and its bookkeeping contract."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.models import load_model
from pdserve.workers.engine.request import InvalidRequest, Request, SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
    "Paris is the capital of France, and Berlin is the capital of Germany. "
    "Continuous batching lets a server run many requests in one forward pass, "
    "and a paged cache keeps each request's keys and values in small blocks of memory."
)


@functools.lru_cache(maxsize=None)
def reference(name: str):
    return load_model(name, torch.float32, "cpu")


def make_engine(name: str, **kw) -> Engine:
    cfg = dict(model=name, device="cpu", dtype="float32", block_size=16, num_blocks=128)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def prompts_of_lengths(tokenizer, lengths: list[int]) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 4)
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def run_collect(engine: Engine, reqs: list[Request]) -> dict[str, list[torch.Tensor]]:
    logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while not all(r.finished for r in reqs):
        for out in engine.step():
            if out.logits is not None:
                logits[out.request_id].append(out.logits)
    return logits


# default chunked prefill (these prompts fit one chunk), chunks of 7 tokens (prompts prefilled
# over several steps, mixed with other requests' decodes, attending over their cached prefix),
# and unchunked steps
CHUNKING = {"chunk512": {}, "chunk7": {"chunk_tokens": 7}, "unchunked": {"chunked_prefill": False}}


@pytest.mark.parametrize("name,chunking", [("tiny", c) for c in CHUNKING] + [("smollm2-135m", "chunk512"),
                                                                           ("smollm2-135m", "chunk7")])
def test_batched_greedy_equals_transformers_generate(name, chunking):
    engine = make_engine(name, **CHUNKING[chunking])
    ref = reference(name)
    # shorter than a block, exactly one block, several blocks, and two in between
    lengths = [5, 16, 53, 1, 33, 40]
    prompts = prompts_of_lengths(engine.tokenizer, lengths)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, return_logits=True) for i, p in enumerate(prompts)]
    logits = run_collect(engine, reqs)
    for prompt, req in zip(prompts, reqs):
        out = ref.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )
        want = out.sequences[0, len(prompt):].tolist()
        got = req.output_ids
        assert got == want, (
            f"{name}, prompt of {len(prompt)} tokens:\n engine: {engine.tokenizer.decode(got)!r}\n"
            f" transformers: {engine.tokenizer.decode(want)!r}"
        )
        for step, (mine, theirs) in enumerate(zip(logits[req.request_id], out.logits)):
            diff = (mine - theirs[0]).abs().max().item()
            assert diff < 1e-4, f"{name}: logits differ by {diff} at generated position {step}"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_smollm2_answers_in_real_text():
    engine = make_engine("smollm2-135m")
    prompt = engine.text.encode_prompt("What is the capital of France?", chat=True)
    [req] = engine.generate([prompt], SamplingParams(max_tokens=20))
    assert "Paris" in req.text, req.text


def test_same_tokens_alone_and_batched_with_seven_others():
    engine = make_engine("tiny")
    prompts = prompts_of_lengths(engine.tokenizer, [21, 3, 17, 40, 8, 16, 29, 50])
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    [alone] = engine.generate([prompts[0]], params)
    batched = engine.generate(prompts, params)
    assert batched[0].output_ids == alone.output_ids
    seeded = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    [s_alone] = engine.generate([prompts[0]], seeded)
    s_batched = engine.generate(prompts, seeded)
    assert s_batched[0].output_ids == s_alone.output_ids


def prefill_then_adopt(engine: Engine, prompt: list[int], params: SamplingParams, tag: str):
    """Prefill a prompt with prefill_only(), move its KV into freshly reserved blocks the way a transfer
    would (a copy: exact), adopt it there and decode to the end: (the prefill request, its result, token 1's output,
    the adopted request, the logits of its decode steps), after the prefill request."""
    layers_seen: list[int] = []
    pre = Request(f"p-{tag}", prompt, params)
    first = engine.prefill_only(pre, on_layer=layers_seen.append)
    assert layers_seen == list(range(engine.layout.num_layers))
    reserved = engine.reserve(f"d-{tag}", len(prompt))
    engine.kv.pool[:, reserved] = engine.kv.pool[:, first.block_ids]
    engine.release(f"p-{tag}")
    adopted = Request(f"d-{tag}", prompt, params, return_logits=True)
    out = engine.adopt(adopted, first.first_token)
    return pre, first, out, adopted, run_collect_running(engine, adopted)


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_prefill_only_then_adopt_is_bitwise_identical(name):
    """Bitwise because the arithmetic is the same by construction: without the prefix cache,
    prefill_only() runs the whole prompt as one forward of one request, the shape the colocated step
    runs it in (the prompts fit one chunk); the KV moves by copy (exact); the decode steps after
    adopt() are batches of one over the same KV bytes, as the colocated run's are. Every kernel sees
    the same operands, so whichever kernels this CPU picks, both paths pick the same."""
    engine = make_engine(name, prefix_cache=False)
    for n in (7, 16, 45):
        prompt = prompts_of_lengths(engine.tokenizer, [n])[0]
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        whole = Request(f"whole-{n}", prompt, params, return_logits=True)
        whole_logits = run_collect(engine, [whole])[whole.request_id]
        _, first, out, adopted, rest = prefill_then_adopt(engine, prompt, params, str(n))
        assert adopted.output_ids == whole.output_ids
        assert torch.equal(first.logits.cpu(), whole_logits[0])
        assert out.token_id == whole.output_ids[0]
        for mine, theirs in zip(rest, whole_logits[1:]):
            assert torch.equal(mine, theirs)
        assert len(rest) == len(whole_logits) - 1
    assert engine.blocks.num_free == engine.blocks.num_blocks


# Over a cached prefix prefill_only() computes only the prompt's uncached tail: GEMMs of other shapes
# (M = the tail's tokens, not the prompt's), which CPU kernels tile differently (AVX-512/AMX and AVX2
# differently again), so float32 sums are taken in another order and differ by a few ulp of their
# operands. Through SmolLM2's 30 layers that measured up to 4.5e-5 on logits of magnitude ~27 (under
# ATEN_CPU_CAPABILITY native AVX-512/AMX, avx2 and default alike; tiny: 0). The bound, 1e-5 of the
# logits' largest magnitude plus 2e-4, is ~10x what was measured, while KV read from a wrong block
# moves logits by whole units.
def close_in_float32(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    bound = 1e-5 * theirs.abs().max().item() + 2e-4
    return (mine - theirs).abs().max().item() <= bound


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_prefill_only_over_a_cached_prefix_then_adopt_matches_within_float32_rounding(name):
    engine = make_engine(name)
    for n in (16, 45):
        prompt = prompts_of_lengths(engine.tokenizer, [n])[0]
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        whole = Request(f"whole-{n}", prompt, params, return_logits=True)
        whole_logits = run_collect(engine, [whole])[whole.request_id]
        pre, first, out, adopted, rest = prefill_then_adopt(engine, prompt, params, str(n))
        assert pre.cached_tokens == (n - 1) // 16 * 16  # the prefix cache held the leading full blocks
        assert adopted.output_ids == whole.output_ids, (engine.tokenizer.decode(adopted.output_ids),
                                                        engine.tokenizer.decode(whole.output_ids))
        assert close_in_float32(first.logits.cpu(), whole_logits[0])
        assert all(close_in_float32(mine, theirs) for mine, theirs in zip(rest, whole_logits[1:]))
        assert len(rest) == len(whole_logits) - 1
    assert engine.blocks.num_free == engine.blocks.num_blocks


def run_collect_running(engine: Engine, req: Request) -> list[torch.Tensor]:
    got = []
    while not req.finished:
        for out in engine.step():
            if out.request_id == req.request_id:
                got.append(out.logits)
    return got


def test_pool_full_again_after_finish_and_abort():
    engine = make_engine("tiny", num_blocks=64)
    prompts = prompts_of_lengths(engine.tokenizer, [10, 30, 50, 5])
    reqs = [Request(f"a{i}", p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.step()
    engine.abort("a1")
    engine.abort("never-existed")
    engine.reserve("res", 40)
    engine.prefill_only(Request("held", prompts[0], SamplingParams(max_tokens=4)))
    assert engine.blocks.num_free < 64
    engine.abort("res")
    engine.release("held")
    engine.run_until_done([r for r in reqs if r.request_id != "a1"])
    assert reqs[1].finish_reason == "abort"
    assert engine.blocks.num_free == 64 and not engine.requests


def test_small_pool_makes_requests_wait_and_all_complete():
    # 8 blocks of 16 tokens = 128 slots; eight requests of ~60 tokens cannot all fit at once
    engine = make_engine("tiny", num_blocks=8)
    prompts = prompts_of_lengths(engine.tokenizer, [40] * 8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    [alone] = make_engine("tiny").generate([prompts[3]], params)
    reqs = [Request(f"s{i}", p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    peak_running = 0
    while not all(r.finished for r in reqs):
        engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        assert engine.blocks.num_free >= 0
    assert peak_running < 8
    assert all(len(r.output_ids) == 20 and r.finish_reason == "length" for r in reqs)
    assert reqs[3].output_ids == alone.output_ids
    assert engine.blocks.num_free == 8


def test_stop_strings_eos_and_max_tokens():
    engine = make_engine("smollm2-135m")
    prompt = engine.text.encode_prompt("What is the capital of France?", chat=True)
    [full] = engine.generate([prompt], SamplingParams(max_tokens=20))
    assert "Paris" in full.text
    cut = full.text.index("Paris")
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=20, stop=["Paris"]))
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:cut]
    [short] = engine.generate([prompt], SamplingParams(max_tokens=3))
    assert short.finish_reason == "length" and len(short.output_ids) == 3
    # the chat model ends its answer with an EOS token unless told to ignore it
    [long] = engine.generate([prompt], SamplingParams(max_tokens=200))
    assert long.finish_reason == "stop" and long.output_ids[-1] in engine.text.eos_token_ids


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(max_tokens=0), "`max_tokens` must be an integer in \\[1, "),
        (SamplingParams(max_tokens=10**6), "exceeds the model's context"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=-3), "top_k"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop=[""]), "stop"),
    ],
)
def test_invalid_parameters_are_rejected_clearly(params, message):
    engine = make_engine("tiny")
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(Request("bad", [1, 2, 3], params))
    assert not engine.has_work()


def test_invalid_prompts_are_rejected_clearly():
    engine = make_engine("tiny", num_blocks=4)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request(Request("v", [10**9], SamplingParams()))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        engine.add_request(Request("big", [1] * 100, SamplingParams(max_tokens=10)))
    engine.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=2)))


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy():
    engine = make_engine("tiny")
    prompt = prompts_of_lengths(engine.tokenizer, [12])[0]
    p = SamplingParams(max_tokens=10, temperature=1.5, seed=123, ignore_eos=True)
    a = engine.generate([prompt], p)[0].output_ids
    b = engine.generate([prompt], p)[0].output_ids
    c = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, seed=124, ignore_eos=True))[0].output_ids
    assert a == b and a != c
    greedy = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_ids
    topk1 = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=5, ignore_eos=True))[0].output_ids
    assert topk1 == greedy


def test_adopt_that_cannot_fit_gives_its_reservation_back():
    engine = make_engine("tiny", num_blocks=16)
    prompt = prompts_of_lengths(engine.tokenizer, [40])[0]
    assert engine.reserve("short", 10) is not None  # one block for a 40-token prompt: too small
    with pytest.raises(InvalidRequest, match="cannot hold 40 prompt tokens"):
        engine.adopt(Request("short", prompt, SamplingParams(max_tokens=4)), first_token=5)
    assert engine.blocks.num_free == 16 and not engine.requests


def test_chunked_prefill_keeps_running_requests_decoding():
    """While a long prompt is prefilled chunk by chunk, every step still gives each running
    request its next token; unchunked, the whole prompt takes one step of its own."""
    for chunked, want_stalls in ((True, 0), (False, 1)):
        engine = make_engine("tiny", chunked_prefill=chunked, chunk_tokens=16)
        short = prompts_of_lengths(engine.tokenizer, [5, 9, 12])
        running = [Request(f"s{i}", p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(short)]
        for r in running:
            engine.add_request(r)
        while not all(r.output_ids for r in running):
            engine.step()
        long = Request("long", prompts_of_lengths(engine.tokenizer, [150])[0], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.add_request(long)
        steps = stalls = 0
        while not long.output_ids:
            before = [len(r.output_ids) for r in running]
            engine.step()
            steps += 1
            stalls += any(len(r.output_ids) == b for r, b in zip(running, before))
        assert stalls == want_stalls, (chunked, stalls)
        if chunked:
            assert steps == -(-150 // 16)  # one chunk a step
        engine.run_until_done(running + [long])
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_prompt_alone_in_chunks_equals_one_prefill():
    """Steps that only prefill part of a prompt sample nothing; the tokens equal an unchunked run."""
    prompt = prompts_of_lengths(reference("tiny").tokenizer, [61])[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [whole] = make_engine("tiny", chunked_prefill=False).generate([prompt], params)
    engine = make_engine("tiny", chunk_tokens=8)
    req = Request("alone", prompt, params)
    engine.add_request(req)
    silent = 0
    while not req.output_ids:
        silent += not engine.step()
    engine.run_until_done([req])
    assert silent == 61 // 8 and req.output_ids == whole.output_ids


def test_a_chunk_counts_its_prefix_unless_told_not_to():
    """--chunk-attention-tokens: a prompt token at position p counts 1 + p / it against the chunk budget, so the
    chunks shrink along a long prompt; 0 counts every token 1 (a chunk of --chunk-tokens at any depth). The
    tokens are the unchunked run's either way."""
    prompt = prompts_of_lengths(reference("tiny").tokenizer, [200])[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [whole] = make_engine("tiny", chunked_prefill=False).generate([prompt], params)
    silent = {}
    for attention in (0, 64):
        engine = make_engine("tiny", chunk_tokens=32, chunk_attention_tokens=attention)
        req = Request(f"attention-{attention}", prompt, params)
        engine.add_request(req)
        silent[attention] = 0
        while not req.output_ids:
            silent[attention] += not engine.step()
        engine.run_until_done([req])
        assert req.output_ids == whole.output_ids
    # 0: 32 tokens a step, 6 steps without a token then the last 8; 64: 32, 21, 17, 15, ... tokens a step
    assert silent[0] == 200 // 32 and silent[64] > silent[0] + 3


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_fused_projections_give_the_same_tokens_and_logits(name):
    """The CUDA engine's one-projection attention and one gate/up projection per MLP (fusion.py)
    compute what transformers' own forward does; checked here on the CPU in float32, with chunked
    prefill and decodes mixed."""
    from pdserve.workers.engine.fusion import fuse_gate_up, fuse_qkv

    prompts = prompts_of_lengths(reference(name).tokenizer, [5, 40, 23])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = make_engine(name, chunk_tokens=16)
    want = [Request(f"a{i}", p, params, return_logits=True) for i, p in enumerate(prompts)]
    want_logits = run_collect(plain, want)
    fused_engine = make_engine(name, chunk_tokens=16)
    layers = fused_engine.model.config.num_hidden_layers
    assert fuse_qkv(fused_engine.model) == layers and fuse_gate_up(fused_engine.model) == layers
    mlp = fused_engine.model.model.layers[0].mlp
    assert not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.out_features == 2 * mlp.down_proj.in_features
    got = [Request(f"a{i}", p, params, return_logits=True) for i, p in enumerate(prompts)]
    got_logits = run_collect(fused_engine, got)
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids
        diff = max((a - b).abs().max().item() for a, b in zip(want_logits[w.request_id], got_logits[g.request_id]))
        assert diff < 1e-4, diff


def test_piecewise_graphs_cover_short_steps_only_so_a_large_chunk_budget_starts_fast():
    # an 8192-token chunk budget (the CUDA default) sizes the piecewise path for a whole chunk and 64 decodes,
    # but a worker captures graphs (at start) only for steps of up to mixed_graph_tokens: 19 token buckets,
    # not the 130 up to 8256 (each bucket is L + 1 graphs); a longer step runs the same segments directly
    engine = make_engine("tiny", chunk_tokens=8192, max_num_seqs=64)
    mixed = engine.runner.mixed
    assert mixed.fits(8192 + 64, 64) and not mixed.fits(8192 + 65, 64)
    assert mixed.graph_buckets == []  # no CUDA graphs on the CPU
    mixed.use_graphs = True  # what a CUDA worker with the same config would capture
    assert mixed.graph_buckets == [16, 32, 64] + list(range(128, 1025, 64))
    assert len(mixed.buckets) > 100
