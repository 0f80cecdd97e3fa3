"""The router's KV index (server/kv_index.py) under load: it lists only what the workers said (a request
they refuse leaves nothing), its memory stays within the bytes its docs state (measured here with
tracemalloc), and forgetting a worker that holds many names does not stall the router (/health is
answered meanwhile)."""

from __future__ import annotations

import asyncio
import os
import time
import tracemalloc

import httpx

from test_server_router import router, tokenizer  # noqa: F401  (a fixture)
from pdserve.protocol import control as P
from pdserve.protocol.blocks import block_names, root_name
from pdserve.server import kv_index
from pdserve.server.kv_index import KVIndex

ROOT = root_name("tiny", "layout")
BS = 16
DOCUMENTED_BYTES = 512 * 2**20  # the index's bound as the docs state it (~0.5 GB)


def reports(worker_id: str, n: int, first_seq: int = 0, salt: bytes = b""):
    """KVEvents storing n fresh names, decoded off the wire as the router gets them (each name a bytes of
    its own), MAX_KV_NAMES a report."""
    seq, left = first_seq, n
    while left:
        k = min(left, P.MAX_KV_NAMES)
        names = [os.urandom(16) for _ in range(k)]
        frame = P.encode(P.FromWorker("inc", P.KVEvents(worker_id, seq, False, [P.TierNames("gpu", names)])))
        yield frame
        seq, left = seq + 1, left - k


