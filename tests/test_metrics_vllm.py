"""/metrics under vLLM's names, and the Grafana dashboard that reads them.

- Metrics fed by hand (no server): the vllm: histograms and counters from a request's timings,
  vLLM's finished_reason, KV usage from a worker's registered pool, a dropped worker's series gone,
  the KV-tier feed (cumulative figures into counter increments, a restart counted from zero).
- deploy/grafana/pdserve.json: every metric its PromQL names is one Metrics exports.
- A live server (tiny model, router + prefill + decode + colocated worker, every process real):
  requests of both policies, then /metrics: every name the dashboard queries is on the page, and the
  vllm: series hold what the requests did (counts, tokens, finished_reason, per-worker KV usage and
  pool size as /health reports them).
"""

from __future__ import annotations

import json
import re

import pytest

from pdserve.protocol.timings import Timings
from pdserve.server.metrics import Metrics, kv_usage
from test_server_harness import ROOT  # pytest puts tests/ on sys.path

DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
METRIC = re.compile(r"\b((?:vllm|pdserve)[:_][A-Za-z0-9_:]+)")


def value(text: str, name: str, **labels) -> float | None:
    """One series' value in a Prometheus text page (labels matched exactly; None if absent)."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and sorted(filter(None, (m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return None


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def exported_names(text: str) -> set[str]:
    """Every series name a page declares (its # TYPE lines), with the suffixes each type carries."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    out = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        name = name.removesuffix("_total")  # a counter's TYPE line names its samples' _total form
        out.update(name + s for s in suffixes.get(kind, ("",)))
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def timings(policy="colocated", **over) -> Timings:
    t = {"policy": policy, "queue_ms": 5.0, "prefill_ms": 40.0, "first_decode_step_ms": 8.0, "ttft_ms": 50.0,
         "e2e_ms": 250.0, "ttft_phases_ms": {}, "transfer_ms": None, "prompt_tokens": 30, "completion_tokens": 5}
    return Timings(**{**t, **over})


def test_request_metrics_under_vllm_names():
    m = Metrics("tiny")
    m.first_token("colocated", 30)
    for _ in range(4):
        m.next_token("colocated", 0.05)
    m.observe_timings(timings())
    m.request_ended("colocated", "ok", "length")
    m.request_ended("colocated", "cancelled")
    m.request_ended("disaggregated", "worker_lost")
    page = m.render().decode()
    lab = {"model_name": "tiny", "policy": "colocated"}
    assert value(page, "vllm:time_to_first_token_seconds_count", **lab) == 1
    assert value(page, "vllm:time_to_first_token_seconds_sum", **lab) == pytest.approx(0.05)
    assert value(page, "vllm:e2e_request_latency_seconds_sum", **lab) == pytest.approx(0.25)
    assert value(page, "vllm:request_queue_time_seconds_sum", **lab) == pytest.approx(0.005)
    assert value(page, "vllm:request_prefill_time_seconds_sum", **lab) == pytest.approx(0.04)
    assert value(page, "vllm:request_decode_time_seconds_sum", **lab) == pytest.approx(0.2)  # token 1 to the last
    assert value(page, "vllm:request_inference_time_seconds_sum", **lab) == pytest.approx(0.24)
    assert value(page, "vllm:request_time_per_output_token_seconds_sum", **lab) == pytest.approx(0.05)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds", "pdserve_itl_seconds"):
        labels = lab if name.startswith("vllm") else {"policy": "colocated"}
        assert value(page, name + "_count", **labels) == 4
        assert value(page, name + "_sum", **labels) == pytest.approx(0.2)
    assert value(page, "vllm:prompt_tokens_total", **lab) == 30
    assert value(page, "vllm:generation_tokens_total", **lab) == 5
    assert value(page, "vllm:request_prompt_tokens_sum", **lab) == 30
    assert value(page, "vllm:request_generation_tokens_sum", **lab) == 5
    assert value(page, "vllm:request_success_total", finished_reason="length", **lab) == 1
    assert value(page, "vllm:request_success_total", finished_reason="abort", **lab) == 1
    assert value(page, "vllm:request_success_total", model_name="tiny", policy="disaggregated",
                 finished_reason="error") == 1
    assert value(page, "pdserve_requests_total", policy="colocated", outcome="cancelled") == 1
    assert value(page, "vllm:request_prompt_tokens_bucket", le="50.0", **lab) == 1  # vLLM's 1-2-5 buckets
    assert value(page, "vllm:request_prompt_tokens_bucket", le="20.0", **lab) == 0


def test_worker_gauges_kv_usage_and_a_dropped_worker():
    m = Metrics("tiny")
    m.worker_registered("decode-0", "decode", 400, 400)
    page = m.render().decode()
    w = {"model_name": "tiny", "worker": "decode-0", "role": "decode"}
    assert value(page, "vllm:kv_cache_usage_perc", **w) == 0.0
    assert value(page, "pdserve_worker_kv_blocks", worker="decode-0", role="decode") == 400
    m.worker_seen("decode-0", "decode", queue_depth=3, running=7, free_blocks=100, num_blocks=400)
    page = m.render().decode()
    assert value(page, "vllm:kv_cache_usage_perc", **w) == 0.75
    assert value(page, "vllm:num_requests_running", **w) == 7
    assert value(page, "vllm:num_requests_waiting", **w) == 3
    assert kv_usage(0, 0) == 0.0 and kv_usage(10, 12) == 0.0 and kv_usage(10, 0) == 1.0
    m.observe_kv_tiers("decode-0", "decode", {"prefix_cache_queries": 10, "prefix_cache_hits": {"gpu": 4},
                                              "tiers": {"cpu": {"usage_bytes": 1}}})
    m.worker_gone("decode-0", "decode")
    assert [line for line in m.render().decode().splitlines() if "decode-0" in line] == []


def test_kv_tiers_turn_cumulative_figures_into_counters():
    m = Metrics("tiny")
    w = ("prefill-0", "prefill")
    m.observe_kv_tiers(*w, {"prefix_cache_queries": 100, "prefix_cache_hits": {"gpu": 40, "cpu": 10},
                            "tiers": {"cpu": {"usage_bytes": 3000, "capacity_bytes": 8000, "offload_bytes": 5000,
                                              "reload_bytes": 1000}}})
    m.observe_kv_tiers(*w, {"prefix_cache_queries": 160, "prefix_cache_hits": {"gpu": 70, "cpu": 10},
                            "tiers": {"cpu": {"usage_bytes": 2000, "offload_bytes": 6000}}})
    page = m.render().decode()
    lab = {"worker": "prefill-0", "role": "prefill"}
    assert value(page, "pdserve_prefix_cache_queries_total", **lab) == 160
    assert value(page, "pdserve_prefix_cache_hits_total", tier="gpu", **lab) == 70
    assert value(page, "pdserve_prefix_cache_hits_total", tier="cpu", **lab) == 10
    assert value(page, "vllm:prefix_cache_queries_total", model_name="tiny", **lab) == 160
    assert value(page, "vllm:prefix_cache_hits_total", model_name="tiny", **lab) == 80  # every tier
    assert value(page, "pdserve_kv_offload_bytes_total", tier="cpu", **lab) == 6000
    assert value(page, "pdserve_kv_reload_bytes_total", tier="cpu", **lab) == 1000
    assert value(page, "pdserve_kv_tier_usage_bytes", tier="cpu", **lab) == 2000  # a gauge: the latest
    assert value(page, "pdserve_kv_tier_capacity_bytes", tier="cpu", **lab) == 8000  # absent: left as it was
    # the worker restarted under the same id: its figures start again from zero, the counters go on
    m.observe_kv_tiers(*w, {"prefix_cache_queries": 20, "prefix_cache_hits": {"gpu": 5}})
    page = m.render().decode()
    assert value(page, "pdserve_prefix_cache_queries_total", **lab) == 180
    assert value(page, "vllm:prefix_cache_hits_total", model_name="tiny", **lab) == 85
    with pytest.raises(ValueError, match="negative"):
        m.observe_kv_tiers(*w, {"prefix_cache_queries": -1})


# what vLLM's own dashboard (examples/observability/prometheus_grafana/grafana.json) queries
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum", "vllm:time_per_output_token_seconds_bucket",
}


