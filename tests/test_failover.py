"""--failover: a disaggregated request whose prefill or KV transfer fails before its first token runs
once more, on another decode worker or colocated, and its timings say so; off by default (the request
fails). Against fake workers (tests/test_server_router.py): the failures come exactly when scripted."""

from __future__ import annotations

from test_server_router import FakePair, colocated_echo, router, tokenizer  # noqa: F401
from pdserve.protocol import control as P

BODY = {"prompt": "Hello", "max_tokens": 3, "policy": "disaggregated", "return_token_ids": True}


def test_without_the_flag_a_failed_transfer_fails_the_request(tokenizer):  # noqa: F811
    with router(tokenizer) as client:
        FakePair(client, prefill_fails=True)
        client.add_worker("colocated", "c0", colocated_echo(3))
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 502 and r.json()["error"]["code"] == "transfer_error", r.text


def test_a_failed_transfer_fails_over_to_a_colocated_worker_and_says_so(tokenizer):  # noqa: F811
    with router(tokenizer, failover=True) as client:
        pair = FakePair(client, prefill_fails=True)
        c0 = client.add_worker("colocated", "c0", colocated_echo(3))
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        assert t["policy"] == "colocated" and t["worker"] == "c0"
        assert t["failover"]["from"] == "p0/d0" and t["failover"]["to"] == "c0"
        assert "scripted transfer failure" in t["failover"]["error"]
        [gen] = c0.got(P.Generate)
        assert gen.request_id.endswith("-failover")  # its own id: the first try's aborts cannot reach it
        assert pair.d.got(P.Abort)  # the first try's reservation was let go


def test_a_failed_transfer_fails_over_to_another_decode_worker(tokenizer):  # noqa: F811
    with router(tokenizer, failover=True) as client:
        decodes, broken = {}, []

        def on_decode(w, msg):
            if isinstance(msg, P.Reserve):
                w.send(P.Reserved(w.worker_id, msg.request_id, [10, 11], "tcp://127.0.0.1:1"))

        def on_prefill(w, msg):
            if not isinstance(msg, P.Prefill):
                return
            if not broken or msg.decode_worker == broken[0]:  # the first decode worker asked for is broken
                broken.append(msg.decode_worker)
                w.send(P.RequestFailed(w.worker_id, msg.request_id, "transfer", "peer unreachable"))
                return
            prefilled = P.Timeline({"prefill_start": 1.0, "prefill_end": 1.001, "kv_delivered": 1.0011})
            w.send(P.PrefillDone(w.worker_id, msg.request_id, 42, prefilled, transfer_ms=0.1, kv_bytes=1, copies=1))
            decodes[msg.decode_worker].tokens(msg.request_id, [42, 43, 44], timeline=P.Timeline())

        for wid in ("d0", "d1"):
            decodes[wid] = client.add_worker("decode", wid, on_decode)
        client.add_worker("prefill", "p0", on_prefill)
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [42, 43, 44]
        t = r.json()["timings"]
        assert t["policy"] == "disaggregated" and t["failover"] == {
            "from": f"p0/{broken[0]}", "to": f"p0/{t['decode_worker']}", "error": t["failover"]["error"]}
        assert t["decode_worker"] != broken[0] and "peer unreachable" in t["failover"]["error"]


def test_no_failover_once_a_token_went_out(tokenizer):  # noqa: F811
    def on_decode(w, msg):
        if isinstance(msg, P.Reserve):
            w.send(P.Reserved(w.worker_id, msg.request_id, [10, 11], "tcp://127.0.0.1:1"))

    def on_prefill(w, msg):
        if isinstance(msg, P.Prefill):
            w.send(P.PrefillDone(w.worker_id, msg.request_id, 42, P.Timeline(), transfer_ms=0.1, kv_bytes=1, copies=1))
            d.tokens(msg.request_id, [42], finished_last=False)
            d.send(P.RequestFailed("d0", msg.request_id, "internal", "decode broke after token 1"))

    with router(tokenizer, failover=True) as client:
        d = client.add_worker("decode", "d0", on_decode)
        client.add_worker("prefill", "p0", on_prefill)
        c0 = client.add_worker("colocated", "c0", colocated_echo(3))
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 502 and "decode broke after token 1" in r.json()["error"]["message"], r.text
        assert not c0.got(P.Generate)  # the client may have seen token 1: never run twice
