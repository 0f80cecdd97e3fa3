"""Twenty hostile clients beside a well-behaved one (issue 34's "must show"), on a live tiny pdserve
with its default budgets (one colocated worker, which the well-behaved client shares with the
attackers of item 4). Each attacker has a loopback address of its own (127.0.0.10-29); the
well-behaved client is 127.0.0.1 and sends one request at a time:

    uploads            (item 1) each holds as many uploads as the router takes (up to 64), none ever
                       complete, sized to fill the body budget to the byte (the issue's: 17 of 4 MiB less
                       a byte): twice as large after one is taken, half after one is refused; half of
                       them also send a byte every 3 s
    bad_words          (item 3) completions with 64 bad words of 60,000 characters (3.8 MB), one after
                       another
    allowed_token_ids  (item 4) completions with n=16 and 600,000 allowed ids, one after another

The well-behaved client's latency is measured undisturbed and under the attack in turns (3 rounds):
every one of its requests beside the attack must succeed, their median within twice its median latency
alone and the slowest within three times (before the fair budgets, one took six times).

    python -m pytest tests/test_hostile_clients.py -q -s     # -s prints the latencies and what each saw

[item1] runs the uploads alone (20 of them); [items1-3-4] all three kinds (7, 7 and 6), on the same
pdserve (a fresh one if the first case's attack left it unable to serve).
"""

from __future__ import annotations

import functools
import json
import socket
import statistics
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from test_server_harness import TINY, Pdserve

pytestmark = [pytest.mark.timeout(240), pytest.mark.alone]

MIB = 2**20
ROUNDS = 3  # of: 2 requests alone, the attack starts, FILL_S, 3 requests beside it, the attack ends
FILL_S = 2.0  # without fair budgets, the uploads fill the body budget within ~1.5 s
SETTLE_S = 0.5  # the most the router is given to close the attackers' connections after the attack
TIMEOUT_S = 10.0  # any request's (the well-behaved one takes ~0.5 s alone): bounds the test when it fails
GOOD = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 24, "ignore_eos": True}
HELD = 64  # uploads one attacker holds at most
PAYLOAD = memoryview(b'{"prompt": "' + b"a" * (4 * MIB))  # the uploads' bytes, sliced: made once
VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def started() -> dict:
    """The pdserve the cases share (a start costs seconds); stopped, and its clean exit checked, at the end."""
    box: dict = {"srv": None}
    yield box
    if box["srv"] is not None:
        box["srv"].stop()


@pytest.fixture
def srv(started):
    """A router the attack has wedged must not stand in for the next test's: one that does not serve the
    well-behaved client within TIMEOUT_S is replaced by a fresh one (its log kept)."""
    if started["srv"] is not None and not serving(started["srv"]):
        print(f"the router the previous case attacked does not serve; a fresh one (log: {started['srv'].log.name})")
        started["srv"].kill(keep_log=True)
        started["srv"] = None
    if started["srv"] is None:
        started["srv"] = Pdserve(*TINY, "--prefill-workers", "0", "--decode-workers", "0").__enter__()
    return started["srv"]


def serving(srv: Pdserve) -> bool:
    if srv.proc.poll() is not None:
        return False
    try:
        return httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def address(i: int) -> str:
    return f"127.0.0.{10 + i}"


class Attackers:
    """Threads that attack until stop is set; what the server answered them, counted by kind."""

    def __init__(self, url: str):
        self.url = url
        self.host, self.port = url.removeprefix("http://").split(":")
        self.stop = threading.Event()
        self.seen: dict[str, Counter] = {}
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def count(self, kind: str, what) -> None:
        with self._lock:
            self.seen.setdefault(kind, Counter())[what] += 1

    def start(self, kinds: tuple[str, ...], total: int = 20) -> None:
        for i in range(total):  # the bodies first: then the attackers start together
            kind = kinds[i % len(kinds)]
            args = (address(i), i) if kind == "uploads" else (kind, address(i), hostile_body(kind, i))
            self.threads.append(threading.Thread(target=self.uploads if kind == "uploads" else self.repeat,
                                                 args=args, daemon=True))
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(TIMEOUT_S + 5)

    # ---- item 1 ---------------------------------------------------------------------------------

    def uploads(self, source: str, i: int) -> None:
        """Uploads that never end, as many as the router takes (up to HELD), opened one every 0.1 s, sized
        to fill the body budget to the byte: 4 MiB at first, then twice as much after one is taken (still
        held 0.3 s later) and half as much after one is refused, down to 8 bytes. Every other attacker
        also trickles a byte every 3 s into each."""
        slow = i % 2 == 1
        most, room = 4 * MIB - 1024, 1024  # each declares `room` bytes more than it sends: never complete
        size = most
        held: dict[socket.socket, float | None] = {}  # -> when it was opened, until it counts as taken
        next_byte = time.monotonic() + 3.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for s, opened in list(held.items()):
                    status = answered(s)
                    if status is not None:
                        self.count("uploads", status)
                        s.close()
                        del held[s]
                        size = max(8, size // 2)
                    elif opened is not None and now - opened >= 0.3:
                        held[s] = None
                        size = min(most, size * 2)
                if len(held) < HELD:
                    held[self._upload(source, size + room, size)] = now
                if slow and now >= next_byte:
                    for s in held:
                        _send(s, b"a")
                    next_byte = now + 3.0
                self.stop.wait(0.1)
        finally:
            for s in held:
                s.close()

    def _upload(self, source: str, declared: int, sent: int) -> socket.socket:
        """A connection from `source` that sent the headers of a body of `declared` bytes and `sent` of them."""
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5.0)
        try:
            s.connect((self.host, int(self.port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % declared)
            _send(s, PAYLOAD[:sent])
            self.count("uploads", "opened")
        except OSError:
            self.count("uploads", "refused at connect")
        return s

    # ---- items 3 and 4 --------------------------------------------------------------------------

    def repeat(self, kind: str, source: str, body: bytes) -> None:
        """The same hostile request, one after another."""
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=TIMEOUT_S) as c:
            while not self.stop.is_set():
                try:
                    r = c.post(self.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
                    self.count(kind, r.status_code)
                except httpx.HTTPError as e:
                    self.count(kind, type(e).__name__)


@functools.cache  # attacker i sends the same body in every round, as it does within one
def hostile_body(kind: str, i: int) -> bytes:
    """bad_words: 64 words of 60,000 characters (3.9 MB); allowed_token_ids: 600,000 ids with n=16. Both
    under --max-body-mb: the attack is on what the body holds, not its size."""
    if kind == "bad_words":
        text = " ".join(f"w{i}x{k}" for k in range(12_000))  # distinct words: no tokenizer cache helps
        body = {"prompt": "Hello", "max_tokens": 4, "bad_words": [f"{j} {text}"[:60_000] for j in range(64)]}
    else:
        body = {"prompt": "Hello", "max_tokens": 16, "n": 16,
                "allowed_token_ids": (list(range(VOCAB)) * (600_000 // VOCAB + 1))[:600_000]}
    raw = json.dumps(body).encode()
    assert 3 * MIB < len(raw) < 4 * MIB, (kind, len(raw))
    return raw


def _send(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass  # cut by the server: answered() sees it


def answered(s: socket.socket) -> int | str | None:
    """The status the server answered an upload with, "closed" if it closed without one, None if held."""
    s.setblocking(False)
    try:
        head = s.recv(64, socket.MSG_PEEK)
    except BlockingIOError:
        return None
    except OSError:
        return "closed"
    finally:
        s.setblocking(True)
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else "closed"


def router_side_open(port: int) -> int:
    """Connections from the attackers' addresses to the router's `port` whose router side is still open
    (established, or closed by the attacker only), from /proc/net/tcp."""
    attackers = {address(i) for i in range(20)}
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        ip = socket.inet_ntoa(struct.pack("<I", int(remote.split(":")[0], 16)))
        n += int(local.split(":")[1], 16) == port and ip in attackers and state in ("01", "03", "08")
    return n


def latencies(client: httpx.Client, url: str, runs: int) -> list[tuple[int, float]]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        try:
            status = client.post(url + "/v1/completions", json=GOOD).status_code
        except httpx.TimeoutException:
            status = "timeout"
        out.append((status, time.perf_counter() - start))
        if status != 200:
            break
    return out


@pytest.mark.parametrize("kinds", [("uploads",), ("uploads", "bad_words", "allowed_token_ids")],
                         ids=["item1", "items1-3-4"])
def test_twenty_hostile_clients_beside_a_well_behaved_one(srv, kinds):
    """Undisturbed and under attack in turns (ROUNDS of: 2 requests alone, then the attack, then 3 requests
    beside it), so that a machine's drift shows on both sides; its latency alone is the median of all."""
    undisturbed, disturbed, seen = [], [], {}
    port = int(srv.url.rsplit(":", 1)[1])
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.1"), timeout=TIMEOUT_S) as good:
        latencies(good, srv.url, 2)  # warm-up
        for _ in range(ROUNDS):
            undisturbed += latencies(good, srv.url, 2)
            attack = Attackers(srv.url)
            attack.start(kinds)
            try:
                time.sleep(FILL_S)  # the uploads are in: without fair budgets, the body budget is full
                disturbed += latencies(good, srv.url, 3)
            finally:
                attack.join()
            for kind, counts in attack.seen.items():
                seen[kind] = seen.get(kind, Counter()) + counts
            end = time.monotonic() + SETTLE_S
            while router_side_open(port) and time.monotonic() < end:  # the attackers' connections closed
                time.sleep(0.02)
            if any(s != 200 for s, _ in disturbed):
                break
    alone = statistics.median(t for _, t in undisturbed)
    shown = (f"undisturbed {[round(t * 1000) for _, t in undisturbed]} ms (median {alone * 1000:.0f}); under "
             f"attack: {[(s, round(t * 1000)) for s, t in disturbed]}; the attackers saw {seen}")
    print(shown)  # -s shows it
    assert len(disturbed) == 3 * ROUNDS and all(s == 200 for s, _ in disturbed), shown
    # the typical request beside the attack within 2x its time alone, and none past 3x: before the fair budgets
    # and the paced parsing a request took 6x; the worst of 9 within 2x failed now and then on a 2-core machine
    # with nothing else running (242 ms against a median of 102 alone, the other 8 at 84-185 ms)
    assert statistics.median(t for _, t in disturbed) <= 2 * alone, shown
    assert max(t for _, t in disturbed) <= 3 * alone, shown
    # the attack was real: the uploads were opened and held, the router refused or cut the rest
    assert seen["uploads"]["opened"] >= 100 and sum(seen["uploads"][c] for c in (408, 429, 503)) >= 20, shown
    for kind in kinds[1:]:
        assert sum(seen.get(kind, {}).values()) >= 6, shown  # each of its attackers had one answered at least
