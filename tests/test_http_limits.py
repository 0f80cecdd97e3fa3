"""Hostile HTTP input against a live pdserve (tiny model, the shared one of conftest.py, every process real):

- a table of hostile requests: each gets a 4xx naming the field (where there is one), fast, while a
  sampled stream on the same worker runs beside them and completes every token; requests that are
  odd but valid are served (a temperature that would overflow the logits, greedily; seeds 2**50 and
  2**63-1 with sampling); the router's memory afterwards is within 20% of before
- the API key (Bearer) on every endpoint but /health, which shows addresses and PIDs only with it
- the workers pdserve started got their key as a path to a private file, never on a command line
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from test_server_router import colocated_echo, router, tokenizer  # noqa: F401  (tokenizer: a fixture)
from pdserve.protocol.sampling import MAX_SEED

pytestmark = pytest.mark.timeout(300)

MB = 2**20
DEEP = 100_000
STREAM_TOKENS = 160


@pytest.fixture(scope="module")
def srv(tiny_pdserve):
    return tiny_pdserve  # the request-only live tests' shared pdserve (conftest.py)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw_post(url: str, path: str, head: bytes, declared: int | None, chunked: bytes | None = None,
             timeout: float = 10.0) -> int:
    """POST over a bare socket: send the headers and `head` of the body (a body of `declared` bytes, or
    chunked ones that never end), then read the status line; a server that refuses early answers
    before the rest would have been sent."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        length = f"Content-Length: {declared}\r\n" if declared is not None else "Transfer-Encoding: chunked\r\n"
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{length}\r\n".encode())
        try:
            if chunked is None:
                s.sendall(head)
            else:
                s.sendall(f"{len(head):x}\r\n".encode() + head + b"\r\n")
                end = time.monotonic() + timeout
                while time.monotonic() < end:  # keep streaming until the server answers or hangs up
                    s.sendall(f"{len(chunked):x}\r\n".encode() + chunked + b"\r\n")
                    s.settimeout(0.0)
                    try:
                        if s.recv(1, socket.MSG_PEEK):
                            break
                    except BlockingIOError:
                        pass
                    s.settimeout(timeout)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(timeout)
        return int(s.recv(4096).split(b" ", 2)[1])


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


# (name, path, body: dict or raw bytes, status, param, words in the message)
HOSTILE = [
    ("seed past 2**64", "/v1/completions", {"prompt": "hi", "temperature": 0.7, "seed": 2**64 + 1}, 400, "seed",
     "2**63-1"),
    ("seed 2**63", "/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed", "2**63-1"),
    ("negative seed", "/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", "2**63-1"),
    ("huge top_k", "/v1/completions", {"prompt": "hi", "temperature": 0.5, "top_k": 2**40}, 400, "top_k", "in [0, 2147483647]"),
    ("huge max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, 400, "max_tokens", "in [1, 2147483647]"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", "finite"),
    ("Infinity top_p", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p", "finite"),
    ("JSON 100,000 deep", "/v1/completions", nested(DEEP), 400, "prompt", "nests deeper"),
    ("JSON 40 deep", "/v1/completions", nested(40), 400, "prompt", "nests deeper"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "caf\\ud800e"}', 400, "prompt", "lone surrogate"),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "hi", "stop": ["ok", "\\udfff"]}', 400, "stop.1",
     "lone surrogate"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}', 400, "messages.0.content", "lone surrogate"),
    ("lone surrogate in a key", "/v1/completions", b'{"prompt": "hi", "x\\ud800": 1}', 400, "x\\ud800",
     "lone surrogate"),
    ("3,000 chat messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 3000}, 400,
     "messages", "at most 2048"),
    ("a 3 MB prompt", "/v1/completions", {"prompt": "a" * (3 * MB)}, 400, "prompt", "more than the model's context"),
    ("a 5,000-character stop", "/v1/completions", {"prompt": "hi", "stop": ["x" * 5000]}, 400, "stop", "4096"),
    ("token id past msgpack", "/v1/completions", {"prompt": [2**70]}, 400, "prompt", "outside the vocabulary"),
    ("a 5 MB body", "/v1/completions", {"prompt": "b" * (5 * MB)}, 413, None, "at most"),
]


