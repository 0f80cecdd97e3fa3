"""`pdserve-bench ceilings`: what this host can move before any transport code runs, to judge the zmq rows against.

The zmq transport's path on the GPU (workers/transfer/zmq.py) is: a device-to-host copy of each frame into a
pinned slot (sender), ZeroMQ over TCP, CURVE-encrypted or not, on --kv-streams connections, and a host-to-device
copy of each received frame (receiver writer threads). The transfer table measures the whole; this measures each
stage alone and the stages chained, with no model and no KV pool, so a zmq figure can be read as "the transport
reaches N% of what this host moves that way" instead of against a target alone:

    copies   host<->device copies of FRAME-sized buffers from 1..T threads, each thread its own stream:
             pageable host-to-device (what a received ZeroMQ frame is), pinned host-to-device, pinned
             device-to-host, and a host memcpy (NumPy, releases the GIL) into pinned memory
    zmq      loopback ZeroMQ of FRAME-sized messages over S DEALER->ROUTER connections (IO_THREADS = S on both
             sides, as the transport sets them), plain and CURVE, the receiver one Python thread like the
             transport's I/O thread; `write` names what the receiver does with each frame: nothing, a pageable
             host-to-device copy on a writer thread (today's receiver), or a memcpy into a pinned buffer then an
             asynchronous host-to-device copy (staged); on the CPU, a memcpy on a writer thread (a CPU pool)

    pdserve-bench ceilings --device cuda:0 --streams 8 --mib 1792        # one H200 host: ~30 s
    pdserve-bench ceilings --device cpu --streams 2 --mib 256            # this project's CPU box: zmq rows only

Each figure is the median of --repeats runs of --mib MiB (1792 MiB: qwen2.5-7b's KV at 32k tokens). The JSON
carries the provenance of every bench (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pdserve.bench import provenance

FRAME = 8 << 20  # workers/transfer/frames.py's FRAME_BYTES: the unit every stage moves


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda:0", help="cuda:N (every stage) or cpu (the zmq rows, no copies)")
    p.add_argument("--streams", type=int, default=8, help="ZeroMQ connections and the most copy threads (the "
                   "transport's --kv-streams default is 8)")
    p.add_argument("--mib", type=int, default=1792, help="MiB moved per run (1792: qwen2.5-7b's KV at 32k tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--frame-mib", type=int, default=FRAME >> 20, help="the unit moved (8: the transport's frames)")
    p.add_argument("--stages", default="copies,zmq", help="copies, zmq, or both")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ceilings-<machine>-<date>.json); "
                   "a .md beside it")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median_gbps(run, nbytes: int, repeats: int) -> dict:
    """run() moves nbytes and returns its seconds; the median and range of `repeats` runs after one warm-up."""
    run()
    rates = [_gbps(nbytes, run()) for _ in range(repeats)]
    return {"GBps": statistics.median(rates), "min": min(rates), "max": max(rates)}


# ---- copies --------------------------------------------------------------------------------------


def copy_rows(device: str, threads: list[int], total: int, frame: int, repeats: int) -> list[dict]:
    """Every copy kind from 1..T threads; each thread moves total / T bytes in frames on its own stream."""
    import torch

    dev = torch.device(device)
    rows = []
    for t in threads:
        frames_each = max(1, total // frame // t)
        moved = frames_each * frame * t
        bufs = [{"pageable": torch.empty(frame, dtype=torch.uint8),
                 "pinned": torch.empty(frame, dtype=torch.uint8, pin_memory=True),
                 "dev": torch.empty(frame, dtype=torch.uint8, device=dev),
                 "stream": torch.cuda.Stream(dev)} for _ in range(t)]
        for b in bufs:
            b["pageable"].fill_(1)  # touched: no page faults inside the timing

        def kind(name: str):
            def one(b: dict) -> None:
                with torch.cuda.stream(b["stream"]):
                    for _ in range(frames_each):
                        if name == "h2d pageable":
                            b["dev"].copy_(b["pageable"])  # returns once the driver has read the pageable bytes
                            b["stream"].synchronize()
                        elif name == "h2d pinned":
                            b["dev"].copy_(b["pinned"], non_blocking=True)
                        elif name == "d2h pinned":
                            b["pinned"].copy_(b["dev"], non_blocking=True)
                        elif name == "memcpy to pinned":
                            np.copyto(b["pinned"].numpy(), b["pageable"].numpy())
                        elif name == "memcpy to pinned + h2d":  # the staged receiver: copy, then async upload
                            b["stream"].synchronize()  # the pinned buffer's last upload has read it
                            np.copyto(b["pinned"].numpy(), b["pageable"].numpy())
                            b["dev"].copy_(b["pinned"], non_blocking=True)
                    b["stream"].synchronize()

            def run() -> float:
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(t) as pool:
                    list(pool.map(one, bufs))
                return time.perf_counter() - t0
            return run

        for name in ("h2d pageable", "h2d pinned", "d2h pinned", "memcpy to pinned", "memcpy to pinned + h2d"):
            rows.append({"stage": "copy", "kind": name, "threads": t, "bytes": moved,
                         **_median_gbps(kind(name), moved, repeats)})
            print(f"copy {name:24s} threads {t:2d}: {rows[-1]['GBps']:6.2f} GB/s", flush=True)
    return rows


# ---- zmq -------------------------------------------------------------------------------------------


class _Loopback:
    """S DEALERs -> one ROUTER on 127.0.0.1, plain or CURVE; the receiver's Python thread counts (and writes)."""

    def __init__(self, streams: int, curve: bool):
        import zmq

        self.zmq = zmq
        self.ctx_rx, self.ctx_tx = zmq.Context(), zmq.Context()
        for ctx in (self.ctx_rx, self.ctx_tx):
            ctx.set(zmq.IO_THREADS, streams)  # before the first socket, as the transport does
        self.rx = self.ctx_rx.socket(zmq.ROUTER)
        self.rx.setsockopt(zmq.RCVHWM, 0)
        self.rx.setsockopt(zmq.LINGER, 0)
        keys = None
        if curve:
            server_pub, server_sec = zmq.curve_keypair()
            self.rx.curve_secretkey, self.rx.curve_server = server_sec, True
            keys = server_pub
        port = self.rx.bind_to_random_port("tcp://127.0.0.1")
        self.tx = []
        for i in range(streams):
            s = self.ctx_tx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.IDENTITY, b"s%03d" % i)
            if keys is not None:
                pub, sec = zmq.curve_keypair()
                s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys, pub, sec
            s.connect(f"tcp://127.0.0.1:{port}")
            self.tx.append(s)
        for s in self.tx:  # every connection up (and its CURVE handshake done) before any timing
            s.send_multipart([b"hi", b""])
        for _ in self.tx:
            self.rx.recv_multipart()

    def close(self) -> None:
        for s in self.tx + [self.rx]:
            s.close(0)
        self.ctx_rx.term()
        self.ctx_tx.term()