def test_the_index_takes_at_most_its_documented_bytes():
    """Measured: the bytes an entry keeps (its name and its slot), at every fill level up to just past
    a table resize (where an entry costs the most); times the entries the default bound allows, that is
    within the documented 512 MiB. Then a small budget, filled three times over, holds to its bytes."""
    tracemalloc.start()
    try:
        ix = KVIndex()
        ix.register("a")
        base = tracemalloc.get_traced_memory()[0]
        worst, n = 0.0, 0
        for frame in reports("a", 180_000):  # the OrderedDict's table doubles at 174,763 entries
            ix.apply("a", P.decode_to_router(frame).msg)
            n = ix.entries
            if n >= 20_000:
                worst = max(worst, (tracemalloc.get_traced_memory()[0] - base) / n)
        assert n == 180_000
        print(f"KV index: at most {worst:.1f} bytes an entry; the default bound {ix.max_entries} entries, "
              f"{worst * ix.max_entries / 2**20:.0f} MiB")
        assert worst * ix.max_entries <= DOCUMENTED_BYTES, (worst, ix.max_entries)
        del ix

        budget = 4 * 2**20
        small = KVIndex(max_bytes=budget)
        small.register("a")
        base = tracemalloc.get_traced_memory()[0]
        most = 0
        for frame in reports("a", 3 * budget // 128):  # three times what the budget holds, at least
            small.apply("a", P.decode_to_router(frame).msg)
            most = max(most, tracemalloc.get_traced_memory()[0] - base)
        print(f"a {budget >> 20} MiB budget filled three times over: at most {most / 2**20:.2f} MiB, "
              f"{small.entries} entries")
        assert 0 < small.entries <= small.max_entries and most <= budget, (small.entries, most)
    finally:
        tracemalloc.stop()


def test_the_bound_takes_from_the_worker_holding_most():
    ix = KVIndex(max_bytes=60 * kv_index.ENTRY_BYTES)
    big, small = ([os.urandom(16) for _ in range(n)] for n in (50, 20))
    ix.apply("big", P.KVEvents("big", 0, True, [P.TierNames("gpu", big)]))
    ix.apply("big", P.KVEvents("big", 1, False, [P.TierNames("host", big[:5])]))  # reported again: recent
    ix.apply("small", P.KVEvents("small", 0, True, [P.TierNames("gpu", small)]))
    assert ix.entries == ix.max_entries == 60
    assert ix.names_of("small") == 20 and ix.names_of("big") == 40  # big's 10 least recently reported went
    assert ix.held("big", big[:5]) == ["gpu"] * 5 and ix.held("big", big[5:15]) == []
    assert ix.held("big", big[15:]) == ["gpu"] * 35 and ix.held("small", small) == ["gpu"] * 20


def test_refused_requests_leave_nothing_in_the_index(tokenizer):  # noqa: F811
    """A worker that refuses every request (503 at capacity) gets none of their block names listed; the
    one request it takes has its prompt's names listed at once (its next turn is routed there before
    the worker's own report comes)."""
    def on_message(w, msg):
        if isinstance(msg, P.Generate) and msg.prompt_ids[0] == 1:
            w.send(P.RequestFailed(w.worker_id, msg.request_id, "capacity", "scripted: no room"))
        elif isinstance(msg, P.Generate):
            w.tokens(msg.request_id, [100, 101])

    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", on_message, block_root=ROOT)
        kv = client.app.state.router.pool.kv
        assert kv.reporting("c0")
        for i in range(40):  # 40 distinct prompts of 3 full blocks
            prompt = [1] + [(i * 47 + j) % 900 + 5 for j in range(47)]
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 503 and "no room" in r.json()["error"]["message"], r.text
        assert kv.entries == 0 and kv.names_of("c0") == 0
        taken = [2] + list(range(200, 247))
        r = client.post("/v1/completions", json={"prompt": taken, "max_tokens": 2})
        assert r.status_code == 200, r.text
        names = block_names(taken, BS, ROOT)
        assert kv.held("c0", names) == ["gpu"] * 3 and kv.entries == 3
        health = client.get("/health").json()
        assert [w["kv_blocks_indexed"] for w in health["workers"]] == [3]


def test_forgetting_a_worker_with_many_names_keeps_health_answering(tokenizer):  # noqa: F811
    """800k names of one worker, which is then lost: /health, asked on the router's event loop right after
    (its time counted from the drop), answers within 0.2 s, and so does every one asked while their
    memory is freed (forgetting them all at once held the event loop for about 1 s here)."""
    with router(tokenizer) as client:
        c0 = client.add_worker("colocated", "c0", block_root=ROOT)
        client.add_worker("colocated", "c1", block_root=ROOT)
        app = client.app
        pool = app.state.router.pool
        names = [i.to_bytes(16, "big") for i in range(800_000)]
        client.portal.call(lambda: pool.kv.apply("c0", P.KVEvents("c0", 0, True, [P.TierNames("gpu", names)])))
        del names
        assert pool.kv.names_of("c0") == 800_000
        c0.silent.set()  # it is gone: no heartbeat will register it again

        http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")

        async def drop_and_ask() -> tuple[float, list[str]]:
            start = time.monotonic()
            pool.lost("c0", 4242, "scripted: its process exited")
            r = await http.get("/health")
            assert r.status_code == 200
            return time.monotonic() - start, [w["id"] for w in r.json()["workers"]]

        async def ask_while_freeing() -> list[float]:
            latencies = []
            while pool.kv.dying and len(latencies) < 500:
                await asyncio.sleep(0.001)  # a client's next request (in process, one may finish without yielding)
                start = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.monotonic() - start)
            return latencies

        first, workers = client.portal.call(drop_and_ask)
        assert first < 0.2, f"/health took {first:.3f}s after the router forgot a worker's names"
        assert workers == ["c1"]
        latencies = client.portal.call(ask_while_freeing)
        client.portal.call(http.aclose)
        print(f"/health while forgetting 800k names: the first {first * 1e3:.1f} ms after the drop, then at most "
              f"{max(latencies, default=0) * 1e3:.1f} ms over {len(latencies)} requests while they were freed")
        assert max(latencies, default=0) < 0.2, latencies
        assert pool.kv.dying == 0 and pool.kv.entries == 0 and pool.kv.names_of("c0") == 0


def test_a_full_report_keeps_the_names_accepted_since_the_last_report():
    """A full report's snapshot can predate a request whose first token came first (they travel on different
    sockets): the names accepted since the worker's last report stay; older ones follow the snapshot."""
    ix = KVIndex()
    ix.register("w")
    old, new, snap = ([os.urandom(16) for _ in range(3)] for _ in range(3))

    def report(seq: int, names: list[bytes], reset: bool = False) -> P.KVEvents:
        return P.KVEvents("w", seq, reset, [P.TierNames("gpu", names)] if names else [])

    ix.accepted("w", old)  # before the first report, which lists them
    ix.apply("w", report(0, snap + old, reset=True))
    ix.accepted("w", new)  # its first token came before the next full report, whose snapshot lacks them
    ix.apply("w", report(1, snap, reset=True))
    assert ix.held("w", snap + new) == ["gpu"] * 6
    assert ix.held("w", old) == []  # accepted before the last report: the snapshot decides (evicted since)
    ix.apply("w", report(2, [], reset=True))  # a later full report: its snapshot decides for `new` too
    assert ix.held("w", new) == [] and ix.entries == 0
    ix.accepted("w", new)
    ix.forget("w")  # a worker forgotten keeps nothing it had accepted
    ix.register("w")
    ix.apply("w", report(0, [], reset=True))
    assert ix.held("w", new) == [] and ix.entries == 0
