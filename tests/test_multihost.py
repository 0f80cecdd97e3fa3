"""Separate machines for real: a router, a prefill and a decode worker in three network namespaces
(tests/netns.py), each with its own address on a bridge, started with docs/deployment.md's commands for
separate machines (`pdserve keygen`, `pdserve router --host/--register`, `pdserve-worker --control
--kv-host --kv-port`).

- every address the router and the workers advertise is their own namespace's, and nothing of ours
  listens on 0.0.0.0
- nixl (UCX over TCP: UCX_TLS=tcp, as docs/design.md says between hosts without RDMA) and zmq, bulk and
  layer: smollm2-135m's greedy tokens through the disaggregated path equal the colocated worker's,
  timings present, and the nixl worker's log names the UCX lane (tcp, inter-node)
- for each of those pairs, the decode host's link pulled (`ip link set ... down`) while its KV crosses
  a slow (tbf, 25 Mbit/s) link, a quarter of it moved (the veth's byte counter says so): the client
  gets an error within the deadline, once the link is back no KV block is left reserved on either
  worker and the same pair serves again

Every test shares one namespace set and one router; smollm2's colocated worker loads once, each pair
once, for both of its tests (a tiny-model pair for the fault would cost more CPU to load than the
shaped transfer takes on smollm2's, already loaded). Skipped,
with the reason, only where namespaces cannot be made (not root, no iproute2, no veth/bridge).
"""

from __future__ import annotations

import os
import random
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

import netns
from pdserve.workers.transfer.ucx_log import Lane, UcxLog

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
API_KEY = "multihost-test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# between hosts without RDMA (docs/design.md, workers/transfer/nixl.py): without it UCX sees one kernel and
# moves the bytes over cma, never over the namespaces' link (the lane test below shows which)
NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
HEARTBEAT_S, MISSES, KV_DEADLINE_S = 0.5, 3, 15.0


def command(name: str) -> list[str]:
    """The console script the docs use, from this interpreter's environment."""
    script = BIN / name
    module = {"pdserve": "pdserve.server.cli", "pdserve-worker": "pdserve.workers.cli"}[name]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


