"""The official `openai` client against a live pdserve (tiny model, a prefill, a decode and a colocated
worker, every process real), on both policies: chat and completions, streamed and not, include_usage,
a refused `tools` request; greedy output is the same every way it is asked for."""

from __future__ import annotations

import openai
import pytest


pytestmark = pytest.mark.timeout(300)

POLICIES = ("colocated", "disaggregated")
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def srv(tiny_pdserve):
    return tiny_pdserve  # shared with the other request-only live tests (conftest.py)


@pytest.fixture(scope="module")
def oai(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _chat(oai, policy: str, stream: bool):
    opts = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body={"policy": policy,
                                                                                    "ignore_eos": True})
    if not stream:
        r = oai.chat.completions.create(**opts)
        return r.choices[0].message.content, r.usage
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **opts))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return "".join(c.choices[0].delta.content or "" for c in chunks[:-1]), chunks[-1].usage


def _completion(oai, policy: str, stream: bool):
    opts = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"policy": policy, "ignore_eos": True})
    if not stream:
        r = oai.completions.create(**opts)
        return r.choices[0].text, r.usage
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **opts))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage


@pytest.mark.parametrize("ask", [_chat, _completion], ids=["chat", "completions"])
def test_same_greedy_answer_on_both_policies_streamed_or_not(srv, oai, ask):
    answers = {(p, s): ask(oai, p, s) for p in POLICIES for s in (False, True)}
    texts = {text for text, _ in answers.values()}
    assert len(texts) == 1 and texts != {""}, answers
    usages = {(u.prompt_tokens, u.completion_tokens, u.total_tokens) for _, u in answers.values()}
    [(prompt_tokens, completion_tokens, total)] = usages
    assert completion_tokens == MAX_TOKENS and total == prompt_tokens + MAX_TOKENS
    # the same count /tokenize gives for what was sent
    body = {"messages": MESSAGES} if ask is _chat else {"prompt": PROMPT}
    assert srv.post("/tokenize", body).json()["count"] == prompt_tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_tools_are_refused_on_both_policies(oai, policy):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, extra_body={"policy": policy})
    assert e.value.body["param"] == "tools" and "not supported" in e.value.body["message"]


def test_pdserve_client_reads_include_usage_and_the_request_id(srv):
    from pdserve.client import Client, ServerError

    with Client(srv.url) as c:
        stream = c.stream_complete(PROMPT, policy="disaggregated", max_tokens=MAX_TOKENS, ignore_eos=True,
                                   extra={"stream_options": {"include_usage": True}})
        deltas = list(stream)
        done = stream.result
        assert sum(d.is_token for d in deltas) == MAX_TOKENS and done.usage.completion_tokens == MAX_TOKENS
        assert done.timings is not None and done.timings.policy == "disaggregated"
        assert done.text == _completion_text(c)
        with pytest.raises(ServerError) as e:  # refused after the request got its id: the header names it
            c.complete("x" * 20, max_tokens=10**6)
        assert e.value.status == 400 and e.value.request_id.startswith("cmpl-")


def _completion_text(c) -> str:
    return c.complete(PROMPT, policy="colocated", max_tokens=MAX_TOKENS, ignore_eos=True).text
