"""/health says "degraded" (HTTP 200: it still serves) while a role has fewer live workers than
configured, "ok" once the count is back, "unavailable" (503) when nothing can serve; against fake
workers (tests/test_server_router.py). The launcher's own counts: tests/test_server_faults.py."""

from __future__ import annotations

import time

from pdserve.settings.router import expected_counts
from test_server_router import HEARTBEAT_S, MISSES, colocated_echo, router, tokenizer  # noqa: F401


def wait_status(client, status: str, timeout: float = 5.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        r = client.get("/health")
        if r.json()["status"] == status or time.monotonic() > end:
            return r
        time.sleep(0.05)


def test_health_is_degraded_while_a_role_is_below_its_count(tokenizer):  # noqa: F811
    with router(tokenizer, expected_workers={"colocated": 2, "decode": 1}) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        client.add_worker("colocated", "c0", colocated_echo(1))
        r = client.get("/health")
        body = r.json()
        assert r.status_code == 200 and body["status"] == "degraded", body
        assert body["missing"] == {"colocated": 1, "decode": 1}
        assert "colocated 1 missing of 2" in body["message"] and "decode 1 missing of 1" in body["message"]
        assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200  # degraded still serves
        c1 = client.add_worker("colocated", "c1", colocated_echo(1))
        client.add_worker("decode", "d0")
        r = client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok" and "missing" not in r.json()
        c1.silent.set()  # dropped after MISSES heartbeats: below the count again
        r = wait_status(client, "degraded", HEARTBEAT_S * MISSES + 2)
        assert r.status_code == 200 and r.json()["missing"] == {"colocated": 1}, r.json()


def test_without_configured_counts_any_live_worker_is_ok(tokenizer):  # noqa: F811
    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))
        assert client.get("/health").json()["status"] == "ok"


def test_expect_workers_flag():
    assert expected_counts("prefill=2,decode=3") == {"prefill": 2, "decode": 3}
    assert expected_counts(None) is None


def test_a_worker_whose_process_exited_is_dropped_at_once(tokenizer):  # noqa: F811
    """pdserve's supervisor reports an exit (pool.lost): that worker goes now, not at the heartbeat
    timeout; a report naming another pid (a later incarnation under the same id) drops nothing."""
    with router(tokenizer, expected_workers={"colocated": 1}) as client:
        c0 = client.add_worker("colocated", "c0", colocated_echo(1))
        pool = client.app.state.router.pool
        client.portal.call(pool.lost, "c0", 1, "its process (pid 1) exited")  # fake workers say pid 4242
        assert "c0" in pool.workers and client.get("/health").json()["status"] == "ok"
        c0.silent.set()  # as a dead process: it does not register again
        client.portal.call(pool.lost, "c0", 4242, "its process (pid 4242) was killed by SIGKILL")
        r = client.get("/health")
        assert "c0" not in pool.workers and r.status_code == 503 and r.json()["missing"] == {"colocated": 1}
