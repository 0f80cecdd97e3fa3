"""Every millisecond of TTFT in a named phase (protocol/phases.py).

- A live server (tiny model on the CPU, router + prefill + decode + colocated worker, every process
  real): requests of both policies and both auto decisions, streamed and not, in concurrent waves
  (so messages wait in busy workers' inboxes), read through pdserve's own client. For each one the
  phases sum to ttft_ms within 1 ms, none is negative, nothing is unattributed; /metrics histograms
  the same phases, and there they sum to the TTFT histogram's sum.
- The split's arithmetic with a stamp missing (no server): that part goes to `unattributed`.
- docs/api.md's table of phases is protocol/phases.py's list, row for row.
- What the router and the client import for this stays torch-free (`pdserve --help` included).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from pdserve.client import AsyncClient, Timings
from pdserve.server.timeline import Clock, ttft_phases
from test_server_harness import ROOT  # pytest puts tests/ on sys.path
from pdserve.protocol import control as P
from pdserve.protocol.enums import TRANSPORTS
from pdserve.protocol.phases import MEANING, NAMES, PHASES, UNATTRIBUTED

pytestmark = pytest.mark.timeout(300)

# the shared server's (conftest.py) auto threshold is the default, 256 tokens; the tiny tokenizer
# makes SHORT 5 tokens, LONG 300
SHORT = "The capital of France is"
LONG = SHORT * 60
NOT_ON_PATH = {"colocated": {"transfer_exposed", "decode_pickup"}, "disaggregated": set()}
# (requested policy, prompt, the policy it must be served with: None for auto, which prices the prompt
# against the workers' measured speeds and queues; on the shared server an earlier test's load can tip a
# long prompt to colocated, so the test checks each auto request on the path it was actually served by)
KINDS = [("colocated", LONG, "colocated"), ("disaggregated", SHORT, "disaggregated"),
         ("auto", SHORT, None), ("auto", LONG, None)]
WAVES, WAVE = 6, 4  # 24 requests: 6 of each kind; four at a time


async def one(c: AsyncClient, i: int) -> tuple[str, Timings]:
    policy, prompt, served = KINDS[i % len(KINDS)]
    if policy == "auto" and prompt == LONG:  # a prompt no worker holds: auto prices a long prefill
        prompt = f"{i} {LONG}"
    # every kind streamed and not, with 1 token (token 1 is also the last) and more
    options = {"max_tokens": 1 + (i // 2) % 4, "ignore_eos": True}
    if (i // len(KINDS)) % 2:
        async with c.stream_complete(prompt, policy=policy, **options) as s:
            async for _ in s:
                pass
        t = s.result.timings
    else:
        t = (await c.complete(prompt, policy=policy, **options)).timings
    if served is None:  # auto: the path it decided, with its reason
        assert t.policy in NOT_ON_PATH and t.route is not None and t.route.auto, t.route
        served = t.policy
    return served, t


async def run_waves(url: str) -> list[tuple[str, Timings]]:
    async with AsyncClient(url, model="tiny", timeout_s=120.0) as c:
        out = []
        for w in range(WAVES):
            out += await asyncio.gather(*(one(c, w * WAVE + i) for i in range(WAVE)))
        return out


def metric(text: str, name: str, **labels) -> float | None:
    """The value of one series in a Prometheus text page (None if absent)."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and sorted(m.group(1).split(",")) == want:
            return float(m.group(2))
    return None


