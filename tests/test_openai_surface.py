"""The OpenAI and vLLM surface users bring, against the router with fake workers (no model): fields
pdserve does not implement are refused naming the field (their neutral values pass),
`stream_options.include_usage` as OpenAI sends it, vLLM's /tokenize, /detokenize, /version and
/v1/models/{id}, `x-request-id` on responses, /openapi.json documenting the bodies, the API key on every
route but /health; driven by the official `openai` client where it matters."""

from __future__ import annotations

import importlib.metadata
import json
import time

import openai
import pytest

from test_server_router import colocated_echo, router, sse_events, tokenizer  # noqa: F401  (a fixture)
from pdserve.protocol import control as P

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}

# (endpoint body, extra fields, param, words in the message)
REFUSED = [
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "tool calling"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice", "not supported"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", "plain text only"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "needs `logprobs: true`"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    (CHAT, {"echo": True}, "echo", "not supported"),  # a completions field
    (CHAT, {"n": 0}, "n", "between 1 and 16"),
    (CHAT, {"n": 17}, "n", "between 1 and 16"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty", "in (0, 2]"),
    (CHAT, {"temperature": 2.5}, "temperature", "in [0, 2]"),
    (CHAT, {"min_tokens": 4}, "min_tokens", "must not exceed `max_tokens` (3)"),
    (CHAT, {"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
    (CHAT, {"min_p": 1.5}, "min_p", "in [0, 1]"),
    (CHAT, {"guided_regex": "a+"}, "guided_regex", "guided decoding"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name", "not supported"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options", "set `stream` to true"),
    (COMPLETION, {"logprobs": 6}, "logprobs", "between 0 and 5"),
    (COMPLETION, {"logprobs": True}, "logprobs", "valid integer"),
    (COMPLETION, {"top_logprobs": 2}, "top_logprobs", "not supported"),  # a chat field
    (COMPLETION, {"frequency_penalty": -2.01}, "frequency_penalty", "in [-2, 2]"),
    (COMPLETION, {"stop_token_ids": [-1]}, "stop_token_ids", "each in [0, "),
    (COMPLETION, {"best_of": 3}, "best_of", "not supported"),
    (COMPLETION, {"logit_bias": {"the": -100}}, "logit_bias", "token ids"),
    (COMPLETION, {"frobnicate": 1}, "frobnicate", "not a field pdserve knows"),
    (COMPLETION, {"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x",
     "not a field pdserve knows"),
]
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "user": "u1",
           "response_format": {"type": "text"}, "top_logprobs": None, "min_tokens": 0, "repetition_penalty": 1.0,
           "best_of": 1, "min_p": 0}


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    with router(tokenizer) as c:
        c.worker = c.add_worker("colocated", "c0", colocated_echo(3))
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
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client, max_retries=0)


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


# ---- vLLM's utility endpoints ------------------------------------------------------------------------


def test_tokenize_gives_the_ids_a_request_would_send(client, tokenizer):  # noqa: F811
    r = client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello there")
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    # a chat through the template: the very ids a chat request hands its worker
    r = client.post("/tokenize", json={"messages": CHAT["messages"]})
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    sent = client.worker.got(P.Generate)[-1].prompt_ids
    assert r.json()["tokens"] == sent and r.json()["count"] == len(sent) and r.json()["token_strs"] is None
    bare = client.post("/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": False}).json()
    assert sent[:bare["count"]] == bare["tokens"] and bare["count"] < len(sent)


@pytest.mark.parametrize("body,param", [({}, "messages"), ({"prompt": "a", "messages": CHAT["messages"]}, "prompt"),
                                        ({"prompt": "a", "model": "gpt-4"}, "model"), ({"prompt": 5}, "prompt"),
                                        ({"prompt": "a", "n": 2}, "n"), ({"prompt": "a", "xyz": 1}, "xyz")])
def test_tokenize_refuses_bad_bodies_naming_the_field(client, body, param):
    r = client.post("/tokenize", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(client, tokenizer):  # noqa: F811
    ids = tokenizer.encode("Hello there, friend")
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello there, friend"}, r.text
    r = client.post("/detokenize", json={"tokens": [len(tokenizer) + 5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "vocabulary" in r.text
    r = client.post("/detokenize", json={"tokens": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0", r.text


def test_version_and_one_model(client, oai):
    assert client.get("/version").json() == {"version": importlib.metadata.version("pdserve")}
    card = oai.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "pdserve"
    assert client.get("/v1/models/tiny").json()["max_model_len"] == 64
    r = client.get("/v1/models/org/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "'tiny'" in r.text


# ---- x-request-id ----------------------------------------------------------------------------------


def test_x_request_id_is_echoed_or_is_the_body_id(client):
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    r = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42" and r.json()["id"] != "trace-42"
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                       headers={"x-request-id": "trace-43"}) as r:
        events = sse_events(r)
        assert r.headers["x-request-id"] == "trace-43" and events[-1] == "[DONE]"
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        events = sse_events(r)
        assert r.headers["x-request-id"] == events[0]["id"]
    r = client.post("/v1/completions", json={"prompt": "hi", "tools": [1]}, headers={"x-request-id": "trace-44"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-44"
    r = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


# ---- /openapi.json ---------------------------------------------------------------------------------


def _refs(node) -> set[str]:
    if isinstance(node, dict):
        return ({node["$ref"]} if "$ref" in node else set()) | {r for v in node.values() for r in _refs(v)}
    if isinstance(node, list):
        return {r for v in node for r in _refs(v)}
    return set()


def test_openapi_documents_every_request_body(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    bodies = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest",
              "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
    for path, name in bodies.items():
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{name}"} and schemas[name]["title"] == name
        assert schemas[name]["additionalProperties"] is False  # unknown fields are refused
    assert {"policy", "ignore_eos", "return_token_ids", "top_k", "stream_options"} <= set(
        schemas["CompletionRequest"]["properties"])
    assert "disaggregated" in schemas["ChatRequest"]["properties"]["policy"]["description"]
    assert schemas["ChatRequest"]["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert not {"tools", "response_format", "echo"} & set(schemas["ChatRequest"]["properties"])
    sampling = {"n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "stop_token_ids"}
    assert sampling | {"top_logprobs"} <= set(schemas["ChatRequest"]["properties"])
    assert sampling | {"echo"} <= set(schemas["CompletionRequest"]["properties"])
    for ref in _refs(doc):  # every reference resolves
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    assert {"/v1/models/{model_id}", "/version"} <= set(doc["paths"])
    json.dumps(doc)


# ---- the API key -----------------------------------------------------------------------------------

KEY = "k3y-" + "0123456789abcdef" * 2
PROBES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": {"prompt": "a"},
          "/detokenize": {"tokens": [1]}}


def _routes(app) -> list[tuple[str, str]]:
    return [(m, r.path.replace("{model_id:path}", "tiny")) for r in app.routes for m in getattr(r, "methods", ())
            if m != "HEAD"]


@pytest.mark.parametrize("public_metrics", [False, True])
def test_the_api_key_guards_every_route_but_health(tokenizer, public_metrics):  # noqa: F811
    with router(tokenizer, api_key=KEY, public_metrics=public_metrics) as c:
        c.add_worker("colocated", "c0", colocated_echo(1))
        routes = _routes(c.app)
        assert len(routes) >= 10 and ("GET", "/openapi.json") in routes
        for method, path in routes:
            kw = {"json": PROBES.get(path, {})} if method == "POST" else {}
            bare = c.request(method, path, **kw)
            held = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kw)
            assert held.status_code == 200, (method, path, held.text)
            open_route = path == "/health" or (path == "/metrics" and public_metrics)
            assert bare.status_code == (200 if open_route else 401), (method, path, bare.text)


# ---- the sampling surface: n, logprobs, echo (fake workers: the router's part) ----------------------


def logprob_worker(n_tokens: int = 3):
    """Colocated: tokens 100.., each with logprobs when asked (logprob -(i+1)/4, alternatives 7, 8, ...), the
    prompt's with token 1 when asked."""
    def on_message(w, msg):
        if not isinstance(msg, P.Generate):
            return
        s, rid = msg.sampling, msg.request_id
        timeline = P.Timeline({"prefill_start": 1.0, "prefill_end": 1.001}, cached_tokens=2)
        outs = []
        for i in range(n_tokens):
            last = i == n_tokens - 1
            k = s.logprobs
            lp = None if k is None else P.TokenLogprobs(-(i + 1) / 4, [100 + i, 7, 8][:k], [-(i + 1) / 4, -2.0, -3.0][:k])
            plp = None
            if i == 0 and s.prompt_logprobs is not None:
                plp = [P.TokenLogprobs(-1.0 - j, [9][:s.prompt_logprobs], [-0.5][:s.prompt_logprobs])
                       for j in range(len(msg.prompt_ids) - 1)]
            outs.append(P.TokenOut(rid, 100 + i, f"<{i}>", last, "length" if last else None,
                                   timeline if last else None, lp, plp))
        w.send(P.Tokens(w.worker_id, outs))
    return on_message


@pytest.fixture(scope="module")
def lp_client(tokenizer):  # noqa: F811
    with router(tokenizer) as c:
        c.worker = c.add_worker("colocated", "c0", logprob_worker(3))
        yield c


def test_n_fans_out_to_one_worker_with_seed_plus_i(lp_client, tokenizer):  # noqa: F811
    before = len(lp_client.worker.got(P.Generate))
    r = lp_client.post("/v1/completions", json={**COMPLETION, "n": 3, "seed": 5, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    gens = lp_client.worker.got(P.Generate)[before:]
    assert sorted(g.request_id for g in gens) == [f"{body['id']}-{i}" for i in range(3)]
    assert sorted(g.sampling.seed for g in gens) == [5, 6, 7]  # choice i: seed + i
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "<0><1><2>" and c["token_ids"] == [100, 101, 102] for c in body["choices"])
    prompt_tokens = len(tokenizer.encode(COMPLETION["prompt"]))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 9, "total_tokens": prompt_tokens + 9,
                             "prompt_tokens_details": {"cached_tokens": 2}}  # the prompt's, counted once


def test_n_streams_every_choice_by_index_and_sums_the_usage(lp_client):
    with lp_client.stream("POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True,
                                                                  "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["delta"]["content"] for c in mine) == "<0><1><2>"
        assert mine[0]["delta"]["role"] == "assistant" and "role" not in mine[1]["delta"]
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 2} and usage["timings"]["cached_tokens"] == 2
    assert all(c["usage"] is None for c in chunks)


def test_chat_logprobs_in_openai_format(lp_client, tokenizer):  # noqa: F811
    body = lp_client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    [gen] = [g for g in lp_client.worker.got(P.Generate) if g.request_id == body["id"]]
    assert (gen.sampling.logprobs, gen.sampling.prompt_logprobs) == (2, None)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5, -0.75]
    first = content[0]
    text = tokenizer.decode([100])
    assert first["token"] == text and first["bytes"] == list(text.encode())
    assert first["top_logprobs"] == [{"token": text, "logprob": -0.25, "bytes": list(text.encode())},
                                     {"token": tokenizer.decode([7]), "logprob": -2.0,
                                      "bytes": list(tokenizer.decode([7]).encode())}]
    plain = lp_client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
    assert all(c["top_logprobs"] == [] for c in plain["choices"][0]["logprobs"]["content"])
    assert lp_client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_with_echo_in_the_legacy_format(lp_client, tokenizer):  # noqa: F811
    body = lp_client.post("/v1/completions", json={**COMPLETION, "logprobs": 1, "echo": True}).json()
    [gen] = [g for g in lp_client.worker.got(P.Generate) if g.request_id == body["id"]]
    assert (gen.sampling.logprobs, gen.sampling.prompt_logprobs) == (1, 1)
    choice = body["choices"][0]
    assert choice["text"] == COMPLETION["prompt"] + "<0><1><2>"
    lps = choice["logprobs"]
    prompt_ids = tokenizer.encode(COMPLETION["prompt"])
    n = len(prompt_ids)
    texts = [tokenizer.decode([t]) for t in prompt_ids + [100, 101, 102]]
    assert lps["tokens"] == texts
    assert lps["token_logprobs"] == [None] + [-1.0 - j for j in range(n - 1)] + [-0.25, -0.5, -0.75]
    assert lps["top_logprobs"][0] is None and lps["top_logprobs"][1] == {tokenizer.decode([9]): -0.5,
                                                                         texts[1]: -1.0}
    assert lps["top_logprobs"][n] == {texts[n]: -0.25}  # the chosen token is the top one here
    assert lps["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == n
    echoed = lp_client.post("/v1/completions", json={**COMPLETION, "echo": True}).json()["choices"][0]
    assert echoed["text"] == COMPLETION["prompt"] + "<0><1><2>" and echoed["logprobs"] is None


def test_streamed_completion_logprobs_come_with_each_token(lp_client):
    with lp_client.stream("POST", "/v1/completions", json={**COMPLETION, "logprobs": 0, "stream": True}) as r:
        events = sse_events(r)[:-1]
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert [p["token_logprobs"] for p in parts] == [[-0.25], [-0.5], [-0.75]]
    assert [p["text_offset"][0] for p in parts] == [0, len(parts[0]["tokens"][0]),
                                                   len(parts[0]["tokens"][0]) + len(parts[1]["tokens"][0])]


def test_disaggregated_token_1_logprobs_come_from_the_prefill_report(tokenizer):  # noqa: F811
    """D emits token 1 before P's report lands: the router holds it for the report, whose logprobs it takes."""
    lp1 = P.TokenLogprobs(-0.125, [42], [-0.125])
    prompt_lps = [P.TokenLogprobs(-1.5)]

    with router(tokenizer) as client:
        def on_decode(w, msg):
            if isinstance(msg, P.Reserve):
                w.send(P.Reserved(w.worker_id, msg.request_id, [10, 11], "tcp://127.0.0.1:1"))

        def on_prefill(w, msg):
            if isinstance(msg, P.Prefill):
                d.send(P.Tokens(d.worker_id, [
                    P.TokenOut(msg.request_id, 42, "a"),
                    P.TokenOut(msg.request_id, 43, "b", logprobs=P.TokenLogprobs(-0.5, [43], [-0.5])),
                    P.TokenOut(msg.request_id, 44, "c", True, "length",
                               P.Timeline({"first_step_start": 1.0, "first_step_end": 1.001}),
                               P.TokenLogprobs(-0.75, [44], [-0.75]))]))
                time.sleep(0.2)  # D's tokens are in before the report
                prefilled = P.Timeline({"prefill_start": 1.0, "prefill_end": 1.003, "kv_delivered": 1.0032})
                w.send(P.PrefillDone(w.worker_id, msg.request_id, 42, prefilled, transfer_ms=0.4, kv_bytes=8192,
                                     copies=1, first_logprobs=lp1, prompt_logprobs=prompt_lps * (len(msg.prompt_ids) - 1)))

        d = client.add_worker("decode", "d0", on_decode)
        client.add_worker("prefill", "p0", on_prefill)
        body = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "logprobs": 1,
                                                    "echo": True, "policy": "disaggregated"}).json()
        lps = body["choices"][0]["logprobs"]["token_logprobs"]
        n = len(tokenizer.encode("Hello there"))
        assert lps == [None] + [-1.5] * (n - 1) + [-0.125, -0.5, -0.75], body


def test_n_starts_the_other_sequences_once_the_first_has_prefilled(tokenizer):  # noqa: F811
    """A prompt of a full block or more: choices 1.. are sent once choice 0's token 1 is in, so the
    worker's prefix cache holds the prompt for them; a shorter prompt sends all at once."""
    seen: list[tuple[str, int]] = []  # (request id, tokens the router had been sent before it)
    sent = {"n": 0}

    def on_message(w, msg):
        if isinstance(msg, P.Generate):
            seen.append((msg.request_id, sent["n"]))
            time.sleep(0.05)
            sent["n"] += 1
            w.tokens(msg.request_id, [100], timeline=P.Timeline({"prefill_start": 1.0, "prefill_end": 1.001}))

    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", on_message)
        long_prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16
        body = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1, "n": 3}).json()
        assert [c["text"] for c in body["choices"]] == ["<100>"] * 3
        assert seen[0] == (f"{body['id']}-0", 0) and all(n >= 1 for _, n in seen[1:])  # after choice 0's token
        seen.clear()
        sent["n"] = 0
        body = client.post("/v1/completions", json={"prompt": long_prompt[:8], "max_tokens": 1, "n": 3}).json()
        assert len(body["choices"]) == 3 and len(seen) == 3