def zmq_rows(device: str, streams: int, total: int, frame: int, repeats: int) -> list[dict]:
    writes = ["none"]
    if device.startswith("cuda"):
        writes += ["h2d pageable", "memcpy to pinned + h2d"]
    else:  # a CPU pool: the receiver's write is a memcpy into it
        writes += ["memcpy"]
    rows = []
    payload = np.ones(frame, dtype=np.uint8)
    n_frames = max(streams, total // frame)
    for curve in (False, True):
        link = _Loopback(streams, curve)
        try:
            for write in writes:
                writer = _Writer(device, streams, frame, write)

                def run() -> float:
                    t0 = time.perf_counter()
                    sender = threading.Thread(target=_send, args=(link, payload, n_frames))
                    sender.start()
                    for _ in range(n_frames):
                        parts = link.rx.recv_multipart(copy=False)
                        writer.submit(parts[2])
                    writer.drain()
                    sender.join()
                    return time.perf_counter() - t0

                try:
                    rows.append({"stage": "zmq", "curve": curve, "write": write, "streams": streams,
                                 "bytes": n_frames * frame, **_median_gbps(run, n_frames * frame, repeats)})
                finally:
                    writer.close()
                print(f"zmq {'curve' if curve else 'plain':5s} write {write:24s}: {rows[-1]['GBps']:6.2f} GB/s",
                      flush=True)
        finally:
            link.close()
    return rows


def _send(link: _Loopback, payload: np.ndarray, n_frames: int) -> None:
    """The sender: frames dealt round robin over the streams, zero-copy (one buffer, refcounted)."""
    for i in range(n_frames):
        link.tx[i % len(link.tx)].send_multipart([b"h", payload], copy=False)


class _Writer:
    """What the receiver does with each frame: nothing, or a writer thread's host-to-device copy."""

    def __init__(self, device: str, threads: int, frame: int, how: str):
        self.how = how
        self.futures: list = []
        self.pool = ThreadPoolExecutor(threads) if how != "none" else None
        self.local = threading.local()
        self.device, self.frame = device, frame

    def _bufs(self):
        import torch

        if getattr(self.local, "dev", None) is None:
            dev = torch.device(self.device)
            self.local.dev = torch.empty(self.frame, dtype=torch.uint8, device=dev)
            self.local.pinned = torch.empty(self.frame, dtype=torch.uint8, pin_memory=True)
            self.local.stream = torch.cuda.Stream(dev)
        return self.local

    def _write(self, msg) -> None:
        import torch

        if self.how == "memcpy":  # a CPU pool's write: one copy into a buffer of this thread
            if getattr(self.local, "host", None) is None:
                self.local.host = np.ones(self.frame, dtype=np.uint8)
            np.copyto(self.local.host[:len(msg.buffer)], np.frombuffer(msg.buffer, dtype=np.uint8))
            return
        b = self._bufs()
        src = torch.frombuffer(msg.buffer, dtype=torch.uint8)
        with torch.cuda.stream(b.stream):
            if self.how == "h2d pageable":
                b.dev.copy_(src)
            else:
                b.stream.synchronize()  # the pinned buffer's last upload has read it
                np.copyto(b.pinned.numpy(), src.numpy())
                b.dev.copy_(b.pinned, non_blocking=True)
        b.stream.synchronize()

    def submit(self, msg) -> None:
        if self.pool is not None:
            self.futures.append(self.pool.submit(self._write, msg))

    def drain(self) -> None:
        for f in self.futures:
            f.result()
        self.futures = []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


# ---- report ----------------------------------------------------------------------------------------


def markdown(record: dict) -> str:
    lines = [f"# Host ceilings for the zmq transport ({record.get('machine', '')}, {record.get('commit', '')})", "",
             f"`{record.get('command', '')}`", "",
             f"{record['mib']} MiB a run in {record['frame_mib']} MiB frames, median of {record['repeats']} runs "
             "(range in brackets).", ""]
    copies = [r for r in record["rows"] if r["stage"] == "copy"]
    if copies:
        lines += ["| copy | threads | GB/s |", "|---|---:|---:|"]
        lines += [f"| {r['kind']} | {r['threads']} | {r['GBps']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |"
                  for r in copies]
        lines.append("")
    zrows = [r for r in record["rows"] if r["stage"] == "zmq"]
    if zrows:
        lines += ["| ZeroMQ loopback | streams | receiver writes | GB/s |", "|---|---:|---|---:|"]
        lines += [f"| {'CURVE' if r['curve'] else 'plain'} | {r['streams']} | {r['write']} | "
                  f"{r['GBps']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |" for r in zrows]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    stages = {s.strip() for s in args.stages.split(",") if s.strip()}
    if not stages or stages - {"copies", "zmq"}:
        raise SystemExit(f"--stages takes copies and/or zmq, got {args.stages!r}")
    if args.streams < 1 or args.mib < 1 or args.frame_mib < 1 or args.repeats < 1:
        raise SystemExit("--streams, --mib, --frame-mib and --repeats are positive")
    cuda = args.device.startswith("cuda")
    if "copies" in stages and not cuda:
        print("copies: no GPU named (--device cpu): only the zmq rows", flush=True)
        stages.discard("copies")
    record = provenance.collect([args.device] if cuda else [])
    record.update(what="host ceilings for the zmq transport", mib=args.mib, frame_mib=args.frame_mib,
                  repeats=args.repeats, streams=args.streams, device=args.device, rows=[])
    total, frame = args.mib << 20, args.frame_mib << 20
    if "copies" in stages:
        threads = sorted({1, max(1, args.streams // 2), args.streams})
        record["rows"] += copy_rows(args.device, threads, total, frame, args.repeats)
    if "zmq" in stages:
        record["rows"] += zmq_rows(args.device, args.streams, total, frame, args.repeats)
    provenance.finish(record)
    if args.out:
        path = Path(args.out)
    else:
        import torch

        slug = provenance.machine_slug(torch.device(args.device))
        path = provenance.RESULTS_DIR / f"ceilings-{slug}-{time.strftime('%Y-%m-%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    print(f"JSON: {path}")
    return 0
