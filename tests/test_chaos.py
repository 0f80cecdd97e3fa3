"""Chaos, bounded in time: a load of mixed requests (colocated and disaggregated, streamed and not)
while a script SIGKILLs and SIGSTOPs/SIGCONTs random workers of a pdserve with restarts on.

    every request ends (tokens, or an error object) within its deadline: none hangs
    the errors are the ones a fault explains (worker_lost, no_worker, transfer_error, ...), never an
        internal error or a malformed answer
    afterwards: every worker back (restarted or continued), 0 leaked KV blocks on every worker
        (free_blocks == num_blocks in /health), and the router serves both policies normally
Prints the counts: requests, kills, stops, outcomes by kind, the longest time to an error.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from test_server_harness import TINY, Pdserve

pytestmark = pytest.mark.timeout(240)

CHAOS_S = 20.0  # the faults' part of the run
KILL_SHARE = 0.4  # of the faults; the rest SIGSTOP a worker for a few seconds
DEADLINE_S = 20.0  # a request's deadline, from the client: kv-deadline 8 s + 5, token timeout 8 s, with margin
CLIENTS = 4
FAULT_KINDS = {"worker_lost", "no_worker", "transfer_error", "timeout", "no_capacity", "aborted_error"}
MESSAGES: dict[str, str] = {}  # an error kind -> the message of one of them (for the failure text)
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
           "Paged attention keeps the KV cache in fixed-size blocks so that " * 4]


def random_request(url: str, rng: random.Random) -> tuple[str, float]:
    return request(url, rng.choice(["colocated", "disaggregated"]), rng.random() < 0.5, rng.choice(PROMPTS),
                   rng.randint(4, 48))


def request(url: str, policy: str, stream: bool, prompt: str = PROMPTS[0], max_tokens: int = 8) -> tuple[str, float]:
    """(its outcome: "ok" or "<status or stream>:<the error's code>", seconds it took)"""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "policy": policy, "stream": stream}
    start = time.monotonic()
    try:
        with httpx.Client(timeout=DEADLINE_S) as c:
            if not stream:
                r = c.post(url + "/v1/completions", json=body)
                kind = "ok" if r.status_code == 200 else f"{r.status_code}:{r.json()['error']['code']}"
                MESSAGES[kind] = "" if kind == "ok" else r.json()["error"]["message"]
                if kind == "ok":
                    assert r.json()["usage"]["completion_tokens"] == body["max_tokens"], r.text
            else:
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        kind = f"{r.status_code}:{r.json()['error']['code']}"
                        MESSAGES[kind] = r.json()["error"]["message"]
                    else:
                        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                        assert events[-1] == "[DONE]", events[-3:]
                        last = json.loads(events[-2])
                        kind = f"stream:{last['error']['code']}" if "error" in last else "ok"
                        MESSAGES[kind] = last["error"]["message"] if "error" in last else ""
    except httpx.TimeoutException:
        kind = "HUNG"
    return kind, time.monotonic() - start


def test_chaos_every_request_ends_no_block_leaks_and_serving_goes_on():
    rng = random.Random(14)
    began = time.monotonic()
    with Pdserve(*TINY, "--heartbeat-interval", "0.5", "--heartbeat-misses", "3", "--kv-deadline", "8",
                 "--token-timeout", "8", "--drain-timeout", "5") as srv:
        outcomes: list[tuple[str, float]] = []
        stop_load = threading.Event()

        def client(seed: int) -> None:
            crng = random.Random(seed)
            while not stop_load.is_set():
                outcomes.append(random_request(srv.url, crng))
                if outcomes[-1][0].startswith(("503:", "429:")):
                    stop_load.wait(1.0)  # as its Retry-After says

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in clients:
            t.start()

        kills = stops = 0
        stopped: dict[int, float] = {}  # pid -> when to SIGCONT it
        end = time.monotonic() + CHAOS_S
        while time.monotonic() < end:
            time.sleep(rng.uniform(1.0, 2.0))
            for pid, at in list(stopped.items()):
                if time.monotonic() >= at:
                    os.kill(pid, signal.SIGCONT)
                    del stopped[pid]
            registered = srv.health()["workers"]
            live = [w for w in registered if w["pid"] not in stopped]
            if not live:
                continue
            victim = rng.choice(live)
            # a restart takes ~10-20 s of this shared CPU: one at a time, and none so late that the
            # recovery would run past the test's time bound
            may_kill = len(registered) == 3 and time.monotonic() < end - 8.0
            if may_kill and rng.random() < KILL_SHARE:
                os.kill(victim["pid"], signal.SIGKILL)
                kills += 1
            else:
                os.kill(victim["pid"], signal.SIGSTOP)  # silent: the router drops it after 1.5 s of no heartbeats
                stopped[victim["pid"]] = time.monotonic() + rng.uniform(1.5, 3.0)
                stops += 1
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stop_load.set()
        for t in clients:
            t.join(DEADLINE_S + 5)
        assert not any(t.is_alive() for t in clients), "a client is still waiting: a request hangs"

        kinds = collections.Counter(kind for kind, _ in outcomes)
        errors = [took for kind, took in outcomes if kind != "ok"]
        print(f"\nchaos: {len(outcomes)} requests, {kills} kills, {stops} stops; outcomes {dict(kinds)}; "
              f"longest time to an error {max(errors, default=0):.2f}s, longest request "
              f"{max(took for _, took in outcomes):.2f}s")
        assert "HUNG" not in kinds, kinds
        assert all(took < DEADLINE_S for _, took in outcomes)
        unexplained = {k for k in kinds if k != "ok" and k.split(":")[1] not in FAULT_KINDS}
        assert kills >= 1 and stops >= 3 and kinds["ok"] >= 5, (kills, stops, kinds)
        assert not unexplained, f"errors no fault explains: {[(k, MESSAGES[k]) for k in unexplained]}"

        def recovered(h):
            return (h["status"] == "ok" and len(h["workers"]) == 3
                    and all(w["free_blocks"] == w["num_blocks"] and w["in_flight"] == 0 for w in h["workers"]))

        start = time.monotonic()
        h = srv.wait_for(recovered, timeout=90, what="every worker back, every KV block free")
        print(f"recovered {time.monotonic() - start:.1f}s after the chaos ({time.monotonic() - began:.0f}s into the "
              f"test): "
              + ", ".join(f"{w['id']} {w['free_blocks']}/{w['num_blocks']} blocks free" for w in h["workers"]))
        for policy in ("colocated", "disaggregated"):
            for stream in (False, True):
                kind, took = request(srv.url, policy, stream)
                assert kind == "ok" and took < 5.0, (policy, stream, kind, took)
