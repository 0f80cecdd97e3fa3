"""The router against fake workers: real ZMQ (CURVE, the deployment's keys) and the real protocol,
scripted behaviour, no model.

Each FakeWorker is a thread that registers, heartbeats and answers control messages the way a
test script says, so failures (a silent worker, a failing prefill, a hanging one, a client that
leaves) happen exactly when the test wants them.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from contextlib import contextmanager

import pytest
import zmq
from fastapi.testclient import TestClient

from pdserve.server.app import create_app
from pdserve.settings.router import RouterConfig
from pdserve.server.tokenizer import load_tokenizer
from pdserve.protocol import auth
from pdserve.settings import keys
from pdserve.protocol import control as P
from pdserve.protocol.phases import NAMES as PHASE_NAMES

HEARTBEAT_S = 0.1
MISSES = 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


class FakeWorker(threading.Thread):
    def __init__(self, router: str, role: str, worker_id: str, on_message=None, *, model: str = "tiny",
                 version: int = P.PROTOCOL_VERSION, max_model_len: int = 64, transport: str | None = "ipc",
                 queue_depth: int = 0, keys: keys.WorkerKeys | None = None, block_root: bytes | None = None):
        super().__init__(daemon=True)
        self.router, self.role, self.worker_id = router, role, worker_id
        self.keys = keys
        self.incarnation = secrets.token_hex(16)
        self.on_message = on_message or (lambda w, m: None)
        self.model, self.version, self.max_model_len = model, version, max_model_len
        self.transport = transport if role != "colocated" else None
        self.queue_depth = queue_depth
        self.block_root = block_root  # set: it names its blocks, and KV-aware routing counts it as reporting
        self.received: list = []
        self.acks: list[P.RegisterAck] = []
        self.silent = threading.Event()  # stop heartbeating and answering (a dead worker)
        self.stopped = threading.Event()
        self.registered = threading.Event()
        self._outbox: list = []
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        with self._lock:
            self._outbox.append(msg)

    def tokens(self, rid: str, ids: list[int], finished_last: bool = True, timeline: P.Timeline | None = None):
        outs = []
        for i, t in enumerate(ids):
            last = finished_last and i == len(ids) - 1
            outs.append(P.TokenOut(rid, t, f"<{t}>", last, "length" if last else None, timeline if last else None))
        self.send(P.Tokens(self.worker_id, outs))

    def run(self) -> None:
        ctx = zmq.Context()
        control = ctx.socket(zmq.PULL)
        gate = None
        if self.keys is not None:  # as a real worker: only the router's key gets in
            gate = auth.Gate(ctx, self.keys.control_gate(), "fake control socket", auth.Throttle(auth.log))
            auth.serve_curve(control, self.keys.worker)
        port = control.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        push = ctx.socket(zmq.PUSH)
        if self.keys is not None:
            auth.connect_curve(push, self.keys.worker, self.keys.router_public)
        push.connect(self.router)
        reg = P.Register(self.version, self.worker_id, self.role, self.address, self.model, self.max_model_len, 16,
                         1000, 1000, "cpu", "float32", 4242, self.transport, "bulk" if self.transport else None,
                         "tcp://127.0.0.1:1" if self.role == "decode" else None, block_root=self.block_root)

        def send(m) -> None:
            push.send(P.from_worker(self.incarnation, m))

        send(reg)
        next_beat = time.monotonic() + HEARTBEAT_S
        while not self.stopped.is_set():
            if gate is not None:
                gate.answer()
            if control.poll(5):
                env = P.decode_to_worker(control.recv())
                assert env.incarnation == self.incarnation, env
                msg = env.msg
                if self.silent.is_set():
                    continue
                if isinstance(msg, P.RegisterAck):
                    self.acks.append(msg)
                    if msg.ok:
                        self.registered.set()
                    elif msg.retry:
                        send(reg)
                else:
                    self.received.append(msg)
                    self.on_message(self, msg)
            with self._lock:
                out, self._outbox = self._outbox, []
            for m in out:
                send(m)
            if time.monotonic() >= next_beat and not self.silent.is_set():
                send(P.Heartbeat(self.worker_id, self.address, 1000, self.queue_depth, 0, time.time()))
                next_beat = time.monotonic() + HEARTBEAT_S
        if gate is not None:
            gate.close()
        control.close(0)
        push.close(0)
        ctx.term()

    def got(self, cls) -> list:
        return [m for m in self.received if isinstance(m, cls)]


@contextmanager
def router(tokenizer, **overrides):
    router_keys, worker_keys = keys.new_deployment()
    settings = dict(model="tiny", register="tcp://127.0.0.1:0", heartbeat_interval_s=HEARTBEAT_S,
                    heartbeat_misses=MISSES, kv_deadline_s=3.0, token_timeout_s=2.0, keys=router_keys)
    cfg = RouterConfig(**{**settings, **overrides})
    app = create_app(cfg, tokenizer)
    workers: list[FakeWorker] = []

    def add(role, worker_id, on_message=None, **kw) -> FakeWorker:
        kw.setdefault("keys", worker_keys)
        w = FakeWorker(app.state.router.pool.address, role, worker_id, on_message, **kw)
        workers.append(w)
        w.start()
        assert w.registered.wait(5), f"{worker_id} did not register"
        return w

    try:
        with TestClient(app, base_url="http://localhost") as client:  # a loopback name: the Host guard lets it in
            client.add_worker = add
            client.worker_keys = worker_keys
            yield client
    finally:
        for w in workers:
            w.stopped.set()
            w.join(5)


def colocated_echo(n_tokens: int = 3):
    def on_message(w: FakeWorker, msg):
        if isinstance(msg, P.Generate):
            w.tokens(msg.request_id, [100 + i for i in range(n_tokens)],
                     timeline=P.Timeline(stamps={"taken": 1.0, "prefill_start": 1.0005, "prefill_end": 1.0025,
                                                 "first_step_start": 1.003, "first_step_end": 1.004}))
    return on_message


def sse_events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- colocated --------------------------------------------------------------------------------------


def test_colocated_request_and_its_timeline(tokenizer):
    with router(tokenizer) as client:
        w = client.add_worker("colocated", "c0", colocated_echo(3))
        r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == "<100><101><102>"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(tokenizer.encode("Hello there")), "completion_tokens": 3,
                                 "total_tokens": len(tokenizer.encode("Hello there")) + 3}
        t = body["timings"]
        assert t["policy"] == "colocated" and t["worker"] == "c0" and t["transfer_ms"] is None
        assert t["prefill_ms"] == 2.0 and t["first_decode_step_ms"] == 1.0
        assert 0.5 <= t["queue_ms"] and 0 < t["ttft_ms"] <= t["e2e_ms"]  # the fake's durations are made up
        phases = t["ttft_phases_ms"]
        assert list(phases) == list(PHASE_NAMES) and (phases["prefill_queue"], phases["prefill"]) == (0.5, 2.0)
        # the fake reports no inbox or emit stamps: its round trip cannot be split, and says so (its
        # made-up durations can even exceed the real round trip: then unattributed is negative)
        assert phases["hops"] is None and phases["inbox"] is None and phases["unattributed"] != 0
        assert sum(v for v in phases.values() if v is not None) == pytest.approx(t["ttft_ms"], abs=1e-3)
        [gen] = w.got(P.Generate)
        assert gen.prompt_ids == tokenizer.encode("Hello there") and gen.sampling.max_tokens == 3


def test_silent_worker_fails_the_stream_within_the_heartbeat_deadline(tokenizer):
    def on_message(w, msg):
        if isinstance(msg, P.Generate):
            w.tokens(msg.request_id, [7, 8], finished_last=False)  # two tokens, then the worker "dies"
            w.silent.set()

    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", on_message)
        start = time.monotonic()
        with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "stream": True}) as r:
            events = sse_events(r)
        elapsed = time.monotonic() - start
        assert [e["choices"][0]["text"] for e in events[:2]] == ["<7>", "<8>"]
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == "worker_lost" and "c0" in err["message"] and "heartbeat" in err["message"]
        assert elapsed < HEARTBEAT_S * MISSES + 1.5
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["workers"] == []
        r = client.post("/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and "no colocated worker" in r.json()["error"]["message"]


def test_worker_back_from_silence_is_told_to_abort_what_the_router_failed(tokenizer):
    def on_message(w, msg):
        if isinstance(msg, P.Generate):
            w.silent.set()  # stalls (a long step, a starved CPU) with the request in hand

    with router(tokenizer) as client:
        w = client.add_worker("colocated", "c0", on_message)
        r = client.post("/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"
        rid = r.json()["error"]["message"].split()[1].rstrip(":")
        w.silent.clear()  # it was slow, not dead: heartbeats again, is asked to register again
        deadline = time.monotonic() + 5
        while not w.got(P.Abort) and time.monotonic() < deadline:
            time.sleep(0.02)
        [abort] = w.got(P.Abort)
        assert abort.request_id == rid and client.app.state.router.pool.is_alive("c0")


def test_worker_that_never_answers_times_out(tokenizer):
    with router(tokenizer) as client:
        client.add_worker("colocated", "c0")  # heartbeats, ignores requests
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert "c0" in r.json()["error"]["message"]
        assert 2.0 <= time.monotonic() - start < 4.0


@pytest.mark.parametrize("kind,status,code", [("invalid", 400, None), ("capacity", 503, "no_capacity"),
                                              ("internal", 502, "internal_error"), ("timeout", 504, "timeout")])
def test_worker_failures_map_to_statuses(tokenizer, kind, status, code):
    def on_message(w, msg):
        if isinstance(msg, P.Generate):
            w.send(P.RequestFailed(w.worker_id, msg.request_id, kind, f"scripted {kind} failure"))

    with router(tokenizer) as client:
        client.add_worker("colocated", "c0", on_message)
        r = client.post("/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == status
        err = r.json()["error"]
        assert err["code"] == code and f"scripted {kind} failure" in err["message"]
        assert err["message"].startswith("request cmpl-")


def test_least_loaded_worker_is_chosen(tokenizer):
    with router(tokenizer) as client:
        busy = client.add_worker("colocated", "busy", colocated_echo(1), queue_depth=5)
        idle = client.add_worker("colocated", "idle", colocated_echo(1))
        time.sleep(3 * HEARTBEAT_S)  # both have reported their queue depth
        for _ in range(3):
            assert client.post("/v1/completions", json={"prompt": "Hi"}).json()["timings"]["worker"] == "idle"
        assert not busy.got(P.Generate) and len(idle.got(P.Generate)) == 3


# ---- registration ------------------------------------------------------------------------------------


def test_registration_refuses_other_versions_and_models(tokenizer):
    with router(tokenizer) as client:
        pool = client.app.state.router.pool
        for kw, words in (({"version": P.PROTOCOL_VERSION + 1}, "protocol version"), ({"model": "other"}, "--model tiny")):
            w = FakeWorker(pool.address, "colocated", f"bad-{len(words)}", keys=client.worker_keys, **kw)
            w.start()
            deadline = time.monotonic() + 5
            while not w.acks and time.monotonic() < deadline:
                time.sleep(0.02)
            w.stopped.set()
            [ack] = w.acks
            assert not ack.ok and not ack.retry and words in ack.error
        assert client.get("/health").json()["workers"] == []


def test_unknown_worker_is_asked_to_register_again(tokenizer):
    with router(tokenizer) as client:
        w = client.add_worker("colocated", "c0", colocated_echo(1))
        pool = client.app.state.router.pool
        # on the router's event loop (the TestClient runs it in another thread)
        client.portal.call(pool._drop, pool.workers["c0"], "test: forget it, as a restarted router would")
        deadline = time.monotonic() + 5
        while "c0" not in pool.workers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(a.retry for a in w.acks) and "c0" in pool.workers
        assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200


# ---- disaggregated -----------------------------------------------------------------------------------


class FakePair:
    """A prefill and a decode worker that pass a request along as the real ones do."""

    def __init__(self, client, prefill_fails: bool = False, prefill_holds: bool = False):
        self.reserved: dict[str, P.Reserve] = {}
        self.prefill_fails, self.prefill_holds = prefill_fails, prefill_holds
        self.held: list[P.Prefill] = []
        self.d = client.add_worker("decode", "d0", self.on_decode)
        self.p = client.add_worker("prefill", "p0", self.on_prefill)

    def on_decode(self, w, msg):
        if isinstance(msg, P.Reserve):
            self.reserved[msg.request_id] = msg
            w.send(P.Reserved(w.worker_id, msg.request_id, [10, 11], "tcp://127.0.0.1:1"))

    def on_prefill(self, w, msg):
        if isinstance(msg, P.Prefill):
            if self.prefill_holds:
                self.held.append(msg)
            elif self.prefill_fails:
                w.send(P.RequestFailed(w.worker_id, msg.request_id, "transfer", "scripted transfer failure"))
            else:
                stamps = {"taken": 1.0, "prefill_start": 1.0001, "prefill_end": 1.0031, "kv_delivered": 1.0033}
                w.send(P.PrefillDone(w.worker_id, msg.request_id, 42, P.Timeline(stamps=stamps),
                                     transfer_ms=0.4, kv_bytes=8192, copies=1))
                self.d.tokens(msg.request_id, [42, 43, 44],
                              timeline=P.Timeline(stamps={"first_step_start": 2.0, "first_step_end": 2.0015}))


def test_disaggregated_request_flow(tokenizer):
    with router(tokenizer) as client:
        pair = FakePair(client)
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "policy": "disaggregated",
                                                 "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == [42, 43, 44]
        [reserve] = pair.d.got(P.Reserve)
        [prefill] = pair.p.got(P.Prefill)
        assert pair.p.got(P.Connect) == [P.Connect("d0", "tcp://127.0.0.1:1")]  # handshake before any request
        assert prefill.dst_blocks == [10, 11] and prefill.kv_address == "tcp://127.0.0.1:1"
        assert prefill.decode_worker == "d0" and prefill.prompt_ids == reserve.prompt_ids
        assert prefill.deadline_s < reserve.deadline_s  # P stops writing before D's reservation can lapse
        t = body["timings"]
        assert (t["policy"], t["prefill_worker"], t["decode_worker"], t["worker"]) == ("disaggregated", "p0", "d0", "d0")
        assert (t["transfer_ms"], t["transfer_exposed_ms"], t["kv_bytes"], t["transport"]) == (0.4, 0.2, 8192, "ipc")
        assert t["first_decode_step_ms"] == 1.5 and t["prefill_ms"] == 3.0 and t["prompt_tokens"] == len(reserve.prompt_ids)
        phases = t["ttft_phases_ms"]
        assert (phases["prefill"], phases["transfer_exposed"], phases["hops"]) == (3.0, 0.2, None)
        assert phases["unattributed"] != 0 and phases["route"] > 0  # route: the reservation's round trip
        assert sum(v for v in phases.values() if v is not None) == pytest.approx(t["ttft_ms"], abs=1e-3)
        assert not pair.d.got(P.Abort)


def test_failed_prefill_cancels_the_reservation(tokenizer):
    with router(tokenizer) as client:
        pair = FakePair(client, prefill_fails=True)
        r = client.post("/v1/completions", json={"prompt": "Hello", "policy": "disaggregated"})
        assert r.status_code == 502 and "scripted transfer failure" in r.json()["error"]["message"]
        deadline = time.monotonic() + 2
        while not pair.d.got(P.Abort) and time.monotonic() < deadline:
            time.sleep(0.01)
        [abort] = pair.d.got(P.Abort)
        assert abort.request_id == r.json()["error"]["message"].split()[1].rstrip(":")


def test_client_leaving_aborts_both_sides(tokenizer):
    with router(tokenizer) as client:
        pair = FakePair(client, prefill_holds=True)
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "Hello", "policy": "disaggregated", "stream": True}) as r:
            deadline = time.monotonic() + 2
            while not pair.held and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pair.held, "the prefill worker never got the request"
        # closing the stream is the client leaving: P and D both get Abort (D frees its blocks once its
        # receiver says no write can land, see test_worker_roles.py)
        deadline = time.monotonic() + 3
        while not (pair.d.got(P.Abort) and pair.p.got(P.Abort)) and time.monotonic() < deadline:
            time.sleep(0.01)
        [p_abort] = pair.p.got(P.Abort)
        [d_abort] = pair.d.got(P.Abort)
        assert p_abort.request_id == d_abort.request_id == pair.held[0].request_id


def test_auto_policy_by_prompt_length_and_fallback(tokenizer):
    with router(tokenizer, auto_threshold=8) as client:
        FakePair(client)
        client.add_worker("colocated", "c0", colocated_echo(1))
        short = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        long = client.post("/v1/completions", json={"prompt": "one two three four five six seven eight nine ten",
                                                    "max_tokens": 3})
        assert short.json()["timings"]["policy"] == "colocated"
        assert long.json()["timings"]["policy"] == "disaggregated"
        forced = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "policy": "disaggregated"})
        assert forced.json()["timings"]["policy"] == "disaggregated"


def test_auto_falls_back_and_explicit_policy_says_what_is_missing(tokenizer):
    with router(tokenizer, auto_threshold=8) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))
        long = client.post("/v1/completions", json={"prompt": "one two three four five six seven eight nine ten"})
        assert long.json()["timings"]["policy"] == "colocated"  # no decode worker: auto stays colocated
        r = client.post("/v1/completions", json={"prompt": "Hi", "policy": "disaggregated"})
        assert r.status_code == 503
        assert "no decode worker" in r.json()["error"]["message"] and r.json()["error"]["code"] == "no_worker"
