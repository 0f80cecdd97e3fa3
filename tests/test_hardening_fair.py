"""Budgets that one client cannot fill (issue 34), on a real uvicorn in this process with fake workers
(test_hardening_http.live_router), clients told apart by their loopback source address (127.0.0.x):

- bodies: one address holds at most its share (--client-share) of --max-bodies-mb; when the budget is
  full, the address holding the most gives way to one holding less; a slow body is cut by its rate
  (--min-body-rate), long before --body-timeout, while a body that keeps coming is read whole
- connections: one address holds at most its share of --max-connections; at the cap, the address
  holding the most gives way
- an answer whose client never reads it is aborted after --send-timeout (not kept, with its buffered
  bytes and its descriptor, for ever)
- out of descriptors: HTTP leaves a reserve, so a worker that connects still gets in (libzmq aborts
  the whole router when its accept() finds none), in a router under a lowered RLIMIT_NOFILE
Each attack runs beside a well-behaved client (127.0.0.1), which must be served.
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.protocol import control as P
from pdserve.settings.keys import keygen, load_worker_keys
from test_hardening_http import LONG_TEXT, closed_within, flood, live_router, post, raw
from test_server_harness import Pdserve
from test_server_router import FakeWorker, colocated_echo, tokenizer  # noqa: F401  (tokenizer: a fixture)

pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]

KIB = 1024
GOOD = b'{"prompt": "Hi", "max_tokens": 2}'  # the well-behaved client's request, from 127.0.0.1


def upload(url: str, source: str, declared: int, sent: int, path: str = "/v1/completions") -> socket.socket:
    """A connection from `source` that starts a body of `declared` bytes and sends `sent` of them."""
    head = (b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), declared))
    return raw(url, head + (b'{"prompt": "' + b"a" * declared)[:sent], source=source)


def answer(s: socket.socket, seconds: float = 0.3) -> bytes:
    """What the server answered on `s` within `seconds` (b"" when nothing yet)."""
    return closed_within(s, seconds)[1]


def status_of(s: socket.socket, seconds: float) -> int | None:
    """The status of the server's answer on `s`, read as soon as its status line is in."""
    s.settimeout(0.1)
    got, end = b"", time.monotonic() + seconds
    while b"\r\n" not in got and time.monotonic() < end:
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        if not chunk:
            break
        got += chunk
    return int(got.split(b" ", 2)[1]) if b"\r\n" in got else None


