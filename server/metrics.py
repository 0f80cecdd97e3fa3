"""Prometheus metrics of one router (its own registry, so several routers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from workers import phases as PH

# seconds: sub-millisecond transfers up to minute-long requests
_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PHASE = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
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

    def worker_seen(self, worker: str, role: str, queue_depth: int, running: int, free_blocks: int) -> None:
        self.queue_depth.labels(worker, role).set(queue_depth)
        self.running.labels(worker, role).set(running)
        self.free_blocks.labels(worker, role).set(free_blocks)

    def worker_gone(self, worker: str, role: str) -> None:
        for g in (self.queue_depth, self.running, self.free_blocks):
            try:
                g.remove(worker, role)
            except KeyError:
                pass

    def observe_timings(self, t: dict) -> None:
        """One finished request's `timings` object (ms) into the histograms."""
        policy = t["policy"]
        for hist, key in ((self.ttft, "ttft_ms"), (self.e2e, "e2e_ms"), (self.queue, "queue_ms"),
                          (self.prefill, "prefill_ms"), (self.first_step, "first_decode_step_ms")):
            if t.get(key) is not None:
                hist.labels(policy).observe(t[key] / 1e3)
        for phase, value in (t.get(PH.FIELD) or {}).items():
            if value is not None:  # None: not on this policy's path (colocated has no transfer)
                self.ttft_phase.labels(policy, phase).observe(value / 1e3)
        if t.get("transfer_ms") is not None:
            self.transfer.labels(t["transport"], t["mode"]).observe(t["transfer_ms"] / 1e3)
            self.transfer_exposed.labels(t["transport"], t["mode"]).observe(t["transfer_exposed_ms"] / 1e3)
            self.kv_bytes.labels(t["transport"]).inc(t["kv_bytes"])
        self.tokens.labels(policy).inc(t["completion_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
