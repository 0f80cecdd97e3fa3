"""The control-plane protocol: every message survives msgpack, and nothing else gets in."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from workers import protocol as P

S = P.Sampling(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=["\n"], ignore_eos=True)
TO_ROUTER = [
    P.Register(P.PROTOCOL_VERSION, "decode-0", "decode", "tcp://10.0.0.2:7201", "smollm2-135m", 8192, 16, 1000, 990,
               "cuda:1", "bfloat16", 4242, "nixl", "layer", "tcp://10.0.0.2:7300"),
    P.Heartbeat("decode-0", "tcp://10.0.0.2:7201", 990, 3, 7, 1.5e9),
    P.Goodbye("decode-0", "signal SIGTERM"),
    P.Reserved("decode-0", "r1", [4, 5, 6], "tcp://10.0.0.2:7300"),
    P.PrefillDone("prefill-0", "r1", 42, P.Timeline(wait_ms=0.1, prefill_ms=30.0), 1.2, 0.3, 1 << 20, 2),
    P.Tokens("decode-0", [P.TokenOut("r1", 42, " Paris"), P.TokenOut("r1", 13, ".", True, "stop",
                                                                      P.Timeline(first_step_ms=5.0))]),
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


@pytest.mark.parametrize("msg", TO_ROUTER, ids=lambda m: type(m).__name__)
def test_worker_to_router_round_trip(msg):
    assert P.decode_to_router(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: type(m).__name__)
def test_router_to_worker_round_trip(msg):
    assert P.decode_to_worker(P.encode(msg)) == msg


def test_sampling_becomes_engine_params():
    params = S.to_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.stop,
            params.ignore_eos) == (5, 0.7, 0.9, 40, 3, ["\n"], True)


@pytest.mark.parametrize("frame", [
    pickle.dumps({"type": "generate"}),  # a pickle is not msgpack: refused, never unpickled
    msgspec.msgpack.encode({"type": "shutdown_everything"}),  # unknown tag
    msgspec.msgpack.encode({"type": "generate", "request_id": 5}),  # wrong field type, missing fields
    P.encode(P.Heartbeat("w", "tcp://x:1", 1, 0, 0, 0.0)),  # a worker->router message sent the wrong way
    b"",
])
def test_anything_else_is_a_protocol_error(frame):
    with pytest.raises(P.ProtocolError, match="protocol version"):
        P.decode_to_worker(frame)
