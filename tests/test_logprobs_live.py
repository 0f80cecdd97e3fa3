"""The sampling surface against a live pdserve (tiny model; a prefill, a decode and a colocated worker,
every process real), through the official `openai` client: logprobs, top_logprobs, echo with prompt
logprobs, n, penalties, min_tokens and stop_token_ids give the same tokens and the same logprobs on
both policies. Equal means bitwise here: float32 on the CPU runs the same kernels on the same tokens
either way (a disaggregated request's token 1 and prompt logprobs are computed by the prefill worker
exactly as the colocated worker computes them, and the decode worker continues from the same KV
bytes), and the JSON carries each float32 value exactly (its shortest repr)."""

from __future__ import annotations

import openai
import pytest


pytestmark = pytest.mark.timeout(400)

POLICIES = ("colocated", "disaggregated")
# Prompts no other test sends: the server is shared, and a prefix one worker cached from another module's
# request (and the other did not) is prefilled through other kernels on that worker alone, so the two
# policies' floats differ in their last bits (seen when test_client_shapes and test_logprobs ran first).
# A chat prompt shares its template's opening with every other chat request: test_chat_... sends it to
# both policies once before it compares, so both workers hold the same cached blocks of it.
PROMPT = "The capital of Portugal is"
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def srv(tiny_pdserve):
    return tiny_pdserve  # shared with the other request-only live tests (conftest.py)


@pytest.fixture(scope="module")
def oai(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def both(fn) -> dict:
    return {p: fn(p) for p in POLICIES}


def test_chat_logprobs_are_the_same_on_both_policies(oai):
    def ask(policy):
        r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3,
                                        extra_body={"policy": policy, "ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        return (c.message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                    for t in c.logprobs.content])
    both(ask)  # each policy's worker caches the prompt's full blocks: the compared requests reuse the same
    got = both(ask)
    assert got["colocated"] == got["disaggregated"]
    text, entries = got["colocated"]
    assert len(entries) == 6 and text
    for token, logprob, top in entries:
        assert len(top) == 3 and top[0] == (token, logprob)  # greedy: the chosen token is the likeliest
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True) and logprob <= 0


def test_streamed_logprobs_equal_the_whole_response(oai):
    def ask(policy, stream):
        opts = dict(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=2,
                    extra_body={"policy": policy, "ignore_eos": True})
        if not stream:
            lp = oai.completions.create(**opts).choices[0].logprobs
            return lp.tokens, lp.token_logprobs, lp.top_logprobs
        tokens, lps, tops = [], [], []
        for chunk in oai.completions.create(stream=True, **opts):
            lp = chunk.choices[0].logprobs
            tokens += lp.tokens
            lps += lp.token_logprobs
            tops += lp.top_logprobs
        return tokens, lps, tops
    answers = {(p, s): ask(p, s) for p in POLICIES for s in (False, True)}
    assert len({repr(a) for a in answers.values()}) == 1, answers


def test_echo_with_prompt_logprobs_on_both_policies(oai, srv):
    def ask(policy):
        c = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1, echo=True,
                                   extra_body={"policy": policy, "ignore_eos": True}).choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.logprobs.text_offset
    got = both(ask)
    assert got["colocated"] == got["disaggregated"]
    text, tokens, lps, tops, offsets = got["colocated"]
    n = srv.post("/tokenize", {"prompt": PROMPT}).json()["count"]
    assert text.startswith(PROMPT) and len(tokens) == n + 4
    assert lps[0] is None and tops[0] is None and all(lp is not None and lp <= 0 for lp in lps[1:])
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_n_choices_with_seeds_and_usage(oai):
    def ask(policy):
        r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=11, temperature=1.0,
                                   extra_body={"policy": policy, "ignore_eos": True})
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage
    got = both(ask)
    assert got["colocated"][0] == got["disaggregated"][0]
    texts, usage = got["colocated"]
    assert len(set(texts)) == 3  # seed + i: each choice its own draw
    one = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=12, temperature=1.0,
                                 extra_body={"ignore_eos": True, "policy": "colocated"})
    assert one.choices[0].text == texts[1]  # choice 1 is the request seeded 12
    assert usage.completion_tokens == 18 and usage.total_tokens == usage.prompt_tokens + 18
    assert usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once


def test_penalties_min_tokens_and_stop_token_ids_on_both_policies(oai):
    prompt = [(13 * i + 63) % 300 + 5 for i in range(6)]  # token ids whose greedy run repeats itself

    def ask(policy, **extra):
        c = oai.completions.create(model="tiny", prompt=prompt, max_tokens=40, logprobs=0,
                                   presence_penalty=extra.pop("presence_penalty", 0.0),
                                   frequency_penalty=extra.pop("frequency_penalty", 0.0),
                                   extra_body={"policy": policy, "return_token_ids": True, **extra}).choices[0]
        return c.model_extra["token_ids"], c.logprobs.token_logprobs, c.finish_reason
    plain = ask("colocated", ignore_eos=True)
    assert len(set(plain[0])) < len(plain[0])  # it repeats: the penalties have work to do
    penalized = both(lambda p: ask(p, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0,
                                   repetition_penalty=1.8))
    assert penalized["colocated"] == penalized["disaggregated"]
    assert penalized["colocated"][0] != plain[0] and len(set(penalized["colocated"][0])) > len(set(plain[0]))
    stop_at = plain[0][3]
    stopped = both(lambda p: ask(p, stop_token_ids=[stop_at], ignore_eos=True))
    assert stopped["colocated"] == stopped["disaggregated"]
    assert stopped["colocated"][0] == plain[0][:plain[0].index(stop_at) + 1] and stopped["colocated"][2] == "stop"
    held = both(lambda p: ask(p, stop_token_ids=[stop_at], min_tokens=8, ignore_eos=True))
    assert held["colocated"] == held["disaggregated"]
    ids = held["colocated"][0]
    assert len(ids) >= 8 and stop_at not in ids[:7]


def test_n_choices_reuse_the_prompt_kv_of_the_first(srv):
    """A prompt of two full blocks, n=3: choices 1 and 2 start once choice 0 prefilled, so each finds the
    prompt's 32 block-aligned tokens in the prefix cache of every worker that prefills or holds it."""
    import re
    import time

    def hits() -> dict:
        text = srv.get("/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r'^pdserve_prefix_cache_hits_total\{role="(\w+)",tier="device"'
                                                      r',worker="[^"]+"\} (\S+)$', text, re.M)}
    prompt = [(17 * i + 3) % 300 + 5 for i in range(40)]  # a prompt no other test sends
    for policy, roles in (("colocated", ("colocated",)), ("disaggregated", ("prefill", "decode"))):
        before = hits()
        r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "n": 3, "policy": policy,
                                         "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
        deadline = time.monotonic() + 10  # the counters come with the workers' heartbeats
        while any(hits().get(role, 0) - before.get(role, 0) < 64 for role in roles) and time.monotonic() < deadline:
            time.sleep(0.2)
        after = hits()
        assert all(after.get(role, 0) - before.get(role, 0) == 64 for role in roles), (policy, before, after)
