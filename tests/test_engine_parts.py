"""The engine's parts, each entered in one place: a prompt's blocks are taken by PromptBlocks.take
alone (the scheduler's admission, prefill_only and reserve alike), and the handoff is given only
the engine's record of its requests (handoff.Record)."""

from __future__ import annotations

import pytest

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.handoff import KVHandoff, Record
from pdserve.workers.engine.request import InvalidRequest, Request, SamplingParams, Status

PROMPT = list(range(5, 5 + 40))  # 2 full blocks of 16 and 8 tokens


def tiny(**kw) -> Engine:
    cfg = dict(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=64)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def watch_taking(engine: Engine, monkeypatch) -> list[tuple[str, list[int]]]:
    """Record each PromptBlocks.take (request id, its blocks after); the prefix cache's allocate and
    acquire raise when called outside it, but for a running request's next block (grow_running)."""
    taken, inside = [], []
    take, allocate, acquire = engine.prompts.take, engine.blocks.allocate, engine.blocks.acquire

    def watched_take(req, claim, wait=False):
        inside.append(True)
        try:
            take(req, claim, wait)
        finally:
            inside.pop()
        taken.append((req.request_id, list(req.block_ids)))

    def only_inside(fn):
        def call(*args):
            assert inside, f"blocks taken outside PromptBlocks.take: {fn.__name__}{args}"
            return fn(*args)
        return call

    monkeypatch.setattr(engine.prompts, "take", watched_take)
    monkeypatch.setattr(engine.blocks, "allocate", only_inside(allocate))
    monkeypatch.setattr(engine.blocks, "acquire", only_inside(acquire))
    return taken


@pytest.mark.parametrize("chunked", [True, False])
def test_every_path_takes_a_prompts_blocks_through_prompt_blocks_take(monkeypatch, chunked):
    engine = tiny(chunked_prefill=chunked)
    taken = watch_taking(engine, monkeypatch)
    params = SamplingParams(max_tokens=20, ignore_eos=True)  # 40 + 20 tokens: grows a 4th block
    [first] = engine.generate([PROMPT], params)
    # the scheduler's admission; a prompt that begins the same way shares the first one's cached blocks
    [second] = engine.generate([PROMPT[:32] + [99] * 8], params)
    assert [rid for rid, _ in taken] == [first.request_id, second.request_id]
    assert taken[1][1][:2] == taken[0][1][:2] and second.cached_tokens == 32

    sent = Request("pf", PROMPT, SamplingParams(max_tokens=1))
    result = engine.prefill_only(sent)  # a prefill worker's
    assert taken[-1] == ("pf", result.block_ids) and sent.cached_tokens == 32
    engine.release("pf")

    blocks = engine.reserve("bare", 40)  # a decode worker's, by id alone
    assert taken[-1] == ("bare", blocks) and len(blocks) == 3
    engine.release("bare")
    held = Request("held", PROMPT, SamplingParams(max_tokens=2))
    engine.admit(held)
    blocks = engine.reserve("held", len(PROMPT))  # and for a request it knows: the cached prefix shared
    assert taken[-1] == ("held", blocks) and blocks[:2] == taken[0][1][:2] and held.cached_tokens == 32
    engine.release("held")
    assert len(taken) == 5
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.requests


class RecordOnly:
    """The engine seen through handoff.Record alone: anything else it is asked for fails the test."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.requests = engine.requests

    def __getattr__(self, name):
        if name not in {n for n in dir(Record) if not n.startswith("_")} | set(Record.__annotations__):
            raise AssertionError(f"the handoff asked the engine for {name}, which Record does not give")
        return getattr(self._engine, name)


def test_the_handoff_is_given_only_the_engines_record():
    engine = tiny()
    engine.handoff = KVHandoff(RecordOnly(engine), engine.prompts, engine.runner, engine.sampler,
                               engine.scheduler, engine.vocab_size)
    sent = Request("pf", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    result = engine.prefill_only(sent)
    assert sent.status is Status.SENDING
    engine.release("pf")
    blocks = engine.reserve("dec", len(PROMPT))
    engine.begin_receiving("dec")
    engine.kv.pool[:, blocks] = 0  # what a transfer would write is beside the point here
    req = Request("dec", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    out = engine.adopt(req, result.first_token)
    assert out.token_id == result.first_token and req.status is Status.RUNNING
    engine.run_until_done([req])
    assert len(req.output_ids) == 3
    assert engine.reserve("bad", len(PROMPT)) is not None
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):  # failed through Record.fail
        engine.adopt(Request("bad", PROMPT, SamplingParams(max_tokens=2)), engine.vocab_size)
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks


def test_every_forward_runs_inside_one_attention_context_unset_after(monkeypatch):
    """The piecewise path (the CPU's every step) and the eager one (prompt logprobs) each enter
    attention.stepping once per forward; after a forward, one that raises too, no step is set."""
    from pdserve.workers.engine import attention

    engine = tiny()
    assert engine.runner.mixed is not None and engine.runner.graphs is None
    entered, runs = [], []
    stepping, run = attention.stepping, engine.runner.run

    def counted(state):
        entered.append(state)
        return stepping(state)

    def counted_run(work, *args, **kw):
        runs.append(len(work))
        return run(work, *args, **kw)

    monkeypatch.setattr(attention, "stepping", counted)
    monkeypatch.setattr(engine.runner, "run", counted_run)
    piecewise = Request("pw", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    eager = Request("eager", PROMPT[::-1], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    engine.add_request(piecewise)
    engine.add_request(eager)
    engine.run_until_done([piecewise, eager])
    assert len(eager.prompt_logprobs) == len(PROMPT) - 1  # its step ran eagerly, asked for them
    assert len(entered) == len(runs) >= 4 and attention.CURRENT.state is None
    assert all(s.pool is engine.kv.pool for s in entered)

    seen = []
    layer = engine.model.model.layers[0].mlp

    def broken(*args, **kw):
        seen.append(attention.CURRENT.state)
        raise RuntimeError("a forward that raises")

    monkeypatch.setattr(layer, "forward", broken)
    failing = Request("fails", PROMPT, SamplingParams(max_tokens=2))
    engine.add_request(failing)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"] and "a forward that raises" in outs[0].error
    assert seen and seen[0] is entered[-1]  # it raised inside the step's context
    assert attention.CURRENT.state is None  # and the context is unset all the same
    with pytest.raises(RuntimeError, match="outside attention.stepping"):
        attention.paged_attention(engine.model.model.layers[0].self_attn, None, None, None, None)


def test_cuda_engines_keep_cudnn_attention_out_of_their_sdpa_calls(monkeypatch):
    """cuDNN attention builds a graph per new prompt length on the host (attention.py's docstring): on CUDA the
    runner turns it off for the process, on the CPU it leaves torch's settings alone."""
    import torch

    from pdserve.workers.engine import attention

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    assert attention.steady_sdpa(torch.device("cuda", 0)) is True and calls == [False]
    assert attention.steady_sdpa(torch.device("cpu")) is False and calls == [False]
    seen = []
    monkeypatch.setattr(attention, "steady_sdpa", lambda device: seen.append(device))
    tiny()
    assert seen == [torch.device("cpu")]  # every runner asks, with its own device