def test_vllms_own_dashboard_finds_every_metric_it_queries():
    assert VLLM_DASHBOARD <= Metrics("tiny").names()
    m = Metrics("tiny")
    m.request_ended("colocated", "ok", "stop", max_tokens=64)
    page = m.render().decode()
    assert value(page, "vllm:request_max_num_generation_tokens_sum", model_name="tiny", policy="colocated") == 64
    assert value(page, "vllm:request_params_max_tokens_count", model_name="tiny", policy="colocated") == 1


def test_dashboard_queries_only_metrics_pdserve_exports():
    queries = dashboard_queries()
    exported = Metrics("tiny").names()
    assert len(queries) >= 20
    missing = {(title, name) for title, expr in queries for name in METRIC.findall(expr) if name not in exported}
    assert not missing, f"dashboard panels query metrics /metrics does not export: {sorted(missing)}"
    for title, expr in queries:
        assert METRIC.search(expr), f"panel {title!r}: a query without a pdserve or vLLM metric: {expr}"
    titles = " | ".join(title for title, _ in queries).lower()
    for needed in ("first token", "inter-token", "end-to-end", "throughput", "running and waiting", "kv cache usage",
                   "rejected", "by phase", "prefix cache hit rate"):
        assert needed in titles, f"no {needed!r} panel"


