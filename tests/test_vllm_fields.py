"""vLLM's request surface, field by field, against the shared tiny pdserve (real router and workers):

- docs/api.md's field table is server/fields.py's, row for row, and every request field of vLLM's
  OpenAI server (and OpenAI's) has a row;
- the table walked live: an implemented field's value is served (200), a neutral field's neutral
  values are served and its other values refused with a 400 naming it, a refused field is refused so;
- what the implemented vLLM fields do, each checked so it could fail: min_p, allowed_token_ids,
  bad_words, logit_bias, include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens,
  add_generation_prompt, continue_final_message, request_id, and a stream with
  `continuous_usage_stats` carrying the usage in every event.
"""

from __future__ import annotations

import pytest

from test_server_harness import ROOT
from pdserve.server.fields import FIELDS, IMPLEMENTED, markdown_table
from pdserve.server.requests import ChatRequest, CompletionRequest

pytestmark = pytest.mark.timeout(300)

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 2}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 2}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASES = {"chat": CHAT, "completions": COMPLETION}

# The request fields of vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py: ChatCompletionRequest,
# CompletionRequest), OpenAI's own included, as of vLLM 0.10/0.11
VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
    presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
    reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p
    repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
    skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids
    bad_words echo add_generation_prompt continue_final_message add_special_tokens documents chat_template
    chat_template_kwargs mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag
    guided_decoding_backend guided_whitespace_pattern priority request_id logits_processors
    return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs return_token_ids structured_outputs
    media_io_kwargs""".split()
VLLM_COMPLETION = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n
    presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
    repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
    skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs
    add_special_tokens response_format guided_json guided_regex guided_choice guided_grammar
    guided_decoding_backend guided_whitespace_pattern priority request_id logits_processors
    return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs return_token_ids structured_outputs""".split()
OPENAI_CHAT_ONLY = "functions function_call store metadata service_tier modalities audio prediction verbosity " \
                   "web_search_options prompt_cache_key safety_identifier".split()
# what a field needs beside it to be served (a stream for stream_options, ...)
COMPANIONS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
              "continue_final_message": {"add_generation_prompt": False}, "min_tokens": {"max_tokens": 2}}


def rows(kind: str):
    return [f for f in FIELDS if kind in f.endpoints]


def test_the_docs_table_is_the_code_table():
    text = (ROOT / "docs" / "api.md").read_text()
    assert markdown_table() in text, "docs/api.md's field table differs from server/fields.py (markdown_table())"


@pytest.mark.parametrize("kind,names", [("chat", VLLM_CHAT + OPENAI_CHAT_ONLY), ("completions", VLLM_COMPLETION)])
def test_every_vllm_and_openai_field_has_a_row(kind, names):
    have = {f.name for f in rows(kind)}
    assert not set(names) - have, f"{kind}: fields without a row in server/fields.py: {sorted(set(names) - have)}"
    names_seen = [(f.name, e) for f in FIELDS for e in f.endpoints]
    assert len(names_seen) == len(set(names_seen)), "a field has two rows for one endpoint"


@pytest.mark.parametrize("kind,model", [("chat", ChatRequest), ("completions", CompletionRequest)])
def test_implemented_rows_are_the_request_models_fields(kind, model):
    implemented = {f.name for f in rows(kind) if f.kind == IMPLEMENTED}
    assert implemented == set(model.model_fields), (
        f"{kind}: implemented in the table only {sorted(implemented - set(model.model_fields))}, "
        f"in the model only {sorted(set(model.model_fields) - implemented)}")


def _send(srv, kind: str, extra: dict):
    body = {**BASES[kind], **extra}
    if body.get("stream"):
        with srv.http.stream("POST", srv.url + PATHS[kind], json=body) as r:
            r.read()
            return r
    return srv.post(PATHS[kind], body)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_the_table_walked_against_a_live_server(tiny_pdserve, kind):
    wrong = []
    for f in rows(kind):
        if f.kind == IMPLEMENTED:
            probe = {"include_usage": True} if f.name == "stream_options" else f.probe
            r = _send(tiny_pdserve, kind, {f.name: probe, **COMPANIONS.get(f.name, {})})
            if r.status_code != 200:
                wrong.append(f"{f.name}={probe!r}: implemented, got {r.status_code} {r.text[:200]}")
            continue
        for value in f.neutral:
            r = _send(tiny_pdserve, kind, {f.name: value})
            if r.status_code != 200:
                wrong.append(f"{f.name}={value!r}: neutral, got {r.status_code} {r.text[:200]}")
        r = _send(tiny_pdserve, kind, {f.name: f.probe})
        err = r.json().get("error", {}) if r.status_code == 400 else {}
        if err.get("param") != f.name or "not supported" not in err.get("message", ""):
            wrong.append(f"{f.name}={f.probe!r}: {f.kind}, expected a 400 naming it, got {r.status_code} "
                         f"{r.text[:200]}")
    assert not wrong, "the table and the server disagree:\n" + "\n".join(wrong)


# ---- what the implemented fields do -----------------------------------------------------------------


def complete(srv, **fields) -> dict:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
            **fields}
    r = srv.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def test_min_p_one_keeps_only_the_top_token(tiny_pdserve):
    greedy = ids_of(complete(tiny_pdserve))
    sampled = [ids_of(complete(tiny_pdserve, temperature=1.0, seed=s)) for s in range(3)]
    assert any(s != greedy for s in sampled), "sampling at temperature 1 never left the greedy path: no contrast"
    assert all(ids_of(complete(tiny_pdserve, temperature=1.0, seed=s, min_p=1.0)) == greedy for s in range(3))


