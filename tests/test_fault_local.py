"""Faults stay local: with one prefill and two decode workers, SIGKILLing the decode worker that serves
a request (a stream, with more requests bound for it arriving) does not delay the requests bound for
the other one. Before, the prefill worker shook hands with the dead peer for up to 30 s inside its
loop, and a request for the healthy decode worker waited 31.7 s.

    baseline   while a stream runs on decode A and a burst of requests on both: short probes, their TTFT
    the kill   the same again, and SIGKILL A while it streams and holds some of the burst
    after      every request ends at once (tokens, or an error for those A held), and the probes (B
               serves them) have a TTFT within 2x of the baseline; every surviving worker's blocks come back
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from test_server_harness import TINY, Pdserve
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.settings.worker import TransferConfig
from pdserve.workers.transfer.base import PeerState
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_receiver, make_sender

pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks " * 12  # ~130 tokens: a few blocks to move
BURST_TOKENS = 400  # long enough that the burst is still running when /health is polled
SLACK_MS = 50.0  # CPU noise on a shared machine; the fault this guards against cost 30,000 ms


LAYOUT = KVLayout(2, 2, 8, "float32", 16, 32)


def test_a_silent_peer_never_makes_the_sender_wait():
    """The sender's non-blocking calls against a peer that takes connections and never answers (a
    stopped process) beside a live one: every call returns at once; the silent peer's handshake ends
    at the deadline (DEAD, and then requests to it fail at once); a transfer waiting for a silent
    accept is polled, and fails at its deadline; the live peer's transfers go through meanwhile."""
    import zmq

    ctx = zmq.Context()
    hole = ctx.socket(zmq.ROUTER)  # accepts, reads nothing, answers nothing
    port = hole.bind_to_random_port("tcp://127.0.0.1")
    silent = f"tcp://127.0.0.1:{port}"
    dst, src = KVCache(LAYOUT, "cpu", shared=True), KVCache(LAYOUT, "cpu")
    src.pool.normal_()
    recv = make_receiver(dst, TransferConfig(transport="zmq", deadline_s=5))
    send = make_sender(src, TransferConfig(transport="zmq", deadline_s=1.0))
    try:
        start = time.monotonic()
        assert send.reach(silent)[0] is PeerState.CONNECTING
        assert send.reach(recv.address)[0] is PeerState.CONNECTING
        assert time.monotonic() - start < 0.05
        while send.reach(recv.address)[0] is not PeerState.READY:
            assert time.monotonic() - start < 1.0, "the live peer's handshake waited for the silent one"
            time.sleep(0.005)
        for i in range(3):  # transfers to the live peer, polled, while the silent one hangs
            recv.expect(f"ok{i}", [4 + i], deadline_s=5)
            t = send.open(f"ok{i}", recv.address, [i], [4 + i], 16)
            t.start_finish(first_token=7, deadline_s=5)
            while (stats := t.poll()) is None:
                assert time.monotonic() - start < 1.0
                time.sleep(0.001)
            assert stats.num_bytes == LAYOUT.num_layers * LAYOUT.block_bytes
        assert send.reach(silent)[0] is PeerState.CONNECTING
        while (state := send.reach(silent))[0] is PeerState.CONNECTING:
            assert time.monotonic() - start < 3.0
            time.sleep(0.01)
        state, why = state
        took = time.monotonic() - start
        assert state is PeerState.DEAD and "no handshake answer within 1.0 s" in why and 0.9 < took < 2.0, (why, took)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="unreachable"):
            send.open("lost", silent, [1], [1], 16)
        assert time.monotonic() - t0 < 0.05  # detected once: no second wait

        recv._on_begin = lambda ident, msg: None  # the live peer stops answering (as if SIGSTOPped)
        recv.expect("never", [9], deadline_s=5)
        t = send.open("never", recv.address, [1], [9], 16)
        t.start_finish(first_token=7, deadline_s=0.5)
        t0 = time.monotonic()
        polls = 0
        with pytest.raises(TransferError, match="accept within the deadline"):
            while t.poll() is None:
                polls += 1
                time.sleep(0.001)
        assert 0.45 < time.monotonic() - t0 < 1.0 and polls > 50  # each poll returned at once
        for i in range(3):
            assert torch.equal(dst.pool[:, 4 + i], src.pool[:, i])
    finally:
        send.close(), recv.close(), dst.close(), hole.close(0), ctx.term()


