"""The requests widely used OpenAI-compatible load generators send, replayed one of each shape against the
shared tiny pdserve and read back the way each tool reads them. The shapes are taken from the tools'
own request code: vLLM's `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py) and its
older benchmarks/benchmark_serving.py, guidellm (src/guidellm/backends/openai/request_handlers.py),
SGLang's bench_serving (python/sglang/bench_serving.py) and llmperf
(src/llmperf/ray_clients/openai_chat_completions_client.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell me about the sea, in a few words."
N = 4  # output tokens each asks for
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
INCLUDE_USAGE = {"include_usage": True}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
TEXT_PARTS = [{"type": "text", "text": PROMPT}]

# (tool and shape, path, body, headers)
SHAPES = [
    ("vllm bench serve: openai (completions, stream)", COMPLETIONS_PATH,
     {"model": "tiny", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": N, "logprobs": None,
      "stream": True, "stream_options": INCLUDE_USAGE, "ignore_eos": True, "temperature": 0.0},
     {"x-request-id": "bench-1"}),
    ("vllm bench serve: openai-chat (chat, stream, text parts)", CHAT_PATH,
     {"model": "tiny", "messages": [{"role": "user", "content": TEXT_PARTS}], "max_completion_tokens": N,
      "stream": True, "stream_options": INCLUDE_USAGE, "ignore_eos": True, "temperature": 0.0, "top_p": 1.0,
      "top_k": -1, "min_p": 0.0}, {"x-request-id": "bench-2"}),
    ("vLLM benchmark_serving.py, older (completions, stream)", COMPLETIONS_PATH,
     {"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": N, "logprobs": None,
      "stream": True, "stream_options": INCLUDE_USAGE, "ignore_eos": True}, {}),
    ("guidellm (completions, stream)", COMPLETIONS_PATH,
     {"model": "tiny", "stream": True, "stream_options": CONTINUOUS, "max_tokens": N, "stop": None,
      "ignore_eos": True, "prompt": PROMPT}, {}),
    ("guidellm (chat, stream)", CHAT_PATH,
     {"model": "tiny", "stream": True, "stream_options": CONTINUOUS, "max_completion_tokens": N, "stop": None,
      "ignore_eos": True, "messages": [{"role": "user", "content": TEXT_PARTS}]}, {}),
    ("guidellm (chat, not streamed)", CHAT_PATH,
     {"model": "tiny", "max_completion_tokens": N, "stop": None, "ignore_eos": True,
      "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT_PARTS}]}, {}),
    ("SGLang bench_serving: openai (completions, stream)", COMPLETIONS_PATH,
     {"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": N, "stream": True,
      "ignore_eos": True}, {}),
    ("SGLang bench_serving: openai (completions, --disable-stream)", COMPLETIONS_PATH,
     {"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": N, "stream": False,
      "ignore_eos": True}, {}),
    ("SGLang bench_serving: openai-chat (chat, stream)", CHAT_PATH,
     {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0, "max_tokens": N,
      "stream": True, "ignore_eos": True}, {}),
    ("llmperf: openai (chat, stream, an empty system message)", CHAT_PATH,
     {"model": "tiny", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": PROMPT}],
      "stream": True, "max_tokens": N, "ignore_eos": True}, {}),
]


def events_of(srv, path: str, body: dict, headers: dict) -> list[dict]:
    with srv.http.stream("POST", srv.url + path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read().decode()
        lines = [line for line in r.iter_lines() if line.strip()]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("name,path,body,headers", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_benchmark_clients_request_is_served_and_reads_back(tiny_pdserve, name, path, body, headers):
    chat = path == CHAT_PATH
    if not body.get("stream"):
        r = tiny_pdserve.post(path, body, headers=headers)
        assert r.status_code == 200, r.text
        out = r.json()
        text = out["choices"][0]["message"]["content"] if chat else out["choices"][0]["text"]
        assert isinstance(text, str) and out["usage"]["completion_tokens"] == N
        return
    events = events_of(tiny_pdserve, path, body, headers)
    with_choices = [e for e in events if e.get("choices")]
    # every tool takes the first event with a choice as token 1 and reads text or delta.content from each
    pieces = [e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"] for e in with_choices]
    assert len(with_choices) == N and all(isinstance(p, str) for p in pieces), events
    options = body.get("stream_options") or {}
    if options.get("include_usage"):  # vLLM's and guidellm's output-token count: the usage event
        usage = [e for e in events if not e.get("choices") and e.get("usage")]
        assert usage and usage[-1]["usage"]["completion_tokens"] == N, events
    else:  # SGLang and llmperf index choices[0] of every event: no event without a choice
        assert len(with_choices) == len(events)
    if options.get("continuous_usage_stats"):  # guidellm keeps the last usage it saw
        assert all(e.get("usage") for e in events), events
    if "x-request-id" in headers:
        assert all(e["id"].startswith("chatcmpl-" if chat else "cmpl-") for e in events)
