"""Prometheus metrics of one router (its own registry, so several routers can live in one process).

Three families, every one on /metrics:
    vllm:*      vLLM's names, units, buckets and meanings (vllm/v1/metrics/loggers.py), each series with
                `model_name` (the served model), so vLLM's Grafana dashboards and alerts read pdserve as
                they read `vllm serve`. Where vLLM has `engine`, pdserve says which: `policy` on the
                per-request series, `worker` and `role` on the per-worker gauges. Sums over workers
                count a disaggregated request on its prefill and on its decode worker.
    pdserve_*   pdserve's own: P/D phases, KV transfer, admission, workers, the control plane
    pdserve_*   the KV tiers and their prefix cache (observe_kv_tiers), fed from worker heartbeats

Who feeds what (all on the router's event loop):
    pool        worker_registered (Register), worker_seen (each Heartbeat), worker_gone (dropped)
    dispatch    first_token, next_token (as each token is handed to the response),
                observe_timings (a finished request's `timings`), request_ended (every request, once)
    admission   admitted, admitted_tokens, rejected (the pdserve_ gauges and counter directly)
    (the lead)  observe_kv_tiers(worker, role, stats) with a heartbeat's KV-tier counters
    pool        observe_faults (a decode worker's heartbeat: fenced waits and blocks, integrity failures),
                restarts (a known worker id registered by a new process)
    routing     failovers (--failover), migrations (--migrate)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.protocol import phases as PH
from pdserve.protocol.timings import Timings

# seconds: sub-millisecond transfers up to minute-long requests
_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PHASE = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 120.0)
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so quantiles over a mixed fleet line up
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
# vLLM's finished_reason values (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
ABORTED_OUTCOMES = ("cancelled", "shutting_down")  # pdserve outcomes vLLM would call "abort"

CONTENT_TYPE = CONTENT_TYPE_LATEST


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


_TOKENS = one_two_five(1 << 21)  # protocol/control.py MAX_PROMPT_TOKENS


class Metrics:
    def __init__(self, model_name: str = "unknown"):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self._vllm(r)
        self.requests = Counter("pdserve_requests", "Requests finished, by policy and outcome",
                                ["policy", "outcome"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served", registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", ["policy"], buckets=_SLOW, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "Time between tokens", ["policy"], buckets=_FAST, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "Request latency", ["policy"], buckets=_SLOW, registry=r)
        self.queue = Histogram("pdserve_queue_seconds", "Arrival to prefill start, less the request's flight "
                               "(parse + route + inbox + prefill_queue)", ["policy"], buckets=_SLOW, registry=r)
        self.prefill = Histogram("pdserve_prefill_seconds", "Prefill time", ["policy"], buckets=_SLOW, registry=r)
        self.transfer = Histogram("pdserve_transfer_seconds", "KV transfer time (first copy to last)",
                                  ["transport", "mode"], buckets=_FAST, registry=r)
        self.transfer_exposed = Histogram("pdserve_transfer_exposed_seconds",
                                          "KV transfer time not hidden behind prefill", ["transport", "mode"],
                                          buckets=_FAST, registry=r)
        self.ttft_phase = Histogram(
            "pdserve_ttft_phase_seconds", "Time to first token by phase (they sum to pdserve_ttft_seconds): "
            + "; ".join(f"{p.name}: {p.meaning}" for p in PH.PHASES), ["policy", "phase"], buckets=_PHASE, registry=r)
        self.first_step = Histogram("pdserve_first_decode_step_seconds", "First decode step (token 2)",
                                    ["policy"], buckets=_FAST, registry=r)
        self.kv_bytes = Counter("pdserve_kv_bytes", "KV bytes moved between workers", ["transport"], registry=r)
        self.tokens = Counter("pdserve_generated_tokens", "Tokens generated", ["policy"], registry=r)
        self.workers = Gauge("pdserve_workers", "Live workers", ["role"], registry=r)
        self.queue_depth = Gauge("pdserve_worker_queue_depth", "Requests waiting on a worker", ["worker", "role"],
                                 registry=r)
        self.running = Gauge("pdserve_worker_running", "Requests running on a worker", ["worker", "role"],
                             registry=r)
        self.free_blocks = Gauge("pdserve_worker_free_kv_blocks", "Free KV blocks on a worker", ["worker", "role"],
                                 registry=r)
        self.kv_blocks = Gauge("pdserve_worker_kv_blocks", "KV blocks a worker's requests can get (its pool, as "
                               "registered)", ["worker", "role"], registry=r)
        self.lost_workers = Counter("pdserve_workers_lost", "Workers dropped (missed heartbeats or exited)",
                                    ["role"], registry=r)
        self.admitted = Gauge("pdserve_admitted_requests", "Requests admitted and not finished, by role (the "
                              "router's queue: waiting or running on that role's workers)", ["role"], registry=r)
        self.admitted_tokens = Gauge("pdserve_admitted_prompt_tokens", "Prompt tokens of the admitted requests, "
                                     "by role", ["role"], registry=r)
        self.rejected = Counter("pdserve_rejected", "Requests refused at admission, by role and reason (requests, "
                                "tokens: over a bound, 429; no_worker, draining: 503)", ["role", "reason"], registry=r)
        self.control_dropped = Counter("pdserve_control_dropped", "Frames on the register socket that were "
                                       "dropped or refused, by reason (junk, stranger, rate-limited, id held, ...)",
                                       ["reason"], registry=r)
        self.routed = Counter("pdserve_routed", "Worker choices, by rule (kv: priced by cached prefix; "
                              "least-loaded)", ["rule"], registry=r)
        self.auto_decisions = Counter("pdserve_auto_decisions", "Policy auto: the policy each request got, and "
                                      "why (small_prefill, queue, disaggregate, threshold, only_servable)",
                                      ["policy", "reason"], registry=r)
        self._kv_tiers(r)
        self._faults(r)
        self._per_worker = (self.queue_depth, self.running, self.free_blocks, self.kv_blocks, self.fenced_waits,
                            self.fenced_blocks, self.integrity_failures)
        self._per_worker_vllm = (self.v_running, self.v_waiting, self.v_kv_usage)
        self._kv_totals: dict[tuple, float] = {}  # (what, worker, role, tier): the last cumulative value seen
        self._tiers: dict[tuple[str, str], set[str]] = {}  # (worker, role): the tiers it reported

    def _vllm(self, r: CollectorRegistry) -> None:
        req, wrk = ["model_name", "policy"], ["model_name", "worker", "role"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, req, buckets=buckets, registry=r)

        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           _VLLM_TTFT)
        self.v_itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          _VLLM_ITL)
        # vLLM's name for the same per-token observation before 0.11 (older dashboards query it)
        self.v_tpot_token = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                 "seconds (the inter-token latency; vLLM's older name).", _VLLM_ITL)
        self.v_tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                           "per request: decode time / (output tokens - 1).", _VLLM_ITL)
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          _VLLM_REQUEST)
        self.v_queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request "
                            "(pdserve: arrival to prefill start, less the request's flight).", _VLLM_REQUEST)
        self.v_prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                              "request.", _VLLM_REQUEST)
        self.v_decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                             "request (token 1 to the last).", _VLLM_REQUEST)
        self.v_inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
                                "request (prefill + decode).", _VLLM_REQUEST)
        self.v_prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS)
        self.v_output_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKENS)
        self.v_max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                 _TOKENS)
        # vLLM: the most tokens any sequence of the request may generate; pdserve's n is 1, so max_tokens
        self.v_max_generation = hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                                     "requested generation tokens.", _TOKENS)
        self.v_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", req, registry=r)
        self.v_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", req,
                                           registry=r)
        self.v_success = Counter("vllm:request_success", "Count of successfully processed requests (pdserve: every "
                                 "request that ended, as vLLM counts abort and error too).",
                                 req + ["finished_reason"], registry=r)
        self.v_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", wrk,
                               registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", wrk,
                               registry=r)
        self.v_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", wrk,
                                registry=r)

    def _kv_tiers(self, r: CollectorRegistry) -> None:
        wrk = ["model_name", "worker", "role"]
        self.v_prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                        "queried tokens.", wrk, registry=r)
        self.v_prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                     "tokens (pdserve: found in any tier).", wrk, registry=r)
        self.prefix_queries = Counter("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      ["worker", "role"], registry=r)
        self.prefix_hits = Counter("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache, by the "
                                   "tier they were found in", ["worker", "role", "tier"], registry=r)
        self.kv_offload = Counter("pdserve_kv_offload_bytes", "KV bytes written into a tier (offloaded to it)",
                                  ["worker", "role", "tier"], registry=r)
        self.kv_reload = Counter("pdserve_kv_reload_bytes", "KV bytes read back from a tier (reloaded from it)",
                                 ["worker", "role", "tier"], registry=r)
        self.tier_usage = Gauge("pdserve_kv_tier_usage_bytes", "KV bytes a tier holds", ["worker", "role", "tier"],
                                registry=r)
        self.tier_capacity = Gauge("pdserve_kv_tier_capacity_bytes", "KV bytes a tier can hold",
                                   ["worker", "role", "tier"], registry=r)

    # ---- workers --------------------------------------------------------------------------------------

    def _faults(self, r: CollectorRegistry) -> None:
        self.restarts = Counter("pdserve_worker_restarts", "Workers that registered again under a worker id "
                                "this router had before (a new process: restarted by pdserve, or by hand)",
                                ["role"], registry=r)
        self.failovers = Counter("pdserve_failovers", "Requests run once more after their prefill or KV transfer "
                                 "failed before token 1 (--failover), by the policy they ran again under",
                                 ["policy"], registry=r)
        self.migrations = Counter("pdserve_migrations", "Running requests moved to another worker after theirs was "
                                  "lost (--migrate), by the policy they continued under", ["policy"], registry=r)
        wr = ["worker", "role"]
        self.fenced_waits = Counter("pdserve_kv_fenced_waits", "Transfers a decode worker gave up on (abort, "
                                    "deadline, cancel) whose blocks waited for the sender's fence before reuse",
                                    wr, registry=r)
        self.fenced_blocks = Gauge("pdserve_kv_fenced_blocks", "KV blocks held now until a sender confirms it "
                                   "stopped writing into them (or its process exits)", wr, registry=r)
        self.integrity_failures = Counter("pdserve_kv_integrity_failures", "Transferred requests whose KV blocks "
                                          "differed from the sender's checksum (--kv-checksum)", wr, registry=r)

    def observe_faults(self, worker: str, role: str, fenced_waits: int, fenced_blocks: int,
                       integrity_failures: int) -> None:
        """A heartbeat's fence and integrity figures (cumulative counts, as observe_kv_tiers takes them)."""
        self.fenced_waits.labels(worker, role).inc(self._advance("fenced", worker, role, "", fenced_waits))
        self.fenced_blocks.labels(worker, role).set(fenced_blocks)
        self.integrity_failures.labels(worker, role).inc(self._advance("integrity", worker, role, "",
                                                                       integrity_failures))

    def worker_registered(self, worker: str, role: str, num_blocks: int, free_blocks: int) -> None:
        """A new worker: its pool, and nothing running or waiting on it until its first heartbeat."""
        self.kv_blocks.labels(worker, role).set(num_blocks)
        self.worker_seen(worker, role, 0, 0, free_blocks, num_blocks)

    def worker_seen(self, worker: str, role: str, queue_depth: int, running: int, free_blocks: int,
                    num_blocks: int | None = None) -> None:
        """A heartbeat's counts; `num_blocks`: the worker's registered pool (for the usage fraction)."""
        self.queue_depth.labels(worker, role).set(queue_depth)
        self.running.labels(worker, role).set(running)
        self.free_blocks.labels(worker, role).set(free_blocks)
        m = self.model_name
        self.v_running.labels(m, worker, role).set(running)
        self.v_waiting.labels(m, worker, role).set(queue_depth)
        if num_blocks is not None:
            self.kv_blocks.labels(worker, role).set(num_blocks)
            self.v_kv_usage.labels(m, worker, role).set(kv_usage(num_blocks, free_blocks))

    def worker_gone(self, worker: str, role: str) -> None:
        """Its per-worker series go (a gauge left behind would show a dead worker's last load)."""
        for g in self._per_worker:
            _remove(g, worker, role)
        for g in self._per_worker_vllm + (self.v_prefix_queries, self.v_prefix_hits):
            _remove(g, self.model_name, worker, role)
        _remove(self.prefix_queries, worker, role)
        for tier in self._tiers.pop((worker, role), ()):
            for metric in (self.prefix_hits, self.kv_offload, self.kv_reload, self.tier_usage, self.tier_capacity):
                _remove(metric, worker, role, tier)
        self._kv_totals = {k: v for k, v in self._kv_totals.items() if k[1:3] != (worker, role)}

    def observe_kv_tiers(self, worker: str, role: str, stats: dict) -> None:
        """One worker's KV-tier and prefix-cache figures, as its latest heartbeat carries them.

        Call it on the router's event loop for each heartbeat (server/pool.py, beside worker_seen),
        with `stats` shaped like this (every key optional: what is absent is left as it was):

            {"prefix_cache_queries": 12000,            # prompt tokens looked up, cumulative since the
                                                       #   worker process started
             "prefix_cache_hits": {"device": 8000,        # of those, tokens found, by the tier they were
                                   "cpu": 1500},       #   found in; cumulative
             "tiers": {"cpu": {"usage_bytes": 3 << 30,     # held now
                               "capacity_bytes": 8 << 30,  # can hold
                               "offload_bytes": 5 << 30,   # written into this tier, cumulative
                               "reload_bytes": 1 << 30}}}  # read back from it, cumulative

        Counts and bytes are ints >= 0; tier names are short words the worker picks ("device", "cpu",
        "disk", ...), the same in both places. Cumulative figures are what a heartbeat can carry
        without loss (a dropped heartbeat loses nothing); this function turns them into counter
        increments against the last value it saw from that worker; a smaller figure (the worker
        restarted under the same id) counts from zero again. worker_gone() forgets the worker.

        Exports: pdserve_prefix_cache_queries_total{worker,role},
        pdserve_prefix_cache_hits_total{worker,role,tier}, pdserve_kv_offload_bytes_total{...,tier},
        pdserve_kv_reload_bytes_total{...,tier}, pdserve_kv_tier_usage_bytes{...,tier},
        pdserve_kv_tier_capacity_bytes{...,tier}; and vLLM's vllm:prefix_cache_queries_total and
        vllm:prefix_cache_hits_total{model_name,worker,role} (hits summed over tiers: a token found
        in any tier is not recomputed). Hit rate: rate(hits) / rate(queries).
        """
        m = self.model_name
        if "prefix_cache_queries" in stats:
            step = self._advance("queries", worker, role, "", stats["prefix_cache_queries"])
            self.prefix_queries.labels(worker, role).inc(step)
            self.v_prefix_queries.labels(m, worker, role).inc(step)
        hits = stats.get("prefix_cache_hits") or {}
        tiers = stats.get("tiers") or {}
        self._tiers.setdefault((worker, role), set()).update(hits, tiers)
        for tier, total in hits.items():
            step = self._advance("hits", worker, role, tier, total)
            self.prefix_hits.labels(worker, role, tier).inc(step)
            self.v_prefix_hits.labels(m, worker, role).inc(step)
        for tier, t in tiers.items():
            if "usage_bytes" in t:
                self.tier_usage.labels(worker, role, tier).set(t["usage_bytes"])
            if "capacity_bytes" in t:
                self.tier_capacity.labels(worker, role, tier).set(t["capacity_bytes"])
            if "offload_bytes" in t:
                self.kv_offload.labels(worker, role, tier).inc(self._advance("offload", worker, role, tier,
                                                                             t["offload_bytes"]))
            if "reload_bytes" in t:
                self.kv_reload.labels(worker, role, tier).inc(self._advance("reload", worker, role, tier,
                                                                            t["reload_bytes"]))

    def _advance(self, what: str, worker: str, role: str, tier: str, total: float) -> float:
        """The increment from the last cumulative `total` seen (all of it after a restart)."""
        if total < 0:
            raise ValueError(f"worker {worker}: cumulative {what} {total} is negative")
        key = (what, worker, role, tier)
        last = self._kv_totals.get(key, 0)
        self._kv_totals[key] = total
        return total - last if total >= last else total

    # ---- requests -------------------------------------------------------------------------------------

    def first_token(self, policy: str, prompt_tokens: int) -> None:
        """Token 1 handed to the response: the prompt is prefilled."""
        self.v_prompt_tokens.labels(self.model_name, policy).inc(prompt_tokens)
        self.v_generation_tokens.labels(self.model_name, policy).inc()

    def next_token(self, policy: str, itl_s: float) -> None:
        """A token after the first, `itl_s` after the one before it."""
        m = self.model_name
        self.itl.labels(policy).observe(itl_s)
        self.v_itl.labels(m, policy).observe(itl_s)
        self.v_tpot_token.labels(m, policy).observe(itl_s)
        self.v_generation_tokens.labels(m, policy).inc()

    def request_ended(self, policy: str, outcome: str, finish_reason: str | None = None,
                      max_tokens: int | None = None) -> None:
        """Every request, once: outcome "ok" (then its finish_reason, stop or length), "cancelled",
        or the error's code; `max_tokens`: what it asked for."""
        self.requests.labels(policy, outcome).inc()
        if max_tokens is not None:
            self.v_max_tokens.labels(self.model_name, policy).observe(max_tokens)
            self.v_max_generation.labels(self.model_name, policy).observe(max_tokens)
        if outcome == "ok":
            reason = finish_reason if finish_reason in FINISHED_REASONS else "stop"
        else:
            reason = "abort" if outcome in ABORTED_OUTCOMES else "error"
        self.v_success.labels(self.model_name, policy, reason).inc()

    def observe_timings(self, t: Timings) -> None:
        """One finished request's timings (ms) into the histograms."""
        policy, m = t.policy, self.model_name
        for hist, value in ((self.ttft, t.ttft_ms), (self.e2e, t.e2e_ms), (self.queue, t.queue_ms),
                            (self.prefill, t.prefill_ms), (self.first_step, t.first_decode_step_ms)):
            if value is not None:
                hist.labels(policy).observe(value / 1e3)
        for hist, value in ((self.v_ttft, t.ttft_ms), (self.v_e2e, t.e2e_ms), (self.v_queue, t.queue_ms),
                            (self.v_prefill, t.prefill_ms)):
            if value is not None:
                hist.labels(m, policy).observe(value / 1e3)
        if t.ttft_ms is not None and t.e2e_ms is not None:
            decode_s = max(0.0, t.e2e_ms - t.ttft_ms) / 1e3
            self.v_decode.labels(m, policy).observe(decode_s)
            self.v_inference.labels(m, policy).observe(decode_s + (t.prefill_ms or 0.0) / 1e3)
            if t.completion_tokens > 1:
                self.v_tpot.labels(m, policy).observe(decode_s / (t.completion_tokens - 1))
        self.v_prompt_len.labels(m, policy).observe(t.prompt_tokens)
        self.v_output_len.labels(m, policy).observe(t.completion_tokens)
        for phase, value in (t.ttft_phases_ms or {}).items():
            if value is not None:  # None: not on this policy's path (colocated has no transfer)
                self.ttft_phase.labels(policy, phase).observe(value / 1e3)
        if t.transfer_ms is not None:
            self.transfer.labels(t.transport, t.mode).observe(t.transfer_ms / 1e3)
            if t.transfer_exposed_ms is not None:  # None: the prefill worker reported no stamp for it
                self.transfer_exposed.labels(t.transport, t.mode).observe(t.transfer_exposed_ms / 1e3)
            self.kv_bytes.labels(t.transport).inc(t.kv_bytes)
        self.tokens.labels(policy).inc(t.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every series name /metrics can show (a histogram's _bucket, _sum and _count, a counter's
        _total), whether or not a series has a value yet: what a dashboard query may reference."""
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
        return {fam.name + suffix for fam in self.registry.collect() for suffix in suffixes[fam.type]}


def kv_usage(num_blocks: int, free_blocks: int) -> float:
    """The fraction of a worker's KV pool in use (vLLM's kv_cache_usage_perc: 1.0 is full)."""
    return 0.0 if num_blocks <= 0 else min(1.0, max(0.0, 1.0 - free_blocks / num_blocks))


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass

