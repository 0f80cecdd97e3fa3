"""KV-aware routing (server/kv_route.py, server/kv_index.py): the router sends a request where its prefix
already is, priced in milliseconds from what the workers report.

Live: two colocated tiny workers and 8 conversations of 3 turns; the later turns' history (the full
blocks of the turn before) is served from a cache for >= 90% of its tokens with --routing kv, against
what --routing least-loaded gets in the same test, and both workers serve conversations.
Planner-level: a prefix held only in one worker's host tier is routed there when its measured reload
beats recomputing elsewhere, and elsewhere when it does not (bandwidth forced in the reports).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.protocol import control as P
from pdserve.protocol.blocks import block_names, root_name
from pdserve.protocol.enums import Role
from pdserve.server.admission import Admission
from pdserve.settings.router import RouterConfig
from pdserve.server.job import Job
from pdserve.server.kv_index import ENTRY_BYTES, KVIndex
from pdserve.server.metrics import Metrics
from pdserve.server.pool import WorkerState
from pdserve.server.routing import Planner
from pdserve.workers.engine.prefix_cache import extend_names

ROOT = root_name("tiny", "layout")
BS = 16


# ---- the names and the index -----------------------------------------------------------------------


def test_engine_and_router_name_blocks_alike():
    tokens = list(range(100, 180))
    assert extend_names([], tokens, BS, ROOT) == block_names(tokens, BS, ROOT)  # one function, re-exported
    assert len(block_names(tokens, BS, ROOT)) == 5 and block_names(tokens[:15], BS, ROOT) == []


def events(wid, seq, stored=(), removed=(), reset=False):
    return P.KVEvents(wid, seq, reset, [P.TierNames(t, list(n)) for t, n in stored],
                      [P.TierNames(t, list(n)) for t, n in removed])


def test_index_tiers_gaps_resets_and_bound():
    names = block_names(list(range(64)), BS, ROOT)
    ix = KVIndex(max_bytes=6 * ENTRY_BYTES)
    ix.apply("a", events("a", 0, [("gpu", names), ("host", names[:2])], reset=True))
    assert ix.held("a", names) == ["gpu"] * 4 and ix.held("b", names) == []
    ix.apply("a", events("a", 1, removed=[("gpu", names[:2])]))
    assert ix.held("a", names) == ["host", "host", "gpu", "gpu"]  # the head left the GPU: host memory has it
    ix.apply("a", events("a", 3, [("gpu", names)]))  # report 2 was lost: forget, then take this one
    assert ix.lost_reports == 1 and ix.held("a", names) == ["gpu"] * 4
    ix.apply("b", events("b", 0, [("gpu", names[:3])], reset=True))  # 7 pairs > 6: a holds most, its oldest go
    assert ix.entries == 6 and ix.held("a", names) == []  # the head went: nothing is reachable for a
    assert ix.held("a", names[1:]) == ["gpu"] * 3 and ix.held("b", names) == ["gpu"] * 3
    ix.forget("a")
    ix.forget("b")
    assert ix.entries == 0 and ix.held("a", names) == []
    assert ix.dying == 4 + 6 and ix.reap(4) == 6 and ix.reap() == 0  # (with a's before the gap) freed in slices
    with pytest.raises(P.ProtocolError):  # bounded on the wire: a name is 16 bytes
        P.decode_to_router(P.encode(P.FromWorker("inc", events("a", 0, [("gpu", [b"short"])]))))


# ---- host tier: reload there, or recompute elsewhere ---------------------------------------------------


class Pool:
    address = "tcp://router:7100"

    def __init__(self, *workers):
        self.workers = {w.id: w for w in workers}
        self.kv = KVIndex()

    def alive(self, role):
        return [w for w in self.workers.values() if w.role == role]


def colocated(wid: str, costs: P.KVCosts, inflight: int = 0) -> WorkerState:
    reg = P.Register(P.PROTOCOL_VERSION, wid, Role.COLOCATED, "tcp://127.0.0.1:1", "tiny", 4096, BS, 1000, 1000,
                     "cpu", "float32", 1, block_root=ROOT)
    w = WorkerState(reg, f"inc-{wid}", None, 0.0, 1000)
    w.costs = costs
    w.inflight = {f"{wid}-r{i}" for i in range(inflight)}
    return w


@pytest.mark.parametrize("host_gbps, where", [(100.0, "a"), (0.001, "b")])
def test_host_tier_prefix_goes_where_reload_beats_recompute(host_gbps, where):
    # 1 ms a token to compute; 1 MB of KV a token: 100 GB/s reloads 160 tokens in 1.6 ms, 1 MB/s in 160 s
    a = colocated("a", P.KVCosts(bytes_per_token=10**6, prefill_ms_per_token=1.0, tier_gbps={"host": host_gbps}), inflight=1)
    b = colocated("b", P.KVCosts(bytes_per_token=10**6, prefill_ms_per_token=1.0))
    prompt = list(range(1000, 1170))  # 10 full blocks and 10 tokens
    pool = Pool(a, b)
    pool.kv.apply("a", events("a", 0, [("host", block_names(prompt, BS, ROOT))], reset=True))  # not on any GPU
    pool.kv.apply("b", events("b", 0, reset=True))
    cfg = RouterConfig(model="tiny")
    metrics = Metrics("tiny")
    planner = Planner(cfg, pool, Admission(cfg, pool, metrics), metrics)
    plan = planner.plan(Job("r1", prompt, P.Sampling(max_tokens=1), "colocated"))
    assert plan.worker.id == where
    e = plan.estimate
    if where == "a":  # reload 160 tokens (1.6 ms) + compute 10 + a block's load (16) beats 170 elsewhere
        assert e.cached == {"host": 160} and e.ttft_ms == pytest.approx(1.6 + 10 + 16)
    else:  # the reload would take longer than recomputing: a computes it all too, and is busier
        assert e.cached == {} and e.ttft_ms == pytest.approx(170)
    assert plan.worker.pending == {"r1": e.uncached_tokens}  # ahead of the next request until token 1


def test_a_worker_not_measured_yet_pays_the_fixed_ms_of_the_others():
    # a fitted a line with a fixed part; b has not measured yet (it registered later): b is priced at the
    # others' line, fixed ms included; without it, recomputing the whole prompt on b looked cheaper than
    # a's 16 new tokens by a's fixed ms alone, and a conversation's turn left the worker holding it
    a = colocated("a", P.KVCosts(bytes_per_token=1000, prefill_ms_per_token=0.015, prefill_ms_fixed=7.4))
    b = colocated("b", P.KVCosts(bytes_per_token=1000))
    history = list(range(6000, 6176))  # 11 full blocks on a
    pool = Pool(a, b)
    pool.kv.apply("a", events("a", 0, [("gpu", block_names(history, BS, ROOT))], reset=True))
    pool.kv.apply("b", events("b", 0, reset=True))
    cfg = RouterConfig(model="tiny")
    metrics = Metrics("tiny")
    planner = Planner(cfg, pool, Admission(cfg, pool, metrics), metrics)
    plan = planner.plan(Job("turn", history + list(range(16)), P.Sampling(max_tokens=1), "colocated"))
    assert plan.worker.id == "a" and plan.estimate.cached == {"gpu": 176}
    b_price = planner.plan(Job("cold", list(range(7000, 7192)), P.Sampling(max_tokens=1), "colocated")).estimate
    assert b_price.worker.id == "b" and not b_price.measured  # a has a request ahead now: the cold one goes to b
    assert b_price.fixed_ms == 7.4 and b_price.ttft_ms == pytest.approx(7.4 + 192 * 0.015)


# ---- live: multi-turn conversations on two colocated workers -------------------------------------------

CONVERSATIONS, TURNS = 8, 3
NEW = 16  # tokens each later turn adds: a short reply and question after a long history


def conversation_turns(srv, rounds: int = TURNS) -> tuple[float, set[str], list[dict]]:
    """8 conversations, each turn sent at once for all of them: each turn's prompt is the one before plus
    a reply and a new question (distinct per conversation). Returns the share of the later turns'
    history (the full blocks of the turn before) that came from a cache, the workers that served, and
    the later turns' timings."""
    histories = [[(c * 997 + i * 31) % 900 + 5 for i in range(160)] for c in range(CONVERSATIONS)]
    history_tokens = cached = 0
    served, later = set(), []
    held: dict[str, set[tuple[int, int]]] = {}  # worker -> (conversation, block) its pool holds: all it served

    def send(prompt):
        r = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["timings"]

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        for turn in range(rounds):
            if turn:
                for c, h in enumerate(histories):
                    h += [(c * 13 + turn * 7 + i) % 900 + 5 for i in range(NEW)]  # the reply and the next question
            times = list(pool.map(send, [list(h) for h in histories]))
            for c, t in enumerate(times):
                served.add(t["worker"])
                held.setdefault(t["worker"], set()).update((c, b) for b in range(len(histories[c]) // BS))
                if turn:
                    full = (len(histories[c]) - NEW) // BS * BS  # what the turn before could leave cached
                    history_tokens += full
                    cached += min(full, t["cached_tokens"] or 0)
                    later.append(t)
            # the router's index lists every block on the worker that served it (from the first token on,
            # then the workers' reports): per worker, as a sum over both would pass with one's names missing
            # while the other holds a conversation twice (served there by the load rule)
            srv.wait_for(lambda h: all(w.get("kv_blocks_indexed", 0) >= len(held.get(w["id"], ()))
                                       for w in h["workers"]), timeout=20, what="the workers' block reports")
    return cached / history_tokens, served, later


def test_multiturn_history_served_from_cache_against_least_loaded():
    from test_server_harness import TINY, Pdserve

    common = (*TINY, "--prefill-workers", "0", "--decode-workers", "0", "--colocated-workers", "2",
              "--policy", "colocated", "--heartbeat-interval", "0.2", "--heartbeat-misses", "50")
    with Pdserve(*common, "--routing", "least-loaded") as srv:
        ll_share, _, _ = conversation_turns(srv, 2)
    with Pdserve(*common) as srv:
        kv_share, served, later = conversation_turns(srv)
        metrics = srv.get("/metrics").text
    print(f"later turns' history from a cache: kv {kv_share:.0%}, least-loaded {ll_share:.0%}")
    misses = [(t["worker"], t["prompt_tokens"], t["cached_tokens"], t["route"]) for t in later
              if t["cached_tokens"] < t["prompt_tokens"] - 2 * NEW]
    assert kv_share >= 0.9, (kv_share, ll_share, misses)
    assert kv_share >= ll_share  # least-loaded lands on the holder by chance only (about half the time)
    assert len(served) == 2  # both workers serve conversations
    routes = [t["route"] for t in later]
    assert all(r["rule"] == "kv" and r["worker"] == t["worker"] for r, t in zip(routes, later))
    assert sum(r["expected_device_tokens"] for r in routes) >= 0.9 * sum(t["cached_tokens"] for t in later)
    assert 'pdserve_routed_total{rule="kv"}' in metrics


def test_auto_decides_from_cached_prefix_and_queues():
    costs = P.KVCosts(bytes_per_token=1000, prefill_ms_per_token=1.0)
    co = colocated("co", costs)
    pre = WorkerState(P.Register(P.PROTOCOL_VERSION, "pre", Role.PREFILL, "tcp://127.0.0.1:2", "tiny", 4096, BS, 1000,
                                 1000, "cpu", "float32", 1, "ipc", "bulk", block_root=ROOT), "inc-pre", None, 0.0, 1000)
    dec = WorkerState(P.Register(P.PROTOCOL_VERSION, "dec", Role.DECODE, "tcp://127.0.0.1:3", "tiny", 4096, BS, 1000,
                                 1000, "cpu", "float32", 1, "ipc", "bulk", "tcp://127.0.0.1:4", block_root=ROOT),
                      "inc-dec", None, 0.0, 1000)
    pre.costs = dec.costs = costs
    pool = Pool(co, pre, dec)
    for w in (co, pre, dec):
        pool.kv.apply(w.id, events(w.id, 0, reset=True))
    cfg = RouterConfig(model="tiny", auto_threshold=64)
    metrics = Metrics("tiny")
    planner = Planner(cfg, pool, Admission(cfg, pool, metrics), metrics)
    cold, warm = list(range(2000, 2300)), list(range(3000, 3300))
    pool.kv.apply("co", events("co", 1, [("gpu", block_names(warm, BS, ROOT))]))
    plan = planner.plan(Job("warm", warm, P.Sampling(max_tokens=1), "auto"))  # 12 tokens left: small
    assert plan.policy == "colocated" and plan.job.auto.startswith("colocated: co holds all but 12 tokens")
    plan = planner.plan(Job("cold", cold, P.Sampling(max_tokens=1), "auto"))  # 300 to compute, no queues
    assert plan.policy == "disaggregated" and plan.job.auto.startswith("disaggregated: queue ahead")
    pre.pending["earlier"] = 5000  # P has 5000 prompt tokens to compute first
    plan = planner.plan(Job("busy", cold[1:] + [7], P.Sampling(max_tokens=1), "auto"))
    assert plan.policy == "colocated" and "prefill 5300.0 ms (pre)" in plan.job.auto  # and the cold one's 300
    got = {(s.labels["policy"], s.labels["reason"]): s.value for m in metrics.auto_decisions.collect()
           for s in m.samples if s.name.endswith("_total")}
    assert got == {("colocated", "small_prefill"): 1, ("disaggregated", "disaggregate"): 1, ("colocated", "queue"): 1}


def test_a_decode_reservation_reloads_its_prefix_from_host_memory():
    """Deliver 4: a decode worker's reserve takes a prefix held only in its host tier (reloaded), so the
    prefill worker skips sending it; every block comes back."""
    from test_prefix_tiers import engine, evict_everything, prompt
    from pdserve.workers.engine.request import Request, SamplingParams

    eng = engine()
    p = prompt(7, 70)
    eng.generate([p], SamplingParams(max_tokens=2, ignore_eos=True))
    evict_everything(eng, p)
    req = Request("reserved", p + [3], SamplingParams(max_tokens=2))
    eng.admit(req)
    blocks = eng.reserve(req.request_id, len(req.prompt_ids))
    assert blocks is not None and req.cached_tokens == 64 and req.tier_tokens == {"host": 64}
    eng.abort(req.request_id)
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests
    eng.close()


def test_a_worker_fits_its_prefill_time_as_a_line():
    from types import SimpleNamespace

    from pdserve.workers.engine.request import Stamps
    from pdserve.workers.roles.kv_report import KVReport

    report = KVReport(engine=None, worker_id="w")
    assert report.prefill_model() == (None, 0.0)

    def prefill(tokens: int, cached: int, ms: float):
        report.observe(SimpleNamespace(prompt_ids=[1] * (tokens + cached), cached_tokens=cached,
                                       stamps=Stamps(prefill_start=100.0, prefill_end=100.0 + ms / 1e3)))
    prefill(300, 0, 10 + 0.1 * 300)
    assert report.prefill_model() == pytest.approx((40 / 300, 0.0))  # one size: time over tokens
    for tokens in (36, 300, 52, 20):  # a turn's new tokens after a cached history, and first turns
        prefill(tokens, 320, 10 + 0.1 * tokens)
    assert report.prefill_model() == pytest.approx((0.1, 10.0))


def test_a_hot_prefix_spreads_past_the_load_rule():
    costs = P.KVCosts(bytes_per_token=1000, prefill_ms_per_token=1.0)
    a, b = colocated("a", costs), colocated("b", costs)
    pool = Pool(a, b)
    hot = list(range(5000, 5400))
    pool.kv.apply("a", events("a", 0, [("gpu", block_names(hot, BS, ROOT))], reset=True))
    pool.kv.apply("b", events("b", 0, reset=True))
    cfg = RouterConfig(model="tiny")
    metrics = Metrics("tiny")
    planner = Planner(cfg, pool, Admission(cfg, pool, metrics), metrics)
    went = []
    for i in range(8):  # none finishes: each stays in flight where it went
        plan = planner.plan(Job(f"r{i}", hot + [i], P.Sampling(max_tokens=1), "colocated"))
        plan.worker.inflight.add(f"r{i}")
        went.append(plan.worker.id)
    # a takes the hot prefix while its requests in flight are at most twice b's plus four; past that, b
    assert went == ["a"] * 5 + ["b"] + ["a"] * 2, went
