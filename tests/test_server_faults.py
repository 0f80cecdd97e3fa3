"""pdserve with the tiny model, real processes on CPU (one prefill, two decode, one colocated worker):
bad input, 16 concurrent requests of mixed policies, no leaked KV blocks, and a decode worker
killed while it streams. The kill runs last: it changes the deployment."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from test_server_harness import TINY, Pdserve

pytestmark = pytest.mark.timeout(600)

HEARTBEAT_S = 0.5
MISSES = 3
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
           "Paged attention keeps the KV cache in fixed-size blocks so that"]


@pytest.fixture(scope="module")
def srv():
    with Pdserve(*TINY, "--decode-workers", "2", "--heartbeat-interval", str(HEARTBEAT_S),
                 "--heartbeat-misses", str(MISSES), "--transport", "zmq", "--mode", "layer",
                 "--no-restart") as s:  # the kill at the end leaves the deployment degraded (restarts: test_supervision)
        yield s


@pytest.fixture(scope="module")
def reference():
    from pdserve.workers.engine.models import load_model

    loaded = load_model("tiny", "float32", "cpu")

    def greedy(prompt: str, n: int) -> list[int]:
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=n, do_sample=False, eos_token_id=loaded.eos_token_ids,
                                        pad_token_id=loaded.eos_token_ids[0])
        return out[0, len(ids):].tolist()

    return greedy


BAD = [
    # (path, body, status, param, words in the message)
    ("/v1/completions", b'{"prompt": "hi",', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "a string or a list of token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "a string or a list of strings"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": [999999999]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hello " * 2100}, 400, "prompt", "shorten the prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "in [1, "),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "in [1, "),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens", "ask for at most"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", "between 1 and 16"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "serves 'tiny'"),
    ("/v1/completions", {"prompt": "hi", "policy": "fastest"}, 400, "policy", "colocated, disaggregated, auto"),
    ("/v1/chat/completions", {}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "'user'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content",
     "a string or a list of"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_its_status_and_message(srv, path, body, status, param, words):
    r = srv.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unknown_routes_and_methods_get_error_objects(srv):
    r = srv.get("/v1/nothing")
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    r = srv.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_16_concurrent_requests_of_mixed_policies(srv, reference):
    policies = ["colocated", "disaggregated", "auto"]
    jobs = [(PROMPTS[i % len(PROMPTS)], policies[i % 3], i % 2 == 0) for i in range(16)]
    expected = {p: reference(p, 10) for p in PROMPTS}

    def one(job):
        prompt, policy, stream = job
        body = {"prompt": prompt, "max_tokens": 10, "policy": policy, "return_token_ids": True, "stream": stream}
        if not stream:
            r = srv.http.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            return out["choices"][0]["token_ids"], out["timings"]
        with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return [t for e in events for t in e["choices"][0]["token_ids"]], events[-1]["timings"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for (prompt, policy, _), (ids, t) in zip(jobs, results):
        assert ids == expected[prompt], f"{policy} {prompt!r}: {ids} != {expected[prompt]}"
        if policy != "auto":
            assert t["policy"] == policy
    served = {t["worker"] for _, t in results}
    # not both decoders: the router sends a prompt to the decoder that holds its KV (--routing kv, the
    # default) unless that one is overloaded, and once the first of these ran one decoder holds all four
    # prompts; whether 16 overlap enough to overload it is timing (CI's 2 cores: they did not). The load
    # rule itself: tests/test_routing.py
    assert "colocated-0" in served and served & {"decode-0", "decode-1"}, served


def test_no_kv_blocks_leak(srv):
    def all_free(h):
        return all(w["free_blocks"] == w["num_blocks"] for w in h["workers"]) and len(h["workers"]) == 4

    srv.wait_for(all_free, timeout=10, what="every worker's KV blocks back in its pool")


@pytest.mark.parametrize("policy", ["colocated", "disaggregated"])
def test_a_client_that_leaves_a_stream_stops_its_request(srv, policy):
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "policy": policy, "stream": True}
    cancelled = f'pdserve_requests_total{{outcome="cancelled",policy="{policy}"}}'
    before = counter(srv, cancelled)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:  # three events in: leave
                    break
    left = time.monotonic()
    srv.wait_for(lambda h: all(w["in_flight"] == 0 and w["running"] == 0 and w["free_blocks"] == w["num_blocks"]
                               for w in h["workers"]), timeout=5, what="the abandoned stream's request to stop")
    assert time.monotonic() - left < 5
    assert counter(srv, cancelled) == before + 1


@pytest.mark.parametrize("policy", ["colocated", "disaggregated"])
def test_a_client_that_leaves_stops_its_request(srv, policy):
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "policy": policy}  # seconds of decoding
    cancelled = f'pdserve_requests_total{{outcome="cancelled",policy="{policy}"}}'
    before = counter(srv, cancelled)
    # a raw socket, closed by hand: an HTTP client library may keep a timed-out connection open until
    # its garbage is collected, and the server cannot see a disconnect that has not happened
    host, port = srv.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(0.5)  # leaves long before 2000 tokens
    left = time.monotonic()

    def idle(h):
        return all(w["in_flight"] == 0 and w["running"] == 0 and w["free_blocks"] == w["num_blocks"]
                   for w in h["workers"])

    srv.wait_for(idle, timeout=5, what="the abandoned request to be aborted and its blocks freed")
    assert time.monotonic() - left < 5
    assert counter(srv, cancelled) == before + 1  # aborted, not run to its end


def counter(srv: Pdserve, line_start: str) -> float:
    lines = [line for line in srv.get("/metrics").text.splitlines() if line.startswith(line_start)]
    return sum(float(line.split()[-1]) for line in lines)


def test_killing_the_decode_worker_mid_stream_fails_fast_and_serving_goes_on(srv):
    lost_before = counter(srv, 'pdserve_workers_lost_total{role="decode"}')
    failed_before = counter(srv, 'pdserve_requests_total{outcome="worker_lost",policy="disaggregated"}')
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "policy": "disaggregated", "stream": True}
    victim = None
    killed_at = None
    events = []
    for t, event in srv.stream("/v1/completions", body):
        events.append(event)
        if victim is None and len(events) == 3:
            busy = [w for w in srv.health()["workers"] if w["role"] == "decode" and w["in_flight"] == 1]
            assert len(busy) == 1, busy
            victim = busy[0]
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
    failed_after = time.monotonic() - killed_at
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "worker_lost" and victim["id"] in err["message"], err
    assert failed_after < HEARTBEAT_S * MISSES + 2.0, f"the error came {failed_after:.1f}s after the kill"
    assert len(events) < 200  # the stream really was cut short

    h = srv.health()
    assert victim["id"] not in {w["id"] for w in h["workers"]} and h["status"] == "degraded"  # 1 of 2 decode
    assert h["missing"] == {"decode": 1}
    survivor = ({"decode-0", "decode-1"} - {victim["id"]}).pop()
    for policy, worker in (("disaggregated", survivor), ("colocated", "colocated-0"), ("auto", None)):
        r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "policy": policy})
        assert r.status_code == 200, r.text
        if worker:
            assert r.json()["timings"]["worker"] == worker

    def settled(h):
        return len(h["workers"]) == 3 and all(w["free_blocks"] == w["num_blocks"] for w in h["workers"])

    srv.wait_for(settled, timeout=10, what="the surviving workers' blocks all free")
    assert counter(srv, 'pdserve_workers_lost_total{role="decode"}') == lost_before + 1
    assert counter(srv, 'pdserve_requests_total{outcome="worker_lost",policy="disaggregated"}') == failed_before + 1