def one(url: str, max_tokens: int = 4) -> tuple[float, str | None, float | None, str | None]:
    """(seconds it took, the decode worker that served it, its TTFT in ms; or the error code)"""
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                                                  "policy": "disaggregated"}, timeout=120)
    took = time.monotonic() - start
    if r.status_code != 200:
        return took, None, None, r.json()["error"]["code"]
    t = r.json()["timings"]
    return took, t["worker"], t["ttft_ms"], None


def test_killing_one_decode_worker_does_not_delay_requests_for_the_other():
    with Pdserve(*TINY, "--decode-workers", "2", "--colocated-workers", "0", "--transport", "zmq",
                 "--no-restart", "--drain-timeout", "5") as srv:
        # each phase starts its own stream, so the victim holds it (and some of the burst). It has 100-200
        # tokens out by the kill and by the probes' end (decode steps, whatever the machine's speed): 1000
        # outlast both; the baseline's stream, which runs to its end, checks that it outlived its probes
        long = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "policy": "disaggregated", "stream": True}

        def start_stream() -> tuple[threading.Thread, list, dict]:
            events: list = []
            started = threading.Event()

            def stream() -> None:
                for _, event in srv.stream("/v1/completions", long):
                    events.append(event)
                    if len(events) == 3:
                        started.set()

            streamer = threading.Thread(target=stream, daemon=True)
            streamer.start()
            assert started.wait(60)
            [victim] = [w for w in srv.health()["workers"] if w["role"] == "decode" and w["in_flight"] == 1]
            return streamer, events, victim

        for _ in range(2):  # warm both paths
            one(srv.url)

        def under_load(kill: bool) -> tuple[list, list, list, int, dict]:
            """A stream, a burst of longer requests (the least-loaded choice sends some to the stream's
            worker, the victim), and while they run, probes one after another: (the burst's results, the
            probes', the stream's events, how many of them had come when the probes ended, the victim)."""
            streamer, events, victim = start_stream()
            with ThreadPoolExecutor(8) as pool:
                burst = [pool.submit(one, srv.url, BURST_TOKENS) for _ in range(8)]
                srv.wait_for(lambda h: any(w["id"] == victim["id"] and w["in_flight"] >= 2 for w in h["workers"]),
                             timeout=20, what="requests of the burst on the victim")
                if kill:
                    os.kill(victim["pid"], signal.SIGKILL)
                probes = [one(srv.url) for _ in range(6)]
                streamed = len(events)
                results = [f.result() for f in burst]
            streamer.join(30)
            return results, probes, events, streamed, victim

        _, baseline, events, streamed, _ = under_load(kill=False)
        assert all(err is None for *_, err in baseline), baseline
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
        assert streamed < long["max_tokens"], "the stream ended before the probes: they ran under a lighter load"
        normal = statistics.median(ttft for _, _, ttft, _ in baseline)
        killed = time.monotonic()
        burst, after, events, _, victim = under_load(kill=True)
        survivor = ({"decode-0", "decode-1"} - {victim["id"]}).pop()
        results = burst + after
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_lost", events[-2:]
        assert time.monotonic() - killed < 30

        served = [r for r in results if r[3] is None]
        failed = [r for r in results if r[3] is not None]
        late = [r[2] for r in after if r[3] is None]
        print(f"probes' TTFT before the kill {sorted(round(r[2]) for r in baseline)} ms (median {normal:.0f}), after "
              f"it {sorted(round(t) for t in late)} ms; {len(failed)} failed ({sorted(set(r[3] for r in failed))}, "
              f"the slowest after {max((r[0] for r in failed), default=0):.2f} s)")
        assert failed and all(r[0] < 5.0 for r in failed), failed  # the victim's fail fast, never at a deadline
        # a probe sent before the router learnt of the death may go to the victim: it fails fast too; every
        # later one goes to the survivor
        assert all(r[1] == survivor for r in after[2:]), after
        assert len(late) >= 4, after
        assert statistics.median(late) <= 2 * normal + SLACK_MS, (late, normal)
        assert max(late) <= 4 * normal + 4 * SLACK_MS, (late, normal)

        def settled(h):
            return (len(h["workers"]) == 2 and h["status"] == "degraded"
                    and all(w["free_blocks"] == w["num_blocks"] for w in h["workers"]))

        srv.wait_for(settled, timeout=15, what="the prefill worker's and the survivor's blocks all back")
