"""The control-plane protocol: every message survives msgpack in its envelope, nothing else gets in,
and every number is bounded before any code sees it."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from pdserve.protocol import control as P
from pdserve.protocol import sampling as SB

S = P.Sampling(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=["\n"], ignore_eos=True)
TO_ROUTER = [
    P.Register(P.PROTOCOL_VERSION, "decode-0", "decode", "tcp://10.0.0.2:7201", "smollm2-135m", 8192, 16, 1000, 990,
               "cuda:1", "bfloat16", 4242, "nixl", "layer", "tcp://10.0.0.2:7300"),
    P.Heartbeat("decode-0", "tcp://10.0.0.2:7201", 990, 3, 7, 1.5e9),
    P.Goodbye("decode-0", "signal SIGTERM"),
    P.Reserved("decode-0", "r1", [4, 5, 6], "tcp://10.0.0.2:7300"),
    P.PrefillDone("prefill-0", "r1", 42, P.Timeline({"taken": 7.0, "prefill_start": 7.25, "prefill_end": 7.5}),
                  1.2, 1 << 20, 2),
    P.Tokens("decode-0", [P.TokenOut("r1", 42, " Paris"), P.TokenOut("r1", 13, ".", True, "stop",
                                                                      P.Timeline({"token1_sent": 9.5}))]),
    P.RequestFailed("prefill-0", "r1", "transfer", "peer gone"),
]
TO_WORKER = [
    P.RegisterAck(P.PROTOCOL_VERSION, True, 0.5),
    P.RegisterAck(P.PROTOCOL_VERSION, False, error="unknown worker", retry=True),
    P.Generate("r1", [1, 2, 3], S),
    P.Reserve("r1", [1, 2, 3], S, 60.0),
    P.Prefill("r1", [1, 2, 3], S, "decode-0", "tcp://10.0.0.2:7300", [4], 58.5),
    P.Connect("decode-0", "tcp://10.0.0.2:7300"),
    P.Abort("r1", "client left"),
]


INC = "5f0c3a9d2b7e41c8a6d0f1e2b3c4d5e6"


@pytest.mark.parametrize("msg", TO_ROUTER, ids=lambda m: type(m).__name__)
def test_worker_to_router_round_trip(msg):
    assert P.decode_to_router(P.from_worker(INC, msg)) == P.FromWorker(INC, msg)


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: type(m).__name__)
def test_router_to_worker_round_trip(msg):
    assert P.decode_to_worker(P.from_router(INC, msg)) == P.FromRouter(INC, msg)


def test_the_wire_sampling_is_the_engines():
    from pdserve.workers.engine.request import SamplingParams

    assert SamplingParams is P.Sampling  # one definition: what the router sends is what the engine samples by
    assert S.checked() is S and not S.greedy


def test_temperatures_that_would_overflow_the_logits_sample_greedily():
    assert P.Sampling(temperature=1e-40).greedy and P.Sampling(temperature=0.0).greedy
    assert not P.Sampling(temperature=SB.MIN_TEMPERATURE).greedy


def _generate(**sampling) -> bytes:
    """A Generate frame built by hand (the structs themselves would refuse nothing at encode time)."""
    body = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [],
            "ignore_eos": False, **sampling}
    return msgspec.msgpack.encode({"incarnation": INC, "msg": {"type": "generate", "request_id": "r1",
                                                               "prompt_ids": [1, 2], "sampling": body}})


@pytest.mark.parametrize("frame", [
    pickle.dumps({"type": "generate"}),  # a pickle is not msgpack: refused, never unpickled
    msgspec.msgpack.encode({"type": "shutdown_everything"}),  # unknown tag
    msgspec.msgpack.encode({"type": "generate", "request_id": 5}),  # wrong field type, missing fields
    P.encode(P.Generate("r1", [1], S)),  # no envelope: no incarnation
    P.from_worker(INC, P.Heartbeat("w", "tcp://x:1", 1, 0, 0, 0.0)),  # worker->router sent the wrong way
    msgspec.msgpack.encode({"incarnation": "", "msg": msgspec.to_builtins(P.Abort("r1", "x"))}),  # empty id
    _generate(seed=2**63),  # past the engine's 64-bit signed seed
    _generate(seed=-1),
    _generate(max_tokens=0),
    _generate(max_tokens=2**31),
    _generate(top_k=2**31),
    _generate(top_k=-1),
    _generate(temperature=float("nan")),
    _generate(temperature=float("inf")),
    _generate(temperature=SB.MAX_TEMPERATURE + 0.5),  # above the one bound the HTTP API and the engine share too
    _generate(presence_penalty=2.5),
    _generate(logprobs=21),
    _generate(top_p=0.0),
    _generate(stop=["x"] * 17),
    msgspec.msgpack.encode({"incarnation": INC, "msg": {"type": "prefill", "request_id": "r1", "prompt_ids": [1],
                            "sampling": {}, "decode_worker": "d", "kv_address": "tcp://x:1", "dst_blocks": [-4],
                            "deadline_s": 5.0}}),  # a negative block id
    msgspec.msgpack.encode({"incarnation": INC, "msg": {"type": "generate", "request_id": "r" * 300,
                            "prompt_ids": [1], "sampling": {}}}),  # an id past 256 characters
    b"",
])
def test_anything_else_is_a_protocol_error(frame):
    with pytest.raises(P.ProtocolError, match="protocol version"):
        P.decode_to_worker(frame)


def test_the_bounds_let_the_extremes_through():
    frame = _generate(seed=SB.MAX_SEED, max_tokens=P.MAX_INT32, top_k=P.MAX_INT32, temperature=SB.MAX_TEMPERATURE)
    s = P.decode_to_worker(frame).msg.sampling
    assert (s.seed, s.max_tokens, s.top_k, s.temperature) == (SB.MAX_SEED, P.MAX_INT32, P.MAX_INT32, SB.MAX_TEMPERATURE)


def test_worker_to_router_bounds():
    bad = msgspec.msgpack.encode({"incarnation": INC, "msg": {"type": "tokens", "worker_id": "w", "outputs": [
        {"request_id": "r1", "token_id": -1, "text": "x"}]}})
    with pytest.raises(P.ProtocolError):
        P.decode_to_router(bad)
    with pytest.raises(P.ProtocolError):  # a worker message without its incarnation
        P.decode_to_router(P.encode(P.Goodbye("w", "bye")))