@pytest.fixture(scope="module")
def net():
    why = netns.why_unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    with netns.Hosts(("router", "prefill", "decode")) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    r = subprocess.run([*command("pdserve"), "keygen", str(d / "keys")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return d / "keys"


class Deployment:
    """One router and the workers started for it, each a process inside its host's namespace."""

    def __init__(self, net: netns.Hosts, keys: Path, model: str, http_port: int, register_port: int,
                 worker_args: tuple[str, ...]):
        self.net, self.keys, self.model = net, keys, model
        self.register = f"tcp://{net['router'].ip}:{register_port}"
        self.url = net.url("router", http_port)
        self.worker_args = worker_args
        self.logdir = Path(tempfile.mkdtemp(prefix="pdserve-multihost-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.http = httpx.Client(timeout=120, headers=HEADERS)
        self.http_port = http_port

    def start(self, name: str, host: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "a")
        full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        p = self.net.popen(host, argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
        self.procs[name] = p
        return p

    def start_router(self, *extra: str) -> None:
        r = self.net["router"].ip
        self.start("router", "router", [*command("pdserve"), "router", "--host", r, "--port", str(self.http_port),
                                        "--register", self.register, "--keys", str(self.keys / "router"),
                                        "--model", self.model, *extra], env={"PDSERVE_API_KEY": API_KEY})

    def wait_router(self) -> None:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            self.alive("router")
            try:
                if self.http.get(self.url + "/health").status_code in (200, 503):
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("the router did not answer /health within 300 s\n" + self.log("router"))

    def start_worker(self, name: str, role: str, host: str, transport: str = "zmq", mode: str = "bulk",
                     control_port: int = 7201, kv_port: int = 7300, env: dict | None = None) -> None:
        ip = self.net[host].ip
        argv = [*command("pdserve-worker"), "--role", role, "--device", "cpu", "--model", self.model,
                "--router", self.register, "--keys", str(self.keys / "worker"), "--control", f"tcp://{ip}:{control_port}",
                "--worker-id", name, "--parent-pid", str(os.getpid()), *self.worker_args]
        if role in ("prefill", "decode"):
            argv += ["--transport", transport, "--mode", mode]
        if role == "decode":
            argv += ["--kv-host", ip, "--kv-port", str(kv_port)]
        self.start(name, host, argv, env)

    def stop(self, name: str, timeout: float = 30) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise AssertionError(f"{name} ignored SIGTERM for {timeout:.0f} s\n{self.log(name)}")

    def close(self) -> None:
        for name in list(self.procs):
            p = self.procs.pop(name)
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.http.close()
        shutil.rmtree(self.logdir, ignore_errors=True)  # a failing test has quoted the logs it needs already

    def alive(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            raise AssertionError(f"{name} exited with code {p.returncode}\n{self.log(name)}")

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.logdir / f"{name}.log"
        return f"--- {name} log ({path}) ---\n" + (path.read_text()[-tail:] if path.exists() else "(none)")

    def logs(self) -> str:
        return "\n".join(self.log(n, 2500) for n in sorted(p.stem for p in self.logdir.glob("*.log")))

    def health(self) -> dict:
        return self.http.get(self.url + "/health").json()

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        end = time.monotonic() + timeout
        h = {}
        while time.monotonic() < end:
            for name in self.procs:
                self.alive(name)
            h = self.health()
            if predicate(h):
                return h
            time.sleep(0.1)
        raise AssertionError(f"timed out ({timeout:.0f} s) waiting for {what}; last /health: {h}\n{self.logs()}")

    def wait_workers(self, ids: set[str], timeout: float = 300) -> dict:
        return self.wait_for(lambda h: ids <= {w["id"] for w in h["workers"]}, timeout, f"{sorted(ids)} to register")

    def wait_gone(self, ids: set[str], timeout: float = 10) -> dict:
        return self.wait_for(lambda h: not ids & {w["id"] for w in h["workers"]}, timeout, f"{sorted(ids)} to leave")

    def complete(self, prompt, policy: str, max_tokens: int, timeout: float = 120) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": max_tokens, "policy": policy, "ignore_eos": True,
                "return_token_ids": True}
        return self.http.post(self.url + "/v1/completions", json=body, timeout=timeout)


def listening(net: netns.Hosts, host: str, ports: set[int]) -> list[str]:
    """Listening addresses inside `host` on any of `ports`."""
    return sorted(a for a in net.listeners(host) if int(a.rsplit(":", 1)[1]) in ports)


def tx_bytes(net: netns.Hosts, host: str) -> int:
    """Bytes sent towards `host` so far: the bridge side of its veth transmits what reaches it."""
    return int(Path(f"/sys/class/net/{net[host].veth}/statistics/tx_bytes").read_text())


# One router (smollm2-135m, a colocated worker on the router's host) for the whole module; one
# prefill + decode pair per transport and mode (pytest runs every test of one pair before the next
# pair starts). The link-down test uses the same pair right after the equality test: loading another
# model (even tiny) costs more CPU than the few seconds the shaped transfer takes.

# Each transport across hosts in one mode; test_server_e2e.py runs the other two pairs (nixl/layer,
# zmq/bulk) on loopback, so every transport meets every mode somewhere in the suite (a pair costs
# ~17 s here: two SmolLM2 workers started, then both tests).
PAIRS = [("nixl", "bulk"), ("zmq", "layer")]
MAX_TOKENS = 12
KV_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # smollm2-135m on the CPU: 30 layers x (K, V) x 3 KV heads x 64 x fp32
SLOW_MBIT = 25  # the link-down test's tbf rate: 300 tokens of KV (13.8 MB) take ~4.4 s


@pytest.fixture(scope="module")
def smollm2(net, keys):
    d = Deployment(net, keys, "smollm2-135m", 8000, 7100, ("--threads", "1", "--num-blocks", "64"))
    try:
        d.start_router("--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-misses", str(MISSES),
                       "--kv-deadline", str(KV_DEADLINE_S))
        d.start_worker("colocated-r", "colocated", "router", control_port=7202)  # loads while the router starts
        d.wait_router()
        d.wait_workers({"colocated-r"})
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def reference(smollm2):
    """The colocated worker's greedy tokens for a short text prompt and a 300-token one (19 blocks)."""
    rng = random.Random(16)
    out = []
    for prompt in ("The capital of France is", [rng.randrange(1000, 40000) for _ in range(300)]):
        r = smollm2.complete(prompt, "colocated", MAX_TOKENS)
        assert r.status_code == 200, r.text
        out.append((prompt, r.json()["choices"][0]["token_ids"]))
    return out


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{t}-{m}" for t, m in PAIRS])
def pair(request, net, smollm2):
    transport, mode = request.param
    env = NIXL_ENV if transport == "nixl" else None
    tag = f"{transport}-{mode}"
    smollm2.start_worker(f"decode-{tag}", "decode", "decode", transport, mode, env=env)
    smollm2.start_worker(f"prefill-{tag}", "prefill", "prefill", transport, mode, env=env)
    try:
        smollm2.wait_workers({f"decode-{tag}", f"prefill-{tag}"})
        yield transport, mode, f"prefill-{tag}", f"decode-{tag}"
    finally:
        net.link("decode", up=True)
        net.shape("decode", None)
        smollm2.stop(f"prefill-{tag}")
        smollm2.stop(f"decode-{tag}")
        smollm2.wait_gone({f"prefill-{tag}", f"decode-{tag}"})


def test_disaggregated_across_hosts_equals_colocated(net, smollm2, reference, pair):
    transport, mode, prefill, decode = pair
    dep = smollm2
    by_id = {w["id"]: w for w in dep.health()["workers"]}
    ips = {name: net[name].ip for name in ("router", "prefill", "decode")}
    assert by_id[decode]["address"] == f"tcp://{ips['decode']}:7201"
    assert by_id[decode]["kv_address"] == f"tcp://{ips['decode']}:7300"
    assert by_id[prefill]["address"] == f"tcp://{ips['prefill']}:7201"
    assert by_id["colocated-r"]["address"] == f"tcp://{ips['router']}:7202"
    for host, ports in (("router", {8000, 7100, 7202}), ("decode", {7201, 7300}), ("prefill", {7201})):
        assert listening(net, host, ports) == sorted(f"{ips[host]}:{p}" for p in ports), host  # never 0.0.0.0

    for prompt, expected in reference:
        r = dep.complete(prompt, "disaggregated", MAX_TOKENS)
        assert r.status_code == 200, f"{r.text}\n{dep.logs()}"
        body = r.json()
        got = body["choices"][0]["token_ids"]
        assert got == expected, (f"{transport}/{mode}: disaggregated {got} != colocated {expected}; "
                                 f"text {body['choices'][0]['text']!r}")
        t = body["timings"]
        assert (t["policy"], t["transport"], t["mode"]) == ("disaggregated", transport, mode)
        assert (t["prefill_worker"], t["decode_worker"]) == (prefill, decode)
        assert t["kv_bytes"] >= t["prompt_tokens"] * KV_PER_TOKEN
        assert t["transfer_ms"] > 0 and t["transfer_exposed_ms"] is not None
        assert t["prefill_ms"] > 0 and t["first_decode_step_ms"] > 0
        phases = t["ttft_phases_ms"]
        assert abs(sum(v for v in phases.values() if v is not None) - t["ttft_ms"]) < 0.5, t
    dep.wait_for(lambda h: all(w["free_blocks"] == w["num_blocks"] for w in h["workers"]), 10,
                 "every KV block back in its pool")
    if transport == "nixl":  # the lane, as each side logged it: tcp between hosts, never a silent cma
        sent = re.findall(r"KV to tcp://[\d.:]+ \(\S+\) goes over UCX (\S+) \((\S+) cfg#\d+: puts over (\S+);",
                          (dep.logdir / f"{prefill}.log").read_text())
        assert sent and sent[-1] == ("tcp", "inter-node", "tcp/eth0"), f"{sent}\n{dep.log(prefill)}"
        got = re.findall(r"KV from \S+ goes over UCX (\S+) \((\S+) cfg", (dep.logdir / f"{decode}.log").read_text())
        assert got and got[-1] == ("tcp", "inter-node"), f"{got}\n{dep.log(decode)}"


def test_link_down_mid_transfer(net, smollm2, pair):
    """The decode host's link pulled while its KV crosses a 25 Mbit/s link: the client gets an error
    within the deadline; once the link is back, no KV block is left on either worker and the same
    pair serves again."""
    transport, mode, prefill, decode = pair
    dep = smollm2
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    kv_bytes = len(prompt) * KV_PER_TOKEN
    short = [rng.randrange(1000, 40000) for _ in range(20)]
    before = dep.complete(short, "disaggregated", 4)
    assert before.status_code == 200, before.text
    net.shape("decode", SLOW_MBIT)
    result: dict = {}

    def send():
        try:
            result["response"] = dep.complete(prompt, "disaggregated", 4, timeout=90)
        except httpx.HTTPError as e:
            result["exception"] = e
        result["at"] = time.monotonic()

    start_bytes = tx_bytes(net, "decode")
    client = threading.Thread(target=send)
    client.start()
    end = time.monotonic() + 60
    while tx_bytes(net, "decode") - start_bytes < kv_bytes // 4:  # a quarter of the KV is on the wire
        assert client.is_alive(), f"the request ended before a quarter of its KV moved: {result}"
        assert time.monotonic() < end, f"the KV did not start moving within 60 s\n{dep.logs()}"
        time.sleep(0.05)
    net.link("decode", up=False)
    down_at = time.monotonic()
    moved = tx_bytes(net, "decode") - start_bytes
    assert moved < kv_bytes, f"all {kv_bytes} bytes had moved ({moved}) before the link went down"
    client.join(60)
    assert not client.is_alive(), "the client got no answer within 60 s of the link going down"
    assert "exception" not in result, result
    r, waited = result["response"], result["at"] - down_at
    assert r.status_code in (502, 503, 504), r.text
    err = r.json()["error"]
    assert err["message"] and err["code"], err
    # the decode worker's heartbeats stop: the router drops it after MISSES x HEARTBEAT_S (1.5 s)
    assert waited < KV_DEADLINE_S, f"the error came {waited:.1f} s after the link went down: {err}"

    time.sleep(1.0)
    net.link("decode", up=True)
    net.shape("decode", None)
    dep.wait_workers({prefill, decode}, timeout=30)  # the decode worker registers again

    def settled(h):
        ours = [w for w in h["workers"] if w["id"] in (prefill, decode)]
        return len(ours) == 2 and all(w["free_blocks"] == w["num_blocks"] and w["in_flight"] == 0 for w in ours)

    dep.wait_for(settled, KV_DEADLINE_S + 20, "every KV block back in its pool on both workers")
    after = dep.complete(short, "disaggregated", 4)
    assert after.status_code == 200, f"{after.text}\n{dep.logs()}"
    assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    again = dep.complete(prompt, "disaggregated", 4)
    assert again.status_code == 200, f"{again.text}\n{dep.logs()}"
    assert again.json()["timings"]["decode_worker"] == decode


# ---- the lane parser, on what UCX 1.23 printed on this project's machine ------------------------------

UCX_SAMPLE = """\
[1796120677.588089] [vm:32084:0]      ucp_worker.c:1997 UCX  INFO    ini self cfg#0 rma_am(tcp/eth0)  amo_am(tcp/eth0)  am(tcp/eth0 cma/memory)  ka(tcp/eth0)
[1796120460.059735] [vm:29414:0]   +--------+-------------+-----------------------------------+
[1796120460.059735] [vm:29414:0]   | ini intra-node cfg#1                                     |
[1796120460.059735] [vm:29414:0]   | remote memory write by ucp_put* from host memory to host |
[1796120460.059735] [vm:29414:0]   +--------+-------------+-----------------------------------+
[1796120460.059735] [vm:29414:0]   | Range  | Description |              Config               |
[1796120460.059735] [vm:29414:0]   +--------+-------------+-----------------------------------+
[1796120460.059735] [vm:29414:0]   | 0..inf | zero-copy   | cma/memory                        |
[1796120460.059735] [vm:29414:0]   +--------+-------------+-----------------------------------+
[1796120460.062022] [vm:29414:0]   +------------+--------------------+---------------+
[1796120460.062022] [vm:29414:0]   | ini intra-node cfg#1                            |
[1796120460.062022] [vm:29414:0]   | active message by ucp_am_send* from host memory |
[1796120460.062022] [vm:29414:0]   +------------+--------------------+---------------+
[1796120460.062022] [vm:29414:0]   |   Range    |    Description     |    Config     |
[1796120460.062022] [vm:29414:0]   +------------+--------------------+---------------+
[1796120460.062022] [vm:29414:0]   |          0 | short              | tcp/lo        |
[1796120460.062022] [vm:29414:0]   +------------+--------------------+---------------+
[1796120677.717456] [vm:32084:0]      ucp_worker.c:1997 UCX  INFO    ini intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1796120684.338023] [vm:32105:0]      ucp_worker.c:1997 UCX  WARN  some warning
[1796120684.338023] [vm:32105:0]      ucp_worker.c:1997 UCX  INFO    ini inter-node cfg#2 rma_am(tcp/eth0)  amo_am(tcp/eth0)  am(tcp/eth0)  ka(tcp/eth0)
"""


def test_ucx_lane_parser(tmp_path):
    path = tmp_path / "ucx.log"
    path.write_text(UCX_SAMPLE[:200])  # half a line: kept for the next read
    log = UcxLog(str(path))
    log.read()
    path.write_text(UCX_SAMPLE)
    lanes, problems = log.read()
    assert problems == ["UCX WARN: some warning"]
    one = log.cfgs[("ini", 1)]
    assert one.put == ["cma/memory"] and one.transports == ["cma"]  # the put table, not the am lane (tcp/lo)
    assert one.scope == "intra-node" and "am(tcp/lo cma/memory)" in one.lanes
    two = log.latest("ini")
    assert (two.cfg, two.scope, two.put, two.transports) == (2, "inter-node", [], ["tcp"])
    assert two.host_staged_for_gpu()  # GPU memory over tcp would be staged through the host
    assert not Lane("a", "intra-node", 3, put=["cuda_ipc/cuda"]).host_staged_for_gpu()
    assert UcxLog(None, "why").read() == ([], [])


# ---- the harness itself: a run killed before its teardown leaves nothing that outlives the next one ----


def test_a_killed_runs_namespaces_are_swept_by_the_next(net):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import netns; h = netns.Hosts(('a', 'b')); "
            "h.up(); print(h.bridge, *[x.ns for x in h.hosts.values()], flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(ROOT / "tests")], stdout=subprocess.PIPE, text=True)
    try:
        bridge, *spaces = child.stdout.readline().split()
    finally:
        child.kill()  # SIGKILL: no teardown ran
        child.wait(10)
    assert set(spaces) <= set(netns._namespaces()) and netns.ip("link", "show", bridge, check=False).returncode == 0
    gone = netns.sweep_stale()
    assert set(spaces) | {bridge} <= set(gone), gone
    assert not set(spaces) & set(netns._namespaces())
    assert netns.ip("link", "show", bridge, check=False).returncode != 0
    assert set(net.hosts[h].ns for h in net.hosts) <= set(netns._namespaces())  # a live run's set is kept