def test_hostile_input_is_refused_and_hurts_no_one(srv):
    pid = srv.proc.pid
    srv.post("/v1/completions", {"prompt": "warm up", "max_tokens": 2})
    rss_before = rss_mb(pid)
    events: list = []

    def stream() -> None:  # sampled, on the same (only) worker, long enough to span the whole table
        body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0.8,
                "seed": 11, "stream": True}
        events.extend(e for _, e in srv.stream("/v1/completions", body))

    beside = threading.Thread(target=stream)
    beside.start()
    time.sleep(0.5)
    failures = []
    for name, path, body, status, param, words in HOSTILE:
        start = time.monotonic()
        r = srv.post(path, body)
        took = time.monotonic() - start
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != status or err.get("param") != param or words not in err.get("message", "") or took > 2.0:
            failures.append(f"{name}: {r.status_code} in {took:.2f}s {r.text[:300]}")
    # bodies that are never sent whole: refused from Content-Length, or as the stream passes the limit
    if (code := raw_post(srv.url, "/v1/completions", b'{"prompt": "', 100 * MB)) != 413:
        failures.append(f"a declared 100 MB body: {code}")
    if (code := raw_post(srv.url, "/v1/completions", b'{"prompt": "', None, chunked=b"c" * MB)) != 413:
        failures.append(f"an endless chunked body: {code}")
    three = [threading.Thread(target=lambda: failures.extend(
        [] if (c := raw_post(srv.url, "/v1/completions", b'{"prompt": "', 20 * MB)) == 413 else [f"20 MB: {c}"]))
        for _ in range(3)]
    for t in three:
        t.start()
    for t in three:
        t.join()
    # odd but valid: served, beside the stream (greedy where the temperature would overflow the logits)
    greedy = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    tiny_t = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
                                          "temperature": 1e-40, "return_token_ids": True})
    big_seeds = [srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
                                              "temperature": 0.9, "seed": seed}) for seed in (2**50, MAX_SEED)]
    for r in (greedy, tiny_t, *big_seeds):
        if r.status_code != 200:
            failures.append(f"a valid request: {r.status_code} {r.text[:300]}")
    beside.join(120)
    assert not failures, "\n".join(failures)
    assert tiny_t.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert events and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == STREAM_TOKENS
    rss_after = rss_mb(pid)
    assert rss_after <= rss_before * 1.2, (rss_before, rss_after)


def test_workers_get_their_key_as_a_private_file_never_on_the_command_line(srv):
    for pid in srv.worker_pids().values():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        folder = Path(args[args.index(b"--keys") + 1].decode())
        secret = folder / "worker.key_secret"
        assert folder.stat().st_mode & 0o777 == 0o700 and secret.stat().st_mode & 0o777 == 0o600
        assert folder.parent.stat().st_mode & 0o777 == 0o700  # the run directory
        key = [line.split('"')[1] for line in secret.read_text().splitlines() if "secret-key" in line][0]
        assert key.encode() not in b" ".join(args)
        assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()


# ---- the API key (a router with fake workers) -----------------------------------------------------

KEY = "k3y-" + "0123456789abcdef" * 2


def test_api_key_guards_everything_but_a_bare_health(tokenizer):  # noqa: F811
    with router(tokenizer, api_key=KEY) as client:
        client.add_worker("colocated", "c0", colocated_echo(1))
        good = {"Authorization": f"Bearer {KEY}"}
        for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": KEY}):
            r = client.post("/v1/completions", json={"prompt": "Hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                               headers=headers).status_code == 401
            assert client.get("/v1/models", headers=headers).status_code == 401
            assert client.get("/metrics", headers=headers).status_code == 401
        assert client.post("/v1/completions", json={"prompt": "Hi"}, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/metrics", headers=good).status_code == 200
        bare, full = client.get("/health").json(), client.get("/health", headers=good).json()
        assert bare["status"] == full["status"] == "ok" and [w["id"] for w in bare["workers"]] == ["c0"]
        assert "register" not in bare and not {"address", "pid", "kv_address"} & set(bare["workers"][0])
        assert full["register"] and {"address", "pid", "kv_address"} <= set(full["workers"][0])
        assert json.dumps(bare).find("tcp://") == -1


def test_the_api_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    import argparse

    from pdserve.server import cli

    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    parser = argparse.ArgumentParser()
    cli.add_router_arguments(parser, register_default=None)
    assert cli.api_key(parser.parse_args([])) == KEY
    key_file = tmp_path / "api-key"
    key_file.write_text("from-a-file-0123456789\n")
    assert cli.api_key(parser.parse_args(["--api-key-file", str(key_file)])) == "from-a-file-0123456789"
    monkeypatch.delenv("PDSERVE_API_KEY")
    parser = argparse.ArgumentParser()
    cli.add_router_arguments(parser, register_default=None)
    assert cli.api_key(parser.parse_args([])) is None
