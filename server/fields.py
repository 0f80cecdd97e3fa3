"""Every request field of OpenAI's and vLLM's completions and chat APIs, and what pdserve does with it.

    FIELDS                 one row per field (and endpoint where the two differ): its class, the values
                           that change nothing, a value the live test sends, what it does here
    neutral_values(kind)   {field: its neutral values} of the fields this endpoint does not implement
    markdown_table()       the table docs/api.md shows (tests/test_vllm_fields.py holds the two equal and
                           walks every row against a live pdserve)

Three classes. `implemented`: the field works (its checks and meaning are the request model's, in
server/requests.py). `neutral`: accepted when it holds a value that changes nothing (`best_of: 1`,
`tools: []`), which clients send by default; any other value is refused with a 400 naming the field.
`refused`: any value but null gets that 400. null is "not set" for every field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

IMPLEMENTED, NEUTRAL, REFUSED = "implemented", "neutral", "refused"
BOTH, CHAT, COMPLETIONS = ("chat", "completions"), ("chat",), ("completions",)


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[str, ...]
    origin: str  # who defines it: OpenAI, vLLM, pdserve
    kind: str  # IMPLEMENTED, NEUTRAL or REFUSED
    probe: Any  # implemented: a value that works; otherwise one that is refused
    neutral: tuple = ()  # neutral: the values accepted (and dropped)
    note: str = ""
    why: str = ""  # refused: the reason the 400 gives


def _f(name, endpoints, origin, kind, probe, neutral=(), note="", why=""):
    return RequestField(name, endpoints, origin, kind, probe, tuple(neutral), note, why)


_NO_TOOLS = "pdserve has no tool calling"
_NO_GUIDED = "pdserve has no guided decoding"
FIELDS: tuple[RequestField, ...] = (
    # ---- OpenAI's, both endpoints
    _f("model", BOTH, "OpenAI", IMPLEMENTED, "tiny", note="the served model's id or null; another id gets 404"),
    _f("max_tokens", BOTH, "OpenAI", IMPLEMENTED, 2, note="default: `--default-max-tokens` (completions) and "
       "`--default-chat-max-tokens` (chat), capped by the context left"),
    _f("temperature", BOTH, "OpenAI", IMPLEMENTED, 0.5, note="0..2; default 0 (greedy)"),
    _f("top_p", BOTH, "OpenAI", IMPLEMENTED, 0.9),
    _f("seed", BOTH, "OpenAI", IMPLEMENTED, 7, note="0..2**63-1; choice i of n samples with seed + i"),
    _f("stop", BOTH, "OpenAI", IMPLEMENTED, ["\n\n"], note="a string or up to 16"),
    _f("stream", BOTH, "OpenAI", IMPLEMENTED, False),
    _f("stream_options", BOTH, "OpenAI", IMPLEMENTED, None, note="`include_usage` (OpenAI's), "
       "`continuous_usage_stats` (vLLM's: usage so far in every event)"),
    _f("n", BOTH, "OpenAI", IMPLEMENTED, 2, note="1..16"),
    _f("presence_penalty", BOTH, "OpenAI", IMPLEMENTED, 0.5),
    _f("frequency_penalty", BOTH, "OpenAI", IMPLEMENTED, 0.5),
    _f("logit_bias", BOTH, "OpenAI", IMPLEMENTED, {"42": -100}, note="{token id: -100..100}, at most 1024; keys "
       "are ids of the vocabulary in digits 0-9 (a 400 names a bad key)"),
    _f("user", BOTH, "OpenAI", IMPLEMENTED, "u-1", note="an end user's tag: no effect on the output (as OpenAI's)"),
    _f("safety_identifier", BOTH, "OpenAI", IMPLEMENTED, "u-1", note="as `user`"),
    _f("logprobs", COMPLETIONS, "OpenAI", IMPLEMENTED, 2, note="0..5 alternatives (the legacy format)"),
    _f("logprobs", CHAT, "OpenAI", IMPLEMENTED, True),
    _f("top_logprobs", CHAT, "OpenAI", IMPLEMENTED, None, note="0..20, with `logprobs: true`"),
    _f("top_logprobs", COMPLETIONS, "OpenAI", NEUTRAL, 2, [0], why="a chat field; completions take `logprobs: N`"),
    _f("echo", COMPLETIONS, "OpenAI", IMPLEMENTED, True),
    _f("echo", CHAT, "vLLM", NEUTRAL, True, [False], why="pdserve does not echo chat messages"),
    _f("prompt", COMPLETIONS, "OpenAI", IMPLEMENTED, "Hi", note="text or token ids; one prompt per request"),
    _f("suffix", COMPLETIONS, "OpenAI", NEUTRAL, "end", [""], why="pdserve has no insertion (fill-in-the-middle)"),
    _f("best_of", BOTH, "OpenAI", NEUTRAL, 3, [1], why="pdserve returns every sequence it generates (use `n`)"),
    _f("messages", CHAT, "OpenAI", IMPLEMENTED, [{"role": "user", "content": "Hi"}],
       note="roles system, developer, user, assistant, tool; text content (a string or text parts)"),
    _f("max_completion_tokens", CHAT, "OpenAI", IMPLEMENTED, 2, note="as `max_tokens`"),
    _f("tools", BOTH, "OpenAI", NEUTRAL, [{"type": "function", "function": {"name": "f"}}], [[]], why=_NO_TOOLS),
    _f("tool_choice", BOTH, "OpenAI", NEUTRAL, "auto", ["none"], why=_NO_TOOLS),
    _f("parallel_tool_calls", BOTH, "OpenAI", NEUTRAL, "yes", [True, False], why=_NO_TOOLS),
    _f("functions", BOTH, "OpenAI", NEUTRAL, [{"name": "f"}], [[]], why="pdserve has no function calling"),
    _f("function_call", BOTH, "OpenAI", NEUTRAL, "auto", ["none"], why="pdserve has no function calling"),
    _f("response_format", BOTH, "OpenAI", NEUTRAL, {"type": "json_object"}, [{"type": "text"}],
       why="pdserve returns plain text only, `{\"type\": \"text\"}`"),
    _f("store", BOTH, "OpenAI", NEUTRAL, True, [False], why="pdserve stores nothing"),
    _f("metadata", BOTH, "OpenAI", NEUTRAL, {"k": "v"}, [{}], why="pdserve stores nothing"),
    _f("service_tier", BOTH, "OpenAI", NEUTRAL, "flex", ["auto", "default"], why="pdserve has one tier"),
    _f("modalities", BOTH, "OpenAI", NEUTRAL, ["audio"], [["text"]], why="pdserve generates text only"),
    _f("audio", CHAT, "OpenAI", REFUSED, {"voice": "x"}, why="pdserve generates text only"),
    _f("prediction", CHAT, "OpenAI", REFUSED, {"type": "content"}, why="pdserve has no predicted outputs"),
    _f("reasoning_effort", CHAT, "OpenAI", REFUSED, "low", why="pdserve serves no reasoning models' controls"),
    _f("verbosity", CHAT, "OpenAI", REFUSED, "low"),
    _f("web_search_options", CHAT, "OpenAI", REFUSED, {}, why="pdserve has no web search"),
    _f("prompt_cache_key", BOTH, "OpenAI", REFUSED, "k", why="pdserve's prefix cache needs no key"),
    # ---- vLLM's sampling fields
    _f("top_k", BOTH, "vLLM", IMPLEMENTED, 5, note="0 or -1: off"),
    _f("min_p", BOTH, "vLLM", IMPLEMENTED, 0.1, note="0..1; 0: off"),
    _f("repetition_penalty", BOTH, "vLLM", IMPLEMENTED, 1.2, note="(0, 2]; 1: off"),
    _f("min_tokens", BOTH, "vLLM", IMPLEMENTED, 1),
    _f("stop_token_ids", BOTH, "vLLM", IMPLEMENTED, [2], note="up to 64"),
    _f("ignore_eos", BOTH, "vLLM", IMPLEMENTED, True),
    _f("include_stop_str_in_output", BOTH, "vLLM", IMPLEMENTED, True),
    _f("skip_special_tokens", BOTH, "vLLM", IMPLEMENTED, False),
    _f("spaces_between_special_tokens", BOTH, "vLLM", NEUTRAL, False, [True],
       why="special tokens are always joined with spaces where the tokenizer puts them"),
    _f("truncate_prompt_tokens", BOTH, "vLLM", IMPLEMENTED, 3, note="keep the prompt's last N tokens (-1: as many "
       "as the context holds)"),
    _f("allowed_token_ids", BOTH, "vLLM", IMPLEMENTED, [42, 43, 44], note="ids of the vocabulary, at most as many "
       "as it holds"),
    _f("bad_words", CHAT, "vLLM", IMPLEMENTED, ["Paris"], note="up to 64 words, 8192 characters in all, each at "
       "most 32 tokens; each banned as text and with a leading space"),
    _f("bad_words", COMPLETIONS, "vLLM", IMPLEMENTED, ["Paris"], note="as for chat (vLLM reads it on chat only)"),
    _f("prompt_logprobs", BOTH, "vLLM", REFUSED, 1, why="use `echo` with `logprobs` on /v1/completions"),
    _f("use_beam_search", BOTH, "vLLM", NEUTRAL, True, [False], why="pdserve has no beam search"),
    _f("length_penalty", BOTH, "vLLM", NEUTRAL, 0.5, [1], why="pdserve has no beam search"),
    # ---- vLLM's other request fields
    _f("add_special_tokens", BOTH, "vLLM", IMPLEMENTED, False, note="the tokenizer's BOS/EOS around the prompt; "
       "default true on completions, false on chat (the template has them)"),
    _f("add_generation_prompt", CHAT, "vLLM", IMPLEMENTED, False, note="default true: end with the assistant's "
       "turn"),
    _f("continue_final_message", CHAT, "vLLM", IMPLEMENTED, True, note="the last message stays open and the "
       "answer continues it (needs `add_generation_prompt: false`)"),
    _f("request_id", BOTH, "vLLM", IMPLEMENTED, "my-req-1", note="the response's id becomes `cmpl-<id>` or "
       "`chatcmpl-<id>`; 1..128 characters of A-Z a-z 0-9 . _ : -"),
    _f("priority", BOTH, "vLLM", NEUTRAL, 1, [0], why="pdserve's scheduler has no priorities (as vLLM's default "
       "scheduler, which refuses it too)"),
    _f("return_token_ids", BOTH, "vLLM", IMPLEMENTED, True, note="each choice (or event) carries its token ids"),
    _f("return_tokens_as_token_ids", BOTH, "vLLM", NEUTRAL, True, [False], why="logprobs show tokens as text"),
    _f("documents", CHAT, "vLLM", REFUSED, [{"title": "t", "text": "x"}], why="chat templates get messages only"),
    _f("chat_template", CHAT, "vLLM", REFUSED, "{{ messages }}", why="the model's own template is used"),
    _f("chat_template_kwargs", BOTH, "vLLM", NEUTRAL, {"x": 1}, [{}], why="the model's template gets no arguments"),
    _f("mm_processor_kwargs", BOTH, "vLLM", NEUTRAL, {"x": 1}, [{}], why="pdserve serves text models"),
    _f("media_io_kwargs", BOTH, "vLLM", NEUTRAL, {"x": 1}, [{}], why="pdserve serves text models"),
    _f("include_reasoning", BOTH, "vLLM", NEUTRAL, "yes", [True, False], why="pdserve has no reasoning parser"),
    _f("guided_json", BOTH, "vLLM", REFUSED, {"type": "object"}, why=_NO_GUIDED),
    _f("guided_regex", BOTH, "vLLM", REFUSED, "a+", why=_NO_GUIDED),
    _f("guided_choice", BOTH, "vLLM", REFUSED, ["a"], why=_NO_GUIDED),
    _f("guided_grammar", BOTH, "vLLM", REFUSED, "root ::= \"a\"", why=_NO_GUIDED),
    _f("structural_tag", CHAT, "vLLM", REFUSED, "{}", why=_NO_GUIDED),
    _f("structured_outputs", BOTH, "vLLM", REFUSED, {"regex": "a"}, why=_NO_GUIDED),
    _f("guided_decoding_backend", BOTH, "vLLM", REFUSED, "outlines", why=_NO_GUIDED),
    _f("guided_whitespace_pattern", BOTH, "vLLM", REFUSED, " ", why=_NO_GUIDED),
    _f("logits_processors", BOTH, "vLLM", REFUSED, ["m.P"], why="pdserve runs no code named by a request"),
    _f("cache_salt", BOTH, "vLLM", REFUSED, "s", why="pdserve's prefix cache is not salted per request"),
    _f("kv_transfer_params", BOTH, "vLLM", REFUSED, {}, why="pdserve moves the KV itself (`policy`)"),
    _f("vllm_xargs", BOTH, "vLLM", NEUTRAL, {"x": 1}, [{}], why="pdserve has no extensions that read it"),
    _f("prompt_embeds", COMPLETIONS, "vLLM", REFUSED, "AAAA", why="pdserve takes text or token ids"),
    # ---- pdserve's own
    _f("policy", BOTH, "pdserve", IMPLEMENTED, "colocated", note="colocated, disaggregated or auto"),
)


def neutral_values(kind: str) -> dict[str, tuple]:
    """{field: its neutral values} for the fields `kind`'s endpoint ("chat" or "completions") does not
    implement (refused fields: none)."""
    return {f.name: f.neutral for f in FIELDS if kind in f.endpoints and f.kind != IMPLEMENTED}


def reason(kind: str, name: str) -> str:
    return next((f.why for f in FIELDS if f.name == name and kind in f.endpoints and f.why), "")


def markdown_table() -> str:
    rows = ["| field | endpoint | from | class | neutral value | what pdserve does |", "|---|---|---|---|---|---|"]
    for f in FIELDS:
        where = "both" if f.endpoints == BOTH else f.endpoints[0]
        neutral = ", ".join(f"`{json.dumps(v)}`" for v in f.neutral)
        rows.append(f"| `{f.name}` | {where} | {f.origin} | {f.kind} | {neutral} | {f.note or f.why} |")
    return "\n".join(rows)
