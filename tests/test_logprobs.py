"""Logprobs: each generated token's (and its top alternatives') from the raw logits, the prompt's from
the logits of every prompt position (computed only for requests that ask, in bounded slices), and a
disaggregated request's equal to a colocated one's, bitwise: token 1's and the prompt's come from the
prefill worker (PrefillDone), the rest from the decode worker, and on the CPU in float32 both run the
same kernels on the same tokens (the transferred KV is the same bytes), so nothing may differ."""

from __future__ import annotations

import pytest
import torch

from test_worker_roles import NUM_BLOCKS, Shell, engine, finished, pump, tokens_of
from pdserve.protocol import control as P
from pdserve.workers.engine import runner as runner_module
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.models import load_model
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.settings.worker import TransferConfig

pytestmark = pytest.mark.timeout(300)

PROMPT = [(13 * i + 7) % 300 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def reference():
    """transformers' own forward on the same weights (no paged attention), per model."""
    return {}


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


# Our engine against transformers' own forward is two different computations (paged attention over
# gathered blocks, in chunks, against one dense forward): float32 sums in another order. SmolLM2's
# logits reach ~35, where one float32 ulp is 3.8e-6; the logprobs differed by at most 2.3e-5 (~6 ulp)
# under ATEN_CPU_CAPABILITY native (AVX-512/AMX), avx2 and default, in every chunking (tiny: 2e-6).
# LOGPROB_ATOL is ~4x that; a wrong token, position or KV block moves a logprob by more than 0.1.
LOGPROB_ATOL = 1e-4
CHUNKINGS = {"chunk512": {}, "chunk7": {"chunk_tokens": 7}, "unchunked": {"chunked_prefill": False}}


@pytest.mark.parametrize("model,chunking", [("tiny", c) for c in CHUNKINGS] + [("smollm2-135m", "chunk7")])
def test_prompt_and_token_logprobs_match_transformers(reference, model, chunking, monkeypatch):
    monkeypatch.setattr(runner_module, "PROMPT_LOGPROB_ROWS", 5)  # slices shorter than a chunk, and ragged
    eng = Engine(EngineConfig(model=model, num_blocks=NUM_BLOCKS, **CHUNKINGS[chunking]))
    prompt = PROMPT if model == "tiny" else eng.text.encode_prompt("The capital of France is Paris, and the capital of "
                                                              "Italy is Rome. The capital of Spain is")
    req = Request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3),
                  return_logits=True)
    outs = list(eng.stream(req))
    ids = prompt + req.output_ids
    if model not in reference:
        reference[model] = load_model(model, "float32", "cpu").model
    ref = ref_logprobs(reference[model], ids)
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == len(prompt) - 1 and all(o.prompt_logprobs is None for o in outs[1:])
    got = torch.tensor([lp.logprob for lp in prompt_lps])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=LOGPROB_ATOL, rtol=0), (got - want).abs().max()
    for i, lp in enumerate(prompt_lps):
        top = ref[i].topk(3)
        assert len(lp.top_ids) == 3 and torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=LOGPROB_ATOL,
                                                       rtol=0)
    for o in outs:  # each token's logprobs are exactly its own logits' log_softmax
        lsm = torch.log_softmax(o.logits, -1)
        assert o.logprobs.logprob == lsm[o.token_id].item()
        top = lsm.topk(4)
        assert o.logprobs.top_ids == top.indices.tolist() and o.logprobs.top_logprobs == top.values.tolist()
        assert o.logprobs.top_ids[0] == o.token_id  # greedy: the chosen token is the most likely
    gen = ref[torch.arange(len(prompt) - 1, len(ids) - 1), torch.tensor(req.output_ids)]
    assert torch.allclose(torch.tensor([o.logprobs.logprob for o in outs]), gen, atol=LOGPROB_ATOL, rtol=0)


def test_prompt_logprobs_are_computed_once_and_skip_the_prefix_cache():
    eng = Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    [warm] = eng.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))  # caches the prompt's blocks
    [a] = eng.generate([PROMPT], params)
    [b] = eng.generate([PROMPT], params)
    assert a.cached_tokens == 0 and len(a.prompt_logprobs) == len(PROMPT) - 1
    assert [x.logprob for x in a.prompt_logprobs] == [x.logprob for x in b.prompt_logprobs]
    assert a.output_ids == b.output_ids == warm.output_ids
    assert all(x.top_ids == [] for x in a.prompt_logprobs)  # 0: the prompt token's own logprob only