def code_of(got: bytes) -> str | None:
    if b"\r\n\r\n" not in got:
        return None
    body = got.split(b"\r\n\r\n", 1)[1]
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def wait_until(predicate, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---- bodies ---------------------------------------------------------------------------------------

BODY, BODIES = 64 * KIB, 512 * KIB  # the share: 128 KiB, two whole bodies


def test_one_address_cannot_hold_the_body_budget(tokenizer):  # noqa: F811
    """The issue's attack, scaled: budget/body + 1 uploads of a body less one byte, from one address."""
    with live_router(tokenizer, max_body_bytes=BODY, max_bodies_bytes=BODIES, min_body_rate=0) as (url, router, _):
        held = []
        for _ in range(BODIES // BODY + 1):
            held.append(upload(url, "127.0.0.2", BODY, BODY - 1))
            time.sleep(0.1)  # read by the router, in this order
        codes = [code_of(answer(s)) for s in held]
        assert codes.count(None) == 2 and codes[2:] == ["client_bodies_in_flight"] * (len(held) - 2), codes
        assert router.bodies.held["127.0.0.2"] <= router.cfg.client_bodies_bytes == 2 * BODY
        r = post(url, "/v1/completions", GOOD)  # the well-behaved client, beside the held uploads
        assert r.status_code == 200, r.text
        for s in held:
            s.close()


def test_a_full_budget_is_given_back_by_the_address_holding_most(tokenizer):  # noqa: F811
    """Eight addresses, each at its share: 1 MiB wanted of a 512 KiB budget. The budget is never over,
    newcomers take room from the fullest addresses, and the well-behaved client gets in."""
    with live_router(tokenizer, max_body_bytes=BODY, max_bodies_bytes=BODIES, min_body_rate=0) as (url, router, _):
        held, peak = [], [0]
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                peak[0] = max(peak[0], router.bodies.in_flight)
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for i in range(8):
            for _ in range(2):
                held.append(upload(url, f"127.0.0.{2 + i}", BODY, BODY - 1))
                time.sleep(0.05)
        wait_until(lambda: router.bodies.in_flight >= BODIES - 2 * BODY, 3.0)
        r = post(url, "/v1/completions", GOOD)
        watching.set()
        watcher.join()
        assert r.status_code == 200, r.text
        answers = [answer(s, 0.1) for s in held]
        codes = [code_of(a) for a in answers]
        # once full, an address's first upload (64 KiB) cuts one of an address holding 128 KiB; its second
        # would bring it level with them, so it is refused
        assert codes.count("body_cut_for_room") >= 3 and codes.count("bodies_in_flight") >= 3, codes
        assert set(codes) <= {None, "body_cut_for_room", "bodies_in_flight"}, codes
        assert peak[0] <= BODIES, peak[0]
        cut = answers[codes.index("body_cut_for_room")]
        assert cut.startswith(b"HTTP/1.1 503") and b"retry-after" in cut.lower(), cut[:300]
        for s in held:
            s.close()
        assert wait_until(lambda: router.bodies.in_flight == 0 and not router.bodies.uploads)


def test_a_slow_body_is_cut_by_its_rate(tokenizer):  # noqa: F811
    """A byte every 0.3 s (the issue's: one every 3 s) is cut after its first window, not after
    --body-timeout (60 s); a body sent in pieces at 10 KiB/s is read whole."""
    with live_router(tokenizer, min_body_rate=KIB, rate_window_s=1.0, max_model_len=100_000) as (url, router, _):
        slow = upload(url, "127.0.0.2", 10_000, 5)
        start, got = time.monotonic(), b""
        while not got and time.monotonic() - start < 4.0:
            slow.sendall(b"a")
            got = answer(slow, 0.3)
        took = time.monotonic() - start
        assert got.startswith(b"HTTP/1.1 408") and code_of(got) == "body_too_slow", got[:300]
        assert took < 2.5, took
        body = b'{"prompt": "' + b"hi " * 8000 + b'", "max_tokens": 2}'
        s = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for at in range(0, len(body), 2 * KIB):  # ~24 KiB over ~2.4 s: several windows, each above the floor
            s.sendall(body[at:at + 2 * KIB])
            time.sleep(0.2)
        assert status_of(s, 5.0) == 200
        assert post(url, "/v1/completions", GOOD).status_code == 200
        slow.close()
        s.close()


# ---- connections ----------------------------------------------------------------------------------

CONNECTIONS = 16  # the share: 4


def test_one_address_cannot_hold_every_connection(tokenizer):  # noqa: F811
    with live_router(tokenizer, max_connections=CONNECTIONS, header_timeout_s=30, min_body_rate=0) as (url, *_):
        held = [upload(url, "127.0.0.2", 1000, 100) for _ in range(CONNECTIONS)]  # busy: a body under way
        answers = [answer(s) for s in held]
        codes = [code_of(a) for a in answers]
        assert codes[:4] == [None] * 4 and codes[4:] == ["client_connections"] * (CONNECTIONS - 4), codes
        assert answers[4].startswith(b"HTTP/1.1 429"), answers[4]
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert post(url, "/v1/completions", GOOD).status_code == 200
        for s in held:
            s.close()


def test_at_the_connection_cap_the_address_holding_most_gives_way(tokenizer):  # noqa: F811
    with live_router(tokenizer, max_connections=CONNECTIONS, header_timeout_s=30, min_body_rate=0) as (url, *_):
        held = [upload(url, f"127.0.0.{2 + i}", 1000, 100) for i in range(6) for _ in range(4)]  # 24 busy
        time.sleep(0.3)
        r = post(url, "/v1/completions", GOOD)
        assert r.status_code == 200, r.text
        gone = [s for s in held if closed_within(s, 0.05)[0]]
        assert len(gone) >= 24 - CONNECTIONS + 1, len(gone)  # room was made, once for each newcomer over the cap
        for s in held:
            s.close()


class Conn:
    """A connection as ConnectionTable sees it."""

    def __init__(self, peer: str, opened: float, busy: bool = False, stuck: bool = False):
        self.peer, self.opened, self.idle_since, self.busy, self._stuck = peer, opened, opened, busy, stuck

    def idle(self) -> bool:
        return not self.busy and not self._stuck

    def stuck(self) -> bool:
        return self._stuck


def test_who_gives_way_at_the_caps():
    from pdserve.server.connections import ConnectionTable, Limits

    table = ConnectionTable(Limits(cap=4, per_peer=2, fd_line=0, header_timeout_s=1, send_timeout_s=1))
    a1, a2 = Conn("A", 0.0), Conn("A", 0.1)
    assert table.admit(a1, 0.1) == (None, None) and table.admit(a2, 0.1) == (None, None)
    # past A's share: its idle connections are too fresh to close (their requests may be on the way)...
    assert table.admit(Conn("A", 0.2), 0.2) == (None, "client_connections")
    a3 = Conn("A", 1.0)
    assert table.admit(a3, 1.0) == (a1, None)  # ...until idle IDLE_GRACE_S: the longest idle gives way
    a2.busy = a3.busy = True
    b1, b2 = Conn("B", 1.0, busy=True), Conn("B", 1.1, stuck=True)
    assert table.admit(b1, 1.1) == (None, None) and table.admit(b2, 1.1) == (None, None)  # at the cap now
    c1 = Conn("C", 1.2, busy=True)
    assert table.admit(c1, 1.2) == (b2, None)  # a stuck one goes first, however fresh
    # every one busy: the newest of an address holding more than the newcomer would (2 > 1) gives way
    d1 = Conn("D", 1.3, busy=True)
    assert table.admit(d1, 1.3) == (a3, None)
    # A 1, B 1, C 1, D 1: nobody holds more than a second connection from D would
    assert table.admit(Conn("D", 1.4), 1.4) == (None, "too_many_connections")
    assert {p: len(c) for p, c in table.by_peer.items()} == {"A": 1, "B": 1, "C": 1, "D": 1}


# ---- clients that never read their answer ---------------------------------------------------------


def test_an_answer_never_read_is_dropped_after_the_send_timeout(tokenizer):  # noqa: F811
    n = 3000  # ~3 MB of JSON: more than the kernel's buffers take for a client that reads nothing
    with live_router(tokenizer, worker=flood(n), max_model_len=20000, send_timeout_s=1.0) as (url, *_):
        body = b'{"prompt": "Hi", "max_tokens": %d}' % n
        host, port = url.removeprefix("http://").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(3.0)  # never read: past --send-timeout (and the sweep after it)
        assert post(url, "/v1/completions", GOOD).status_code == 200  # the well-behaved client meanwhile
        s.settimeout(5)
        got, reset = 0, False
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            reset = True
        s.close()
        assert reset and got < n * len(LONG_TEXT), (reset, got)


# ---- out of descriptors ---------------------------------------------------------------------------

FD_LIMIT = 512  # the reserve (server/connections.py): 256 + 4 accept bursts of 32, from descriptor 128 up
OTHER_FILES = 60  # descriptors the router holds besides HTTP (here /dev/null): HTTP meets the reserve first
ROUTER = textwrap.dedent(f"""
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT}))
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range({OTHER_FILES})]
    from pdserve.server.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_out_of_descriptors_a_worker_still_connects(tmp_path):
    """Clients that never read 1 MB answers, from four addresses, more of them than the open-file
    limit, and a worker registering over ipc:// in the middle of them: the router keeps its reserve
    and lives, the worker gets in, a well-behaved client is served, and once the send timeout has
    passed the descriptors are back."""
    router_dir, worker_dir = keygen(tmp_path / "keys")
    keys = load_worker_keys(worker_dir)
    register = f"ipc://{tmp_path}/register"
    cmd = [sys.executable, "-c", ROUTER, "router", "--model", "tiny", "--port", "0", "--register", register,
           "--keys", str(router_dir), "--send-timeout", "2"]
    body = b'{"prompt": "Hi", "max_tokens": 1000}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    workers = [FakeWorker(register, "colocated", "c0", flood(1000, batch=500), keys=keys, max_model_len=20000),
               FakeWorker(register, "colocated", "c1", colocated_echo(2), keys=keys)]
    clients: list[socket.socket] = []
    with Pdserve(command=cmd) as srv:
        pid = srv.proc.pid
        try:
            workers[0].start()
            assert workers[0].registered.wait(10)
            before, peak = fds(pid), 0
            host, port = srv.url.removeprefix("http://").split(":")
            for i in range(FD_LIMIT + 100):
                if i == FD_LIMIT:  # the old router's descriptors ran out long before: it died here
                    workers[1].start()
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.bind((f"127.0.0.{2 + i % 4}", 0))
                clients.append(s)
                try:
                    s.connect((host, int(port)))
                    s.sendall(request)
                except OSError:
                    pass
                if i % 25 == 0:  # a pause for the router to take them: connections over its listen backlog
                    time.sleep(0.05)  # would wait for a SYN retry (1 s)
                    assert srv.proc.poll() is None, f"the router died\n{srv.log_text()[-3000:]}"
                    peak = max(peak, fds(pid))
            registered = workers[1].registered.wait(10)
            assert srv.proc.poll() is None, f"the router died (rc {srv.proc.returncode})\n{srv.log_text()[-3000:]}"
            assert registered, srv.log_text()[-3000:]
            assert peak < FD_LIMIT - 256, peak  # the reserve was never entered
            # the well-behaved client: served, after at most a few 503s while every descriptor below the
            # reserve is held (each refusal closes the connection that gives way at the cap, so the next one fits)
            statuses = []
            while len(statuses) < 5 and 200 not in statuses:
                r = httpx.post(srv.url + "/v1/completions", content=GOOD, timeout=30,
                               headers={"content-type": "application/json"})
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert r.json()["error"]["code"] == "out_of_descriptors", r.text
                    time.sleep(float(r.headers["retry-after"]) / 10)
            assert statuses[-1] == 200 and len(statuses) <= 3, statuses
            # the answers never read are dropped (--send-timeout), idle connections closed: descriptors back
            assert wait_until(lambda: fds(pid) <= before + 5, 10.0), (before, fds(pid))
        finally:
            for s in clients:
                s.close()
            for w in workers:
                w.stopped.set()
                if w.is_alive():
                    w.join(5)
