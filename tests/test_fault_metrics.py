"""The fault counters on /metrics: fences and integrity failures from decode workers' heartbeats
(cumulative figures turned into counter increments, a restarted worker counted from zero again),
restarts, failovers and migrations; every one on the dashboard."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.protocol import control as P
from pdserve.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pdserve.json"
NAMES = ("pdserve_kv_fenced_waits_total", "pdserve_kv_fenced_blocks", "pdserve_kv_integrity_failures_total",
         "pdserve_worker_restarts_total", "pdserve_failovers_total", "pdserve_migrations_total")


def samples(m: Metrics) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_heartbeat_figures_become_counters_and_a_restart_counts_from_zero():
    m = Metrics("tiny")
    who = (("role", "decode"), ("worker", "d0"))
    for waits, held, bad in ((2, 6, 0), (5, 0, 1), (1, 3, 0)):  # the third: the worker restarted
        f = P.FaultFigures(fenced_waits=waits, fenced_blocks=held, integrity_failures=bad)
        m.observe_faults("d0", "decode", f.fenced_waits, f.fenced_blocks, f.integrity_failures)
    got = samples(m)
    assert got[("pdserve_kv_fenced_waits_total", who)] == 6  # 2, +3, then 1 from zero
    assert got[("pdserve_kv_fenced_blocks", who)] == 3
    assert got[("pdserve_kv_integrity_failures_total", who)] == 1
    m.restarts.labels("decode").inc()
    m.failovers.labels("colocated").inc()
    m.migrations.labels("disaggregated").inc()
    got = samples(m)
    assert got[("pdserve_worker_restarts_total", (("role", "decode"),))] == 1
    assert got[("pdserve_migrations_total", (("policy", "disaggregated"),))] == 1
    m.worker_gone("d0", "decode")
    assert not any(k[0].startswith("pdserve_kv_fenced") and dict(k[1]).get("worker") == "d0" for k in samples(m))


def test_a_heartbeat_carries_the_figures_and_the_dashboard_shows_every_counter():
    hb = P.Heartbeat("d0", "tcp://127.0.0.1:1", 10, 0, 0, 0.0, faults=P.FaultFigures(1, 2, 3))
    assert P.decode_to_router(P.from_worker("inc", hb)).msg.faults == P.FaultFigures(1, 2, 3)
    exprs = " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"])
    for name in NAMES:
        assert name in exprs, name