def test_phases_sum_to_ttft_on_a_live_server(tiny_pdserve):
    srv = tiny_pdserve
    before = srv.get("/metrics").text
    results = asyncio.run(run_waves(srv.url))
    metrics = srv.get("/metrics").text

    def added(name: str, **labels) -> float | None:
        """What these requests added to a series (None: it has no samples at all)."""
        now, then = metric(metrics, name, **labels), metric(before, name, **labels)
        return None if now is None else now - (then or 0.0)
    served = [policy for policy, _ in results]
    assert served.count("colocated") >= WAVES * WAVE // 4 and served.count("disaggregated") >= WAVES * WAVE // 4
    for policy, t in results:
        phases = t.ttft_phases
        shown = ", ".join(f"{k}={v}" for k, v in phases.items())
        assert t.policy == policy, f"served {t.policy}, expected {policy}"
        assert tuple(phases) == NAMES
        assert {k for k, v in phases.items() if v is None} == NOT_ON_PATH[policy], shown
        assert sum(v for v in phases.values() if v is not None) == pytest.approx(t.ttft_ms, abs=1.0), shown
        assert all(v >= 0 for v in phases.values() if v is not None), shown
        assert abs(phases[UNATTRIBUTED]) < 0.01, shown  # every process reported every stamp
        assert phases["prefill"] > 0 and phases["hops"] > 0, shown
    # six at a time on three workers: some messages waited in a busy worker's inbox
    assert max(t.ttft_phases["inbox"] for _, t in results) > 0.5

    for policy in NOT_ON_PATH:
        n = served.count(policy)
        ttft_sum = added("pdserve_ttft_seconds_sum", policy=policy)
        phase_sum = 0.0
        for name in NAMES:
            if name in NOT_ON_PATH[policy]:
                assert added("pdserve_ttft_phase_seconds_count", policy=policy, phase=name) is None
                continue
            assert added("pdserve_ttft_phase_seconds_count", policy=policy, phase=name) == n
            phase_sum += added("pdserve_ttft_phase_seconds_sum", policy=policy, phase=name)
        assert phase_sum == pytest.approx(ttft_sum, abs=n * 1e-3)
    assert all(MEANING[name] in metrics for name in NAMES)  # the help text says what each phase is


def test_a_missing_stamp_goes_to_unattributed_not_into_another_phase():
    clock = Clock(arrival=10.0, prepared=10.001, dispatched=10.003, token1_landed=10.020, first_token=10.021)
    # a worker's stamps are on its own clock (here ~500 s ahead of the router's): only their differences count
    full_stamps = {"arrived": 500.0, "taken": 500.001, "prefill_start": 500.003, "prefill_end": 500.013,
                   "token1": 500.013, "token1_sent": 500.0135}
    worker = P.Timeline(stamps=full_stamps)
    full = ttft_phases(clock, worker, worker, disaggregated=False)
    assert full == {"parse": 1.0, "route": 2.0, "inbox": 1.0, "prefill_queue": 2.0, "prefill": 10.0,
                    "transfer_exposed": None, "decode_pickup": None, "hops": 3.5, "first_token_send": 1.5,
                    "unattributed": 0.0}
    # a worker without emit stamps: its round trip cannot be split into work and flight
    old = P.Timeline(stamps={k: v for k, v in full_stamps.items() if k != "token1_sent"})
    part = ttft_phases(clock, old, old, disaggregated=False)
    assert part["hops"] is None and part["first_token_send"] == 1.0 and part["unattributed"] == 4.0
    # disaggregated: the prefill worker's stretches, then the decode worker's
    prefill = P.Timeline(stamps={**old.stamps, "kv_delivered": 500.0145})
    decode = P.Timeline(stamps={"kv_received": 70.0, "token1": 70.0007, "token1_sent": 70.001})
    dis = ttft_phases(clock, prefill, decode, disaggregated=True)
    assert (dis["transfer_exposed"], dis["decode_pickup"], dis["hops"], dis["unattributed"]) == (1.5, 0.7, 1.5, 0.0)
    for split in (full, part, dis):
        assert sum(v for v in split.values() if v is not None) == pytest.approx(21.0, abs=1e-3)


def test_the_docs_list_the_phases_as_the_code_defines_them():
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("| phase | clock | from -> to |\n|---|---|---|\n"):].split("\n\n")[0].splitlines()[2:]
    assert table == [f"| `{p.name}` | {p.clock} | {p.meaning} |" for p in PHASES]


def test_router_client_and_phases_stay_torch_free():
    code = ("import sys, runpy; sys.argv = ['pdserve', '--help']\n"
            "import pdserve.protocol.phases, pdserve.settings.cli, pdserve.server.app, pdserve.client\n"
            "try:\n    runpy.run_module('pdserve.server.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--transport {ipc,nixl,zmq}" in run.stdout, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "False", run.stderr
    from pdserve.workers.transfer import registry  # every transport the router can name (torch-free) is one a worker has
    for name in TRANSPORTS:
        assert registry.transport(name).Sender and registry.transport(name).Receiver
