"""A junk flood on a router's register socket, for a bounded time (tests only; tests/test_flood.py).

    python tests/flood_peer.py tcp://127.0.0.1:7100 KEYS_DIR SECONDS

KEYS_DIR is the deployment's worker key folder: half of the flood holds the valid key (what a
compromised or buggy worker could send), half holds none or a wrong one. Each thread floods as fast
as the socket takes it (sends never block: a full pipe drops). On exit it prints one JSON line with
what each thread sent.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.protocol import auth  # noqa: E402
from pdserve.settings.keys import WorkerKeys, load_worker_keys, new_deployment
from pdserve.protocol import control as P  # noqa: E402

UNKNOWN_IDS = 5000


def main() -> None:
    endpoint, keys_dir, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    keys = load_worker_keys(keys_dir)
    end = time.monotonic() + seconds
    sent: dict[str, int] = {}
    ctx = zmq.Context()

    def push(curve: WorkerKeys | None) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            auth.connect_curve(sock, curve.worker, curve.router_public)
        sock.connect(endpoint)
        return sock

    def frames(name: str, sock: zmq.Socket, make) -> None:
        n = 0
        while time.monotonic() < end:
            try:
                sock.send(make(n), zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                time.sleep(0.0005)
        sent[name] = n
        sock.close(0)

    def raw_tcp() -> None:  # bytes that are not even ZMTP, on fresh connections
        host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
        n = 0
        while time.monotonic() < end:
            try:
                with socket.create_connection((host, port), timeout=1) as s:
                    s.sendall(os.urandom(4096))
                n += 1
            except OSError:
                time.sleep(0.001)
        sent["raw_tcp_connections"] = n

    def wrong_key_connections() -> None:  # another deployment's key: refused by the gate, again and again
        other = new_deployment()[1]
        n = 0
        while time.monotonic() < end:
            sock = push(WorkerKeys(other.worker, keys.router_public))
            try:
                sock.send(b"junk", zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.005)
            sock.close(0)
            n += 1
        sent["wrong_key_connections"] = n

    def heartbeat(n: int) -> bytes:
        hb = P.Heartbeat(f"ghost-{n % UNKNOWN_IDS}", "tcp://127.0.0.1:9", 1, 0, 0, time.time())
        return P.from_worker(f"{n:032x}", hb)

    threads = [
        threading.Thread(target=frames, args=("plain_junk", push(None), lambda n: os.urandom(64))),
        threading.Thread(target=frames, args=("keyed_junk", push(keys), lambda n: os.urandom(64))),
        threading.Thread(target=frames, args=("keyed_unknown_heartbeats", push(keys), heartbeat)),
        threading.Thread(target=raw_tcp),
        threading.Thread(target=wrong_key_connections),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx.term()
    print(json.dumps(sent), flush=True)


if __name__ == "__main__":
    main()
