"""Admission control: over its bounds the router refuses at once (429 + Retry-After), with no worker
for a role 503 + Retry-After; the admitted requests complete; /metrics counts both.

The overload test runs pdserve with the tiny model (one colocated worker, 4 requests admitted at a
time) under 48 concurrent requests; the rest run against fake workers (tests/test_server_router.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_server_harness import TINY, Pdserve
from test_server_router import colocated_echo, router, tokenizer  # noqa: F401  (tokenizer: a fixture)

pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]

CONCURRENT = 48
ADMITTED = 4


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_overload_gets_fast_429s_and_the_admitted_requests_complete():
    with Pdserve(*TINY, "--prefill-workers", "0", "--decode-workers", "0",
                 "--max-inflight-requests", str(ADMITTED), "--retry-after", "2") as srv:
        body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 48, "ignore_eos": True}
        go = threading.Barrier(CONCURRENT)

        def one(_):
            with httpx.Client(timeout=120) as c:
                go.wait()
                start = time.perf_counter()
                r = c.post(srv.url + "/v1/completions", json=body)
                return r, time.perf_counter() - start

        with ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(one, range(CONCURRENT)))
        ok = [(r, s) for r, s in results if r.status_code == 200]
        refused = [(r, s) for r, s in results if r.status_code == 429]
        assert len(ok) + len(refused) == CONCURRENT, [(r.status_code, r.text[:200]) for r, _ in results]
        assert len(ok) >= ADMITTED and len(refused) >= CONCURRENT // 2, (len(ok), len(refused))
        for r, _ in ok:
            assert r.json()["usage"]["completion_tokens"] == 48, r.text
        for r, _ in refused:
            assert r.headers["retry-after"] == "2"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "overloaded"
            assert "--max-inflight-requests 4" in err["message"], err
        waits = sorted(s for _, s in refused)
        p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))]
        slowest_ok = max(s for _, s in ok)
        print(f"{len(ok)} admitted (slowest {slowest_ok:.2f}s), {len(refused)} refused, time to reject p50 "
              f"{waits[len(waits) // 2]:.3f}s p99 {p99:.3f}s")
        assert p99 < 1.0, f"p99 time to reject {p99:.3f}s"
        m = srv.get("/metrics").text
        assert metric(m, 'pdserve_rejected_total{reason="requests",role="colocated"}') == len(refused)
        assert metric(m, 'pdserve_admitted_requests{role="colocated"}') == 0  # every ticket given back
        # and it serves normally afterwards
        assert srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_bounds_derive_from_kv_capacity_and_tokens_are_bounded(tokenizer):  # noqa: F811
    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))  # registers 1000 blocks of 16 tokens
        adm = client.app.state.router.dispatcher.admission
        assert adm.limits("colocated") == (1000, 32000)
        assert adm.limits("decode") == (0, 0)
    with router(tokenizer, max_inflight_tokens=5) as client:
        client.add_worker("colocated", "c0")  # never answers: its requests stay in flight
        adm = client.app.state.router.dispatcher.admission
        ids = tokenizer.encode("one two three")
        assert 2 <= len(ids) <= 5
        first = adm.admit("held", ("colocated",), 5)  # one request alone is always admitted
        r = client.post("/v1/completions", json={"prompt": ids})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert "--max-inflight-tokens" in r.json()["error"]["message"]
        first.release()
        assert adm.in_flight == 0 and adm.tokens["colocated"] == 0
        m = client.get("/metrics").text
        assert metric(m, 'pdserve_rejected_total{reason="tokens",role="colocated"}') == 1


def test_no_worker_for_a_role_is_503_with_retry_after(tokenizer):  # noqa: F811
    with router(tokenizer, retry_after_s=3) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))
        r = client.post("/v1/completions", json={"prompt": "Hi", "policy": "disaggregated"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
        err = r.json()["error"]
        assert err["code"] == "no_worker" and "no decode worker" in err["message"]
        assert client.post("/v1/completions", json={"prompt": "Hi", "policy": "colocated"}).status_code == 200
        m = client.get("/metrics").text
        assert metric(m, 'pdserve_rejected_total{reason="no_worker",role="decode"}') == 1
        assert client.app.state.router.dispatcher.admission.in_flight == 0