def test_allowed_token_ids_and_logit_bias(tiny_pdserve):
    allowed = [500, 501, 502]
    for seed in range(2):
        got = ids_of(complete(tiny_pdserve, temperature=1.0, seed=seed, allowed_token_ids=allowed))
        assert set(got) <= set(allowed), got
    greedy = ids_of(complete(tiny_pdserve))
    banned = ids_of(complete(tiny_pdserve, logit_bias={str(greedy[0]): -100}))
    assert banned[0] != greedy[0]
    assert ids_of(complete(tiny_pdserve, logit_bias={"777": 100})) == [777] * 6


def test_bad_words_are_not_generated(tiny_pdserve):
    [paris] = tiny_pdserve.post("/tokenize", {"prompt": " Paris", "add_special_tokens": False}).json()["tokens"]
    forced = {"logit_bias": {str(paris): 100}}
    assert ids_of(complete(tiny_pdserve, **forced)) == [paris] * 6
    got = ids_of(complete(tiny_pdserve, **forced, bad_words=["Paris"]))
    assert paris not in got, got


def test_include_stop_str_in_output_and_skip_special_tokens(tiny_pdserve):
    text = complete(tiny_pdserve, max_tokens=8)["choices"][0]["text"]
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    at = text.find(stop)
    cut = complete(tiny_pdserve, max_tokens=8, stop=[stop])["choices"][0]
    kept = complete(tiny_pdserve, max_tokens=8, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == text[:at] and cut["finish_reason"] == "stop"
    assert kept["text"] == text[:at + len(stop)] and kept["finish_reason"] == "stop"
    start = tiny_pdserve.post("/tokenize", {"prompt": "<|im_start|>", "add_special_tokens": False}).json()["tokens"]
    assert len(start) == 1, start  # a special token of SmolLM2's tokenizer
    special = {"allowed_token_ids": start, "max_tokens": 3}
    assert complete(tiny_pdserve, **special)["choices"][0]["text"] == ""
    assert complete(tiny_pdserve, **special, skip_special_tokens=False)["choices"][0]["text"] == "<|im_start|>" * 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_pdserve):
    prompt = list(range(300, 310))
    short = complete(tiny_pdserve, prompt=prompt, truncate_prompt_tokens=3)
    assert short["usage"]["prompt_tokens"] == 3
    assert ids_of(short) == ids_of(complete(tiny_pdserve, prompt=prompt[-3:]))
    assert complete(tiny_pdserve, prompt=prompt, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 10


def test_generation_prompt_and_continue_final_message(tiny_pdserve):
    msgs = [{"role": "user", "content": "Finish this:"}, {"role": "assistant", "content": "The capital is"}]

    def prompt_tokens(**fields) -> int:
        r = tiny_pdserve.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with_prompt, closed = prompt_tokens(), prompt_tokens(add_generation_prompt=False)
    open_ = prompt_tokens(add_generation_prompt=False, continue_final_message=True)
    assert with_prompt > closed > open_  # the assistant's header; then the end of the last turn is cut
    r = tiny_pdserve.post("/v1/chat/completions", {"messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_request_id_names_the_response(tiny_pdserve):
    out = complete(tiny_pdserve, request_id="bench-42")
    assert out["id"] == "cmpl-bench-42"
    events = [e for _, e in tiny_pdserve.stream("/v1/chat/completions", {**CHAT, "stream": True,
                                                                         "request_id": "bench-43"})]
    assert {e["id"] for e in events if e != "[DONE]"} == {"chatcmpl-bench-43"}
    r = tiny_pdserve.post("/v1/completions", {**COMPLETION, "request_id": "has space"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_continuous_usage_stats_puts_usage_in_every_chunk(tiny_pdserve):
    body = {**CHAT, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [e for _, e in tiny_pdserve.stream("/v1/chat/completions", body)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["usage"] is not None for e in chunks), chunks
    with_tokens = [e for e in chunks if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in with_tokens] == [1, 2, 3, 4, 5]
    prompt = with_tokens[0]["usage"]["prompt_tokens"]
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # include_usage's last
    only = {**body, "stream_options": {"continuous_usage_stats": True}}  # vLLM: include_usage defaults to true
    assert [e for _, e in tiny_pdserve.stream("/v1/chat/completions", only)][-2]["choices"] == []
    r = tiny_pdserve.post("/v1/chat/completions", {**body, "stream_options": {"include_usage": False,
                                                                              "continuous_usage_stats": True}})
    assert r.status_code == 400 and "include_usage" in r.json()["error"]["message"]


def test_the_new_sampling_fields_give_the_same_tokens_on_both_policies(tiny_pdserve):
    [paris] = tiny_pdserve.post("/tokenize", {"prompt": " Paris", "add_special_tokens": False}).json()["tokens"]
    cases = [{"temperature": 1.0, "seed": 3, "min_p": 0.05}, {"allowed_token_ids": [500, 501, 502], "seed": 1,
                                                             "temperature": 1.0},
             {"logit_bias": {str(paris): 100}, "bad_words": ["Paris"]}, {"logit_bias": {"777": 5.0}}]
    for fields in cases:
        both = [ids_of(complete(tiny_pdserve, policy=p, **fields)) for p in ("colocated", "disaggregated")]
        assert both[0] == both[1], (fields, both)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_null_is_not_set_for_every_field(tiny_pdserve, kind):
    nulls = {f.name: None for f in rows(kind) if f.name not in ("messages", "prompt", "max_tokens")}
    r = tiny_pdserve.post(PATHS[kind], {**BASES[kind], **nulls})  # max_tokens 2: null would mean up to 512
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
