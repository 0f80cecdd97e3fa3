"""The OpenAI surface users bring, against the router with fake workers (no model): fields pdserve does
not implement are refused naming the field (their neutral values pass), `stream_options.include_usage`
as OpenAI sends it, driven by the official `openai` client where it matters."""

from __future__ import annotations

import openai
import pytest

from test_server_router import colocated_echo, router, sse_events, tokenizer  # noqa: F401  (a fixture)

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}

# (endpoint body, extra fields, param, words in the message)
REFUSED = [
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "tool calling"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice", "not supported"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", "plain text only"),
    (CHAT, {"logprobs": True}, "logprobs", "not supported"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "not supported"),
    (CHAT, {"n": 2}, "n", "`n` > 1 is not supported"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    (CHAT, {"repetition_penalty": 1.2}, "repetition_penalty", "not supported"),
    (CHAT, {"min_tokens": 4}, "min_tokens", "not supported"),
    (CHAT, {"min_p": 0.1}, "min_p", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name", "not supported"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options", "set `stream` to true"),
    (COMPLETION, {"logprobs": 0}, "logprobs", "not supported"),  # 0 asks for the chosen token's logprob
    (COMPLETION, {"echo": True}, "echo", "not supported"),
    (COMPLETION, {"frequency_penalty": -1.0}, "frequency_penalty", "not supported"),
    (COMPLETION, {"best_of": 3}, "best_of", "not supported"),
    (COMPLETION, {"logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
    (COMPLETION, {"stop_token_ids": [2]}, "stop_token_ids", "not supported"),
    (COMPLETION, {"frobnicate": 1}, "frobnicate", "not a field pdserve knows"),
    (COMPLETION, {"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x",
     "not a field pdserve knows"),
]
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "user": "u1",
           "response_format": {"type": "text"}, "top_logprobs": None, "min_tokens": 0, "repetition_penalty": 1.0}


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    with router(tokenizer) as c:
        c.add_worker("colocated", "c0", colocated_echo(3))
        yield c


@pytest.mark.parametrize("base,extra,param,words", REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_fields_are_refused_naming_the_field(client, base, extra, param, words):
    r = client.post(_path(base), json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and f"`{param}`" in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("base", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_neutral_values_of_unsupported_fields_change_nothing(client, base):
    plain = client.post(_path(base), json=base)
    extra = {**NEUTRAL, "logprobs": False if base is CHAT else None}
    neutral = client.post(_path(base), json={**base, **extra})
    assert plain.status_code == neutral.status_code == 200, neutral.text
    pick = (lambda b: b["choices"][0]["message"]["content"]) if base is CHAT else (lambda b: b["choices"][0]["text"])
    assert pick(neutral.json()) == pick(plain.json()) == "<100><101><102>"


def test_stream_without_include_usage_keeps_usage_on_the_last_choice(client):
    with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        events = sse_events(r)
    *chunks, last, done = events
    assert done == "[DONE]" and last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 3 and all("usage" not in c for c in chunks)


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_openai_client_refused_tools_is_a_bad_request(oai):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=CHAT["messages"], tools=tools)
    assert e.value.status_code == 400 and "`tools` is not supported" in str(e.value)
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_openai_client_include_usage_ends_with_a_usage_only_chunk(oai, tokenizer, kind):  # noqa: F811
    opts = dict(model="tiny", max_tokens=3, stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        chunks = list(oai.chat.completions.create(messages=CHAT["messages"], **opts))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(oai.completions.create(prompt="Hello there", **opts))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    *body, last = chunks
    assert text == "<100><101><102>"
    assert last.choices == [] and last.usage.completion_tokens == 3 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert body[-1].choices[0].finish_reason == "length"
    if kind == "completions":
        assert last.usage.prompt_tokens == len(tokenizer.encode("Hello there"))


def test_openai_client_plain_requests(oai):
    chat = oai.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3, n=1,
                                       presence_penalty=0)
    assert chat.choices[0].message.content == "<100><101><102>" and chat.usage.completion_tokens == 3
    done = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=3)
    assert done.choices[0].text == "<100><101><102>" and done.choices[0].finish_reason == "length"
