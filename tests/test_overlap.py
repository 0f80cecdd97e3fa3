"""Overlapped steps (workers/engine/overlap.py) on the CPU: the same tokens as synchronous steps,
the same finish reasons, and no block given back while a step in flight may still write into it.

A step's arithmetic is not always the same on both paths. A request that stops at step N (a stop
token or string, found when step N is read back) already has a row in step N+1 when overlapped:
that step has one row more than its synchronous twin, and the rows after it sit one place later.
On the CPU that changes other rows' last bits: MKL's sgemm runs a row through one kernel or another
by the row count, the thread split and the row's place in its thread's share (measured, 2 threads:
at 5-11 rows the last rows % 4 of each thread's share take another kernel than groups of four),
and the decode rows' attention is one SDPA padded to the step's longest context (masked when
lengths differ), whose sums over keys run in another order at another padded length. The last-bit
differences then live on in the KV those rows wrote. So tokens, finish reasons, texts and the top
logprob ids are compared exactly everywhere; logprob values exactly where the arithmetic is the
same by construction: every step a request was in, up to the token, had the same rows on both paths
(`steps_alike`)."""

from __future__ import annotations

import pytest

from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.overlap import PENDING
from pdserve.workers.engine.request import Request, SamplingParams, Status


def engine(overlap: bool, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=96, chunk_tokens=8, overlap=overlap, **kw))


def workload(stop_token: int | None) -> list[Request]:
    lengths = [5, 16, 23, 1, 40, 9]
    reqs = []
    for i, n in enumerate(lengths):
        params = SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True,
                                stop_token_ids=[stop_token] if stop_token is not None and i % 2 else [])
        reqs.append(Request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(n)], params))
    return reqs


def run(e: Engine, reqs: list[Request], abort_at: int | None = None) -> dict[str, tuple]:
    streamed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        e.add_request(r)
    steps = 0
    while e.has_work():
        for out in e.step():
            assert out.token_id != PENDING
            if out.token_id >= 0:
                streamed[out.request_id].append(out.token_id)
        steps += 1
        if steps == abort_at:
            e.abort("r4")
    assert e.blocks.num_free == e.blocks.num_blocks  # every block back, none twice
    return {r.request_id: (r.output_ids, r.finish_reason, streamed[r.request_id]) for r in reqs}


@pytest.mark.parametrize("chunked", [True, False])
def test_overlapped_steps_give_the_synchronous_tokens(chunked):
    plain = run(engine(False, chunked_prefill=chunked), workload(None))
    # a stop token that some requests meet part way (taken from the plain run's own output)
    stop = plain["r1"][0][2]
    want = run(engine(False, chunked_prefill=chunked), workload(stop))
    got = run(engine(True, chunked_prefill=chunked), workload(stop))
    assert got == want
    assert any(reason == "stop" for _, reason, _ in want.values())  # the stop path ran
    for ids, _, streamed in got.values():
        assert streamed == ids and PENDING not in ids


def test_an_abort_between_overlapped_steps_frees_its_blocks_after_the_step_in_flight():
    e = engine(True)
    reqs = workload(None)
    for r in reqs:
        e.add_request(r)
    while not reqs[4].output_ids or reqs[4].status is not Status.RUNNING:
        e.step()
    assert e._inflight is not None and id(reqs[4]) in e._inflight.members
    free_before = e.blocks.num_free
    held = len(reqs[4].block_ids)
    e.abort("r4")
    assert reqs[4].finished and PENDING not in reqs[4].output_ids
    assert e.blocks.num_free == free_before  # the step in flight may still write into them
    e.step()  # reads that step back
    assert e.blocks.num_free >= free_before + held - len(e.scheduler.running)  # now they are free (some re-used)
    while e.has_work():
        e.step()
    assert e.blocks.num_free == e.blocks.num_blocks