def test_live_metrics_hold_what_the_requests_did_and_cover_the_dashboard(tiny_pdserve):
    """On the shared tiny pdserve (conftest.py): what these requests added to each series."""
    srv = tiny_pdserve
    before = srv.get("/metrics").text
    usage = []
    for policy in ("colocated", "disaggregated", "disaggregated"):
        r = srv.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3,
                                         "ignore_eos": True, "policy": policy})
        assert r.status_code == 200, r.text
        usage.append((policy, r.json()["usage"]))
    health = srv.health()
    page = srv.get("/metrics").text

    def added(name: str, **labels) -> float:
        return (value(page, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

    missing = {name for _, expr in dashboard_queries() for name in METRIC.findall(expr)} - exported_names(page)
    assert not missing, f"the dashboard queries metrics a live /metrics does not declare: {sorted(missing)}"
    for policy in ("colocated", "disaggregated"):
        lab = {"model_name": "tiny", "policy": policy}
        mine = [u for p, u in usage if p == policy]
        assert added("vllm:time_to_first_token_seconds_count", **lab) == len(mine)
        assert added("vllm:e2e_request_latency_seconds_count", **lab) == len(mine)
        assert added("vllm:inter_token_latency_seconds_count", **lab) == 2 * len(mine)  # 3 tokens: 2 gaps
        assert added("vllm:prompt_tokens_total", **lab) == sum(u["prompt_tokens"] for u in mine)
        assert added("vllm:generation_tokens_total", **lab) == sum(u["completion_tokens"] for u in mine)
        assert added("vllm:request_success_total", finished_reason="length", **lab) == len(mine)
    assert added("pdserve_transfer_seconds_count", transport="ipc", mode="bulk") == 2
    workers = health["workers"]
    assert len(workers) == 3
    for w in workers:
        lab = {"worker": w["id"], "role": w["role"]}
        assert value(page, "pdserve_worker_kv_blocks", **lab) == w["num_blocks"] > 0
        usage_now = value(page, "vllm:kv_cache_usage_perc", model_name="tiny", **lab)
        assert usage_now is not None and 0.0 <= usage_now <= 1.0
        assert value(page, "vllm:num_requests_running", model_name="tiny", **lab) is not None
    assert len(series(page, "vllm:num_requests_waiting")) == 3
