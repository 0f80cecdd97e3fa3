"""Client: wire parsing, Timings, errors, sync/async clients and pdserve-client against a fake server."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.bench.load.fake_server import FakeConfig, FakeServer, free_port
from pdserve.client import AsyncClient, Client, ProtocolError, RequestTimeout, ServerError, ServerUnreachable, Timings
from pdserve.client import cli
from pdserve.client.wire import SSEDecoder, StreamState, error_from_response

FULL_TIMINGS = {
    "route": None,  # (the router's routing explanation: none in this frame)
    "policy": "disaggregated", "queue_ms": 1.5, "prefill_ms": 20.0, "transfer_ms": 3.0,
    "transfer_exposed_ms": 0.5, "first_decode_step_ms": 4.0, "ttft_ms": 22.0, "e2e_ms": 80.0,
    "decode_tokens_per_s": 120.0, "kv_bytes": 1048576, "transport": "ipc", "mode": "layer",
    "prefill_worker": "prefill-0", "decode_worker": "decode-0", "worker": "decode-0",
    "prompt_tokens": 100, "completion_tokens": 8, "cached_tokens": 64, "recomputed_tokens": 36,
    "reused_tokens": {"device": 48, "host": 16, "disk": 0}, "kv_skipped_tokens": 32, "reload_ms": 2.5,
    "ttft_phases_ms": {"parse": 0.5, "route": 0.6, "inbox": 0.1, "prefill_queue": 0.3, "prefill": 20.0,
                       "transfer_exposed": 0.2, "decode_pickup": 0.1, "hops": 0.1, "first_token_send": 0.1,
                       "unattributed": 0.0},
}


# ---- Timings -------------------------------------------------------------------------------


def test_timings_full_object_round_trips():
    t = Timings.from_dict(FULL_TIMINGS)
    assert t.policy == "disaggregated" and t.transfer_exposed_ms == 0.5 and t.kv_bytes == 1048576
    assert t.transfer_paid_ms == 0.5
    assert t.to_dict() == FULL_TIMINGS
    table = t.table()
    assert "transfer_exposed_ms" in table and "0.50 ms" in table and "1.00 MiB" in table


def test_timings_phases_typed_in_phase_order_and_unknown_phases_kept():
    t = Timings.from_dict(FULL_TIMINGS)
    assert list(t.ttft_phases) == list(FULL_TIMINGS["ttft_phases_ms"]) and sum(t.ttft_phases.values()) == \
        pytest.approx(t.ttft_ms)
    assert "  prefill" in t.table() and "  hops" in t.table()
    shuffled = {"hops": 1, "later_phase": 2.5, "parse": 3, "transfer_exposed": None}
    got = Timings.from_dict({"ttft_phases_ms": shuffled}).ttft_phases
    assert list(got.items()) == [("parse", 3.0), ("transfer_exposed", None), ("hops", 1.0), ("later_phase", 2.5)]
    assert Timings.from_dict({"ttft_ms": 1.0}).ttft_phases is None
    for bad in ({"ttft_phases_ms": [1, 2]}, {"ttft_phases_ms": {"parse": "slow"}}):
        with pytest.raises(ProtocolError, match="ttft_phases_ms"):
            Timings.from_dict(bad)


def test_timings_missing_fields_are_none_and_unknown_ones_kept():
    t = Timings.from_dict({"policy": "colocated", "ttft_ms": 12, "new_field": [1, 2]})
    assert t.ttft_ms == 12.0 and isinstance(t.ttft_ms, float)
    assert t.transfer_ms is None and t.kv_bytes is None and t.worker is None
    assert t.transfer_paid_ms is None
    assert t.extra == {"new_field": [1, 2]}
    assert Timings.from_dict(None) is None
    assert Timings.from_dict({}).table() == "(the server reported no timings)"


def test_timings_integral_float_accepted_for_int_fields():
    assert Timings.from_dict({"kv_bytes": 4096.0}).kv_bytes == 4096


@pytest.mark.parametrize("bad", [{"queue_ms": "fast"}, {"kv_bytes": 1.5}, {"policy": 3}, {"prefill_ms": True}])
def test_timings_wrong_type_is_a_protocol_error(bad):
    with pytest.raises(ProtocolError, match=list(bad)[0]):
        Timings.from_dict(bad, request_id="cmpl-1")


# ---- SSE and streamed events ---------------------------------------------------------------


def test_sse_decoder_joins_data_lines_and_skips_comments():
    d = SSEDecoder()
    out = [d.feed(line) for line in [": keep-alive", "event: x", "data: {\"a\":", "data: 1}", "", "", "data:[DONE]", ""]]
    assert [x for x in out if x is not None] == ['{"a":\n1}', "[DONE]"]
    d.feed("data: tail")
    assert d.flush() == "tail" and d.flush() is None


def _chunk(text, finish=None, **extra):
    return json.dumps({"id": "cmpl-7", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                       **extra})


def test_stream_state_counts_tokens_not_end_markers():
    s = StreamState(chat=False)
    deltas = [s.feed(_chunk(" a"), 1.0), s.feed(_chunk(""), 2.0),  # "" mid-stream: half a UTF-8 char, a token
              s.feed(_chunk("b"), 3.0),
              s.feed(_chunk("", "length", usage={"prompt_tokens": 5, "completion_tokens": 3},
                            timings={"policy": "colocated", "ttft_ms": 1.0}), 4.0)]
    assert [d.is_token for d in deltas] == [True, True, True, False]
    assert s.feed("[DONE]", 5.0) is None and s.done
    r = s.result()
    assert r.text == " ab" and r.finish_reason == "length" and r.id == "cmpl-7"
    assert r.usage.completion_tokens == 3 and r.timings.policy == "colocated"


def test_stream_state_last_token_may_carry_the_finish_reason():
    s = StreamState(chat=False)
    assert s.feed(_chunk("x", "stop"), 1.0).is_token
    # the last token decoded to "" and rides on the final event: usage says it is one more token
    s = StreamState(chat=False)
    s.feed(_chunk("a"), 1.0)
    assert s.feed(_chunk("", "length", usage={"prompt_tokens": 1, "completion_tokens": 2}), 2.0).is_token


def test_stream_state_chat_role_header_is_not_a_token():
    s = StreamState(chat=True)

    def chat(delta, finish=None):
        return json.dumps({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    got = [s.feed(chat({"role": "assistant", "content": ""}), 1), s.feed(chat({"content": "Hi"}), 2),
           s.feed(chat({}, "stop"), 3)]
    assert [d.is_token for d in got] == [False, True, False]
    assert s.result().text == "Hi"


def test_stream_state_error_event_and_garbage():
    s = StreamState(chat=False, request_id="cmpl-9")
    with pytest.raises(ServerError, match="KV transfer failed") as e:
        s.feed(json.dumps({"error": {"message": "KV transfer failed", "type": "server_error", "code": 500}}), 1)
    assert e.value.status == 500 and e.value.request_id == "cmpl-9"
    with pytest.raises(ProtocolError, match="not JSON"):
        s.feed("{nope", 1)


def test_error_from_response_shapes():
    e = error_from_response(400, json.dumps({"error": {"message": "max_tokens too big", "type": "invalid_request_error",
                                                       "param": "max_tokens", "code": None}}), "r1")
    assert (e.status, e.param, e.type, e.request_id) == (400, "max_tokens", "invalid_request_error", "r1")
    assert "max_tokens too big" in str(e) and "r1" in str(e)
    e = error_from_response(422, json.dumps({"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]}), None)
    assert e.status == 422 and "field required" in e.message
    e = error_from_response(502, "Bad Gateway\n", None)
    assert e.message == "Bad Gateway"


# ---- against a live (fake) server ----------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with FakeServer(FakeConfig(itl_ms=1.0)) as srv:
        yield srv


def test_client_complete_chat_and_model_resolution(server):
    with Client(server.base_url) as c:
        assert c.models() == ["fake-model"]
        out = c.complete("one two three", max_tokens=4, policy="disaggregated")
        assert c.model == "fake-model"
        assert out.text == " tok0 tok1 tok2 tok3" and out.finish_reason == "length"
        assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
        assert out.timings.policy == "disaggregated" and out.timings.kv_bytes == 3 * 57_344
        chat = c.chat("hello", max_tokens=2)
        assert chat.text == " tok0 tok1" and chat.timings.policy == "colocated"
    assert c._http.is_closed
    sent = server.bodies[-2]
    assert sent["model"] == "fake-model" and sent["policy"] == "disaggregated" and sent["stream"] is False


def test_client_streams_tokens_then_timings(server):
    with Client(server.base_url, model="fake-model") as c:
        with c.stream_complete("a b", max_tokens=5, ignore_eos=True) as s:
            deltas = list(s)
        tokens = [d for d in deltas if d.is_token]
        assert [d.text for d in tokens] == [f" tok{i}" for i in range(5)]
        assert all(b.arrival >= a.arrival for a, b in zip(deltas, deltas[1:]))
        assert s.result.timings.completion_tokens == 5 and s.result.text == " tok0 tok1 tok2 tok3 tok4"
        assert server.bodies[-1]["ignore_eos"] is True and server.bodies[-1]["stream"] is True
        with c.stream_chat([{"role": "user", "content": "hi"}], max_tokens=3) as s:
            assert sum(d.is_token for d in s) == 3
        assert s.result.text == " tok0 tok1 tok2"


def test_stream_closed_early_releases_the_connection(server):
    with Client(server.base_url, model="fake-model", max_connections=1) as c:
        for _ in range(3):  # with one connection, a leaked stream would block the next request
            with c.stream_complete("a", max_tokens=50) as s:
                next(iter(s))
        assert c.complete("a", max_tokens=1).text == " tok0"


def test_async_client_streams(server):
    async def go():
        async with AsyncClient(server.base_url) as c:
            async with c.stream_complete("x y", max_tokens=3, policy="colocated") as s:
                texts = [d.text async for d in s if d.is_token]
            full = await c.complete("x", max_tokens=2)
            chat = await c.chat("x", max_tokens=1)
        assert c._http.is_closed
        return texts, s.result, full, chat

    texts, streamed, full, chat = asyncio.run(go())
    assert texts == [" tok0", " tok1", " tok2"] and streamed.timings.policy == "colocated"
    assert full.text == " tok0 tok1" and chat.text == " tok0"


def test_server_error_is_typed_with_what_to_fix(server):
    with Client(server.base_url, model="fake-model") as c:
        with pytest.raises(ServerError) as e:
            c.complete("x", max_tokens=0)
        assert e.value.status == 400 and e.value.param == "max_tokens"
        with pytest.raises(ServerError, match="policy must be one of"):
            with c.stream_complete("x", max_tokens=1, policy="sideways") as s:
                list(s)


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, model="m") as c:
        with pytest.raises(ServerUnreachable, match="cannot reach the server") as e:
            c.complete("x")
    assert e.value.base_url == url

    async def go():
        async with AsyncClient(url) as c:
            await c.models()

    with pytest.raises(ServerUnreachable):
        asyncio.run(go())


def test_slow_answer_times_out():
    with FakeServer(FakeConfig(itl_ms=400)) as slow, Client(slow.base_url, model="fake-model", timeout_s=0.2) as c:
        with pytest.raises(RequestTimeout, match="within 0.2 s"):
            c.complete("x", max_tokens=3)


# ---- pdserve-client ------------------------------------------------------------------------


def test_cli_prints_text_then_timeline(server, capsys):
    assert cli.main(["hello world", "--base-url", server.base_url, "--max-tokens", "3", "--stream",
                     "--policy", "disaggregated"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" tok0 tok1 tok2\n")
    assert "finish_reason=length" in out and "client: e2e" in out and "ttft" in out
    assert "policy" in out and "disaggregated" in out and "transfer_exposed_ms" in out
    assert cli.main(["hi", "--base-url", server.base_url, "--chat", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" tok0 tok1\n") and "colocated" in out


def test_cli_errors_are_one_clear_line(server, capsys):
    assert cli.main(["x", "--base-url", server.base_url, "--max-tokens", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdserve-client: server error, HTTP 400") and "max_tokens" in err
    assert cli.main(["x", "--base-url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err