def test_overlap_stops_for_a_request_that_needs_its_logits():
    e = engine(True)
    a = Request("plain", list(range(3, 20)), SamplingParams(max_tokens=6, ignore_eos=True))
    b = Request("logprobs", list(range(5, 30)), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    got = run(e, [a, b])
    ref = run(engine(False), [Request("plain", list(range(3, 20)), SamplingParams(max_tokens=6, ignore_eos=True)),
                              Request("logprobs", list(range(5, 30)), SamplingParams(max_tokens=6, ignore_eos=True,
                                                                                     logprobs=2))])
    assert got == ref


# ---- every request overlaps: sampled, seeded, penalized, masked, with logprobs and stop strings ------

SAMPLED = [dict(temperature=0.8, seed=1, top_p=0.9),
           dict(temperature=1.2, seed=2, top_k=40, min_p=0.02, logprobs=3),
           dict(temperature=0.7, seed=3, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                logprobs=0),
           dict(temperature=0.9, seed=4, logit_bias={11: 4.0, 12: -50.0}, min_tokens=5),
           dict(logprobs=2),  # greedy, with logprobs
           dict(temperature=1.0, seed=5, allowed_token_ids=list(range(100, 4000)))]


def sampled_workload(stop: str | None = None, bad: list[int] | None = None) -> list[Request]:
    reqs = []
    for i, (n, kw) in enumerate(zip([5, 16, 23, 3, 40, 9], SAMPLED)):
        extra = dict(stop=[stop] if stop is not None and i % 2 else [], bad_words_ids=[bad] if bad and i == 4 else [])
        params = SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **kw, **extra)
        reqs.append(Request(f"s{i}", [(11 * i + j) % 700 + 3 for j in range(n)], params))
    return reqs


def run_sampled(e: Engine, reqs: list[Request]) -> tuple[dict[str, tuple], int, list[tuple]]:
    """Each request's tokens, finish reason, text, and streamed tokens and logprobs; how many steps
    left a step in flight holding a request that draws or asks for more than its top token; and each
    forward's rows: (request id, first position, tokens, whether it picks a token), in row order."""
    streamed = {r.request_id: [] for r in reqs}
    rows = record_rows(e)
    for r in reqs:
        e.add_request(r)
    overlapped = 0
    while e.has_work():
        for out in e.step():
            assert out.token_id != PENDING and out.error is None, out.error
            streamed[out.request_id].append((out.token_id, out.logprobs))
        step = e._inflight
        overlapped += step is not None and any(not r.params.greedy or r.params.logprobs is not None
                                               for r in step.done)
    assert e.blocks.num_free == e.blocks.num_blocks
    results = {r.request_id: (r.output_ids, r.finish_reason, r.text, streamed[r.request_id]) for r in reqs}
    return results, overlapped, rows


def record_rows(e: Engine) -> list[tuple]:
    rows: list[tuple] = []
    run = e.runner.run

    def recorded(work, on_layer=None, feed=None):
        rows.append(tuple((r.request_id, r.num_computed, n, r.num_computed + n == r.num_tokens) for r, n in work))
        return run(work, on_layer, feed)

    e.runner.run = recorded
    return rows


def steps_alike(a: list[tuple], b: list[tuple], request_id: str) -> int:
    """How many of the request's first tokens came from steps that, each up to that token's, had the
    same rows in the same order in both runs: the same products over the same rows, the same
    attention. The workload's prompts share no block, so a request reads only the KV its own steps
    wrote."""
    mine = [[s for s in steps if any(row[0] == request_id for row in s)] for steps in (a, b)]
    tokens = 0
    for sa, sb in zip(*mine):
        if sa != sb:
            break
        tokens += next(row[3] for row in sa if row[0] == request_id)
    return tokens


@pytest.mark.parametrize("chunked", [True, False])
def test_sampled_overlapped_steps_give_the_synchronous_tokens_for_the_same_seeds(chunked):
    """Seeds, penalties, masks, a bad word and logprobs, no stop: the same rows in every step on both
    paths, so the same arithmetic, and every token and logprob to the last bit."""
    plain, _, _ = run_sampled(engine(False, chunked_prefill=chunked), sampled_workload())
    s4 = plain["s4"][0]
    bad = [s4[2], s4[3]]  # s4 (greedy) makes it unless banned: banned while s4[2] is still on the device
    want, steps, want_rows = run_sampled(engine(False, chunked_prefill=chunked), sampled_workload(bad=bad))
    got, overlapped, got_rows = run_sampled(engine(True, chunked_prefill=chunked), sampled_workload(bad=bad))
    assert got_rows == want_rows
    assert got == want
    assert steps == 0 and overlapped >= 5  # the synchronous engine holds no step in flight; this one did
    assert want["s4"][0][:3] == s4[:3] and want["s4"][0][3] != s4[3]  # the bad word ran
    for ids, _, _, streamed in got.values():
        assert [t for t, _ in streamed] == ids
    lps = [lp for _, lp in got["s1"][3]]
    assert all(lp is not None and len(lp.top_ids) == 3 for lp in lps)