def test_requests_without_logprobs_carry_none(reference):
    eng = Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))
    outs = list(eng.stream(Request("r", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)


# ---- disaggregated equals colocated ---------------------------------------------------------------

CASES = {
    "logprobs": P.Sampling(max_tokens=8, ignore_eos=True, logprobs=5),
    "echo": P.Sampling(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2),
    "penalties": P.Sampling(max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7,
                            repetition_penalty=1.4, logprobs=1),
    "seeded": P.Sampling(max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7,
                         frequency_penalty=1.0, logprobs=3),
    "min_tokens": P.Sampling(max_tokens=10, min_tokens=6, stop_token_ids=[7, 9], logprobs=0),
}


def run_colocated(sampling: P.Sampling, prompt: list[int]) -> list[P.TokenOut]:
    c = Shell("colocated", engine())
    c.role.handle(P.Generate("r", prompt, sampling))
    pump([c], lambda: finished(c, "r"))
    return tokens_of(c, "r")


def run_disaggregated(sampling: P.Sampling, prompt: list[int]) -> tuple[P.PrefillDone, list[P.TokenOut]]:
    cfg = TransferConfig(transport="ipc", mode="layer", deadline_s=10.0)
    d = Shell("decode", engine(shared=True), cfg)
    p = Shell("prefill", engine(), cfg)
    try:
        d.role.handle(P.Reserve("r", prompt, sampling, deadline_s=10.0))
        [reserved] = d.take(P.Reserved)
        p.role.handle(P.Prefill("r", prompt, sampling, d.worker_id, reserved.kv_address, reserved.dst_blocks, 8.0))
        pump([p, d], lambda: finished(d, "r"))
        pump([p, d], lambda: any(isinstance(m, P.PrefillDone) for m in p.sent))
        [done] = p.take(P.PrefillDone)
        return done, tokens_of(d, "r")
    finally:
        p.role.close(), d.role.close(), d.engine.kv.close()


@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_logprobs_equal_colocated(case):
    sampling = CASES[case]
    prompt = PROMPT[:21]
    col = run_colocated(sampling, prompt)
    done, dis = run_disaggregated(sampling, prompt)
    assert [o.token_id for o in dis] == [o.token_id for o in col], case
    assert dis[0].token_id == done.first_token and dis[0].logprobs is None  # token 1's came with PrefillDone
    assert done.first_logprobs == col[0].logprobs  # bitwise: msgspec structs compare every float exactly
    assert [o.logprobs for o in dis[1:]] == [o.logprobs for o in col[1:]]
    assert all(o.logprobs is not None and len(o.logprobs.top_ids) == sampling.logprobs for o in col)
    assert done.prompt_logprobs == col[0].prompt_logprobs
    if sampling.prompt_logprobs is not None:
        assert len(done.prompt_logprobs) == len(prompt) - 1
    assert [o.finish_reason for o in dis] == [o.finish_reason for o in col]
    if case == "min_tokens":
        assert len(col) >= 6 and not {7, 9} & {o.token_id for o in col[:5]}


def test_logprobs_travel_the_wire_within_bounds():
    lp = P.TokenLogprobs(-0.25, [3, 4], [-0.25, -9999.0])
    out = P.TokenOut("r", 3, "x", logprobs=lp, prompt_logprobs=[lp, lp])
    frame = P.from_worker("inc", P.Tokens("w", [out]))
    assert P.decode_to_router(frame).msg.outputs[0] == out
    with pytest.raises(P.ProtocolError):
        P.decode_to_router(P.from_worker("inc", P.Tokens("w", [P.TokenOut("r", 3, "x", logprobs=P.TokenLogprobs(
            0.5))])))  # a logprob above 0
    with pytest.raises(P.ProtocolError):
        P.decode_to_router(P.from_worker("inc", P.Tokens("w", [P.TokenOut("r", 3, "x", logprobs=P.TokenLogprobs(
            -1.0, list(range(21)), [-1.0] * 21))])))  # more than 20 alternatives


def test_a_request_recomputed_after_preemption_keeps_its_prompt_logprobs_once():
    eng = Engine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))
    req = Request("r", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1))
    outs = []
    for out in eng.stream(req):
        outs.append(out)
        if len(outs) == 2:  # preempt it mid-decode: it is recomputed from its prompt and tokens
            eng.scheduler._preempt(req)
    assert req.finish_reason == "length" and len(req.output_ids) == 6
    assert len(req.prompt_logprobs) == len(PROMPT) - 1  # not computed a second time
    [again] = eng.generate([PROMPT], req.params)
    assert again.output_ids == req.output_ids
    # a decode worker's request (token 1 came from the prefill worker, which made the prompt's logprobs):
    # recomputed after a preemption, it computes none
    adopted = Request("d", PROMPT, req.params, output_ids=[5])
    assert runner_module.prompt_positions(adopted, len(PROMPT)) == range(0)
    assert runner_module.prompt_positions(Request("p", PROMPT, req.params), 7) == range(0, 7)
    # after the preemption its positions were recomputed by a prefill forward, not decode steps: the
    # same tokens, logprobs within float32 rounding of the other kernel (not bitwise)
    plain = [o.logprobs.logprob for o in eng.stream(Request("r2", PROMPT, req.params))]
    assert torch.allclose(torch.tensor([o.logprobs.logprob for o in outs]), torch.tensor(plain), atol=1e-5, rtol=0)
