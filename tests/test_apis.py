"""The two APIs' response shapes, pinned (server/apis.py, server/responses.py): ids, `object` names, a
choice's fields in order (chat's first stream event carrying the role), and each API's logprobs."""

from __future__ import annotations

import json

from pdserve.protocol import control as P
from pdserve.protocol.timings import Timings
from pdserve.server import responses as R
from pdserve.server.apis import CHAT, COMPLETIONS

LP = P.TokenLogprobs(-0.5, [1, 2], [-0.5, -1.5])


def text_of(token_id: int) -> str:
    return f"t{token_id}"


def dumped(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))


def test_ids_and_object_names():
    assert CHAT.new_id().startswith("chatcmpl-") and COMPLETIONS.new_id().startswith("cmpl-")
    t = Timings()
    assert R.response_body(CHAT, "r", 1, "m", [], 1, 0, t)["object"] == "chat.completion"
    assert R.response_body(COMPLETIONS, "r", 1, "m", [], 1, 0, t)["object"] == "text_completion"
    assert R.chunk_body(CHAT, "r", 1, "m", {})["object"] == "chat.completion.chunk"
    assert R.chunk_body(COMPLETIONS, "r", 1, "m", {})["object"] == "text_completion"
    assert R.usage_chunk_body(CHAT, "r", 1, "m") == {"id": "r", "object": "chat.completion.chunk", "created": 1,
                                                     "model": "m", "choices": []}


def test_chat_choices_and_logprobs():
    c = R.ChoiceBuilder(CHAT, 0, text_of, logprobs=True, with_ids=True)
    first = c.delta(c.add(3, "a", LP, None), [3])
    assert dumped(first) == (
        '{"index":0,"delta":{"role":"assistant","content":"a"},"logprobs":{"content":[{"token":"t3","logprob":-0.5,'
        '"bytes":[116,51],"top_logprobs":[{"token":"t1","logprob":-0.5,"bytes":[116,49]},'
        '{"token":"t2","logprob":-1.5,"bytes":[116,50]}]}]},"finish_reason":null,"token_ids":[3]}')
    last = dumped(c.delta(c.add(4, "b", LP, None), [4], "stop"))
    assert last.startswith('{"index":0,"delta":{"content":"b"},"logprobs":{"content":[{"token":"t4"')
    assert last.endswith('"finish_reason":"stop","token_ids":[4]}')
    assert dumped(R.ChoiceBuilder(CHAT, 1, text_of, False, False).body()) == (
        '{"index":1,"message":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}')


def test_completion_choices_and_logprobs_with_echo():
    c = R.ChoiceBuilder(COMPLETIONS, 0, text_of, logprobs=True, with_ids=False, echo="P", prompt_ids=[5, 6])
    c.add(3, "a", LP, [LP])
    c.finish_reason = "length"
    assert dumped(c.body()) == (
        '{"index":0,"text":"Pa","logprobs":{"tokens":["t5","t6","t3"],"token_logprobs":[null,-0.5,-0.5],'
        '"top_logprobs":[null,{"t1":-0.5,"t2":-1.5,"t6":-0.5},{"t1":-0.5,"t2":-1.5,"t3":-0.5}],'
        '"text_offset":[0,2,4]},"finish_reason":"length"}')
    d = R.ChoiceBuilder(COMPLETIONS, 2, text_of, False, True)
    assert dumped(d.delta(d.add(7, "x", None, None), [7])) == (
        '{"index":2,"text":"x","logprobs":null,"finish_reason":null,"token_ids":[7]}')