@pytest.mark.parametrize("chunked", [True, False])
def test_sampled_overlapped_steps_with_stop_strings_give_the_synchronous_tokens(chunked):
    """A request that meets its stop string has a row in the next overlapped step, and only there do
    the two paths' steps differ: tokens, texts and top logprob ids the same everywhere, logprob
    values to the last bit while a request's steps had the same rows."""
    plain, _, _ = run_sampled(engine(False, chunked_prefill=chunked), sampled_workload())
    s1 = plain["s1"][0]
    stop = plain["s1"][2][3:6]  # met part way by s1 (and maybe others)
    want, _, want_rows = run_sampled(engine(False, chunked_prefill=chunked), sampled_workload(stop))
    got, overlapped, got_rows = run_sampled(engine(True, chunked_prefill=chunked), sampled_workload(stop))
    assert want["s1"][1] == "stop" and len(want["s1"][0]) < len(s1)  # the stop string ran
    assert overlapped >= 5
    # the overlapped steps are the synchronous ones plus rows past a request's last token
    last = {}
    for step in want_rows:
        for rid, pos, _, _ in step:
            last[rid] = max(last.get(rid, 0), pos)
    live = [tuple(row for row in step if row[1] <= last[row[0]]) for step in got_rows]
    assert [step for step in live if step] == want_rows and live != got_rows
    compared = 0
    for rid, (ids, reason, text, streamed) in want.items():
        assert (got[rid][0], got[rid][1], got[rid][2]) == (ids, reason, text), rid
        assert [(t, lp and lp.top_ids) for t, lp in got[rid][3]] == [(t, lp and lp.top_ids) for t, lp in streamed]
        alike = steps_alike(want_rows, got_rows, rid)
        assert got[rid][3][:alike] == streamed[:alike], rid  # logprob values, to the last bit
        compared += alike
    assert compared >= 6


def test_a_tiered_worker_takes_the_overlapped_path_and_gives_the_same_tokens():
    """A host tier below the pool: a prefix evicted from the pool comes back from host memory while
    sampled requests run overlapped, with the tokens of the same engine run synchronously."""
    base = [(29 * j) % 997 + 5 for j in range(70)]
    outcomes = {}
    for on in (False, True):
        e = Engine(EngineConfig(model="tiny", num_blocks=24, host_cache_gb=0.001, chunk_tokens=32, overlap=on))
        assert e.tiers is not None and e.overlap is on
        e.generate([base], SamplingParams(max_tokens=3, ignore_eos=True))
        for i in range(30):  # other prompts through the pool until the base's first block left it
            if not e.blocks.match(names_of(e, base)[:1]):
                break
            e.generate([[(i * 31 + j) % 900 + 7 for j in range(83)]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert not e.blocks.match(names_of(e, base)[:1])
        e.tiers.host.flush()
        reqs = [Request("again", base + [11, 12], SamplingParams(max_tokens=8, temperature=0.9, seed=7, top_p=0.95,
                                                                 logprobs=1, ignore_eos=True)),
                Request("beside", [(13 * j) % 500 + 3 for j in range(20)],
                        SamplingParams(max_tokens=10, temperature=1.1, seed=8, frequency_penalty=0.4, ignore_eos=True))]
        got, overlapped, _ = run_sampled(e, reqs)
        assert reqs[0].tier_tokens == {"host": 64}, reqs[0].tier_tokens  # it came back from host memory
        assert overlapped == 0 if not on else overlapped >= 5
        outcomes[on] = got
        e.close()
    assert outcomes[True] == outcomes[False]  # no stop: every step has the same rows, so logprobs too


def names_of(e: Engine, tokens: list[int]) -> list[bytes]:
    from pdserve.workers.engine.prefix_cache import extend_names

    return extend_names([], tokens[:len(tokens) // 16 * 16], 16, e.prefix_root)
