"""`pdserve-bench transfer`: the seed's KV transfer table, regenerated from a paged cache.

Two processes on one machine (bench/transfer/roles.py), each loading the model once: a prefill
process on --device and a decode process on --decode-device (the same GPU by default). Per
context length and per transport (ipc, nixl, zmq; then the seed's method), --repeats rounds, each
running these arms once in an order shuffled per round (bench/ab.py):

    plain             prefill_only alone
    bulk, layer       decode reserves blocks and poisons them (NaN) -> prefill (+ layer-wise pushes)
                      -> finish -> decode adopts, --tokens greedy tokens, compared with a colocated run
                      of the same prompt on the decode engine (token ids and logits, bitwise)

Every run (warm-ups too) has its own seeded prompt. Per transport and mode:
    transfer ms       first copy issued -> last copy complete (zmq: the receiver's ack)
    extra ms          that mode's prefill minus the plain prefill of the same round: the median of
                      the paired differences with their spread (layer mode: also layer minus bulk)
    exposed ms        last copy complete - prefill end: what time-to-first-token pays
    first step        the decode step after adoption (and the colocated one beside it)
    seed-copy         the seed's own method as the baseline: a contiguous (DynamicCache-like) cache,
                      one copy_ per layer for K and V into a contiguous buffer of the decode process
                      (bulk: after prefill; layer: from the per-layer hook, on a side stream)
    bandwidth         a 1 GiB device-to-device copy on the prefill device (and prefill -> decode
                      device when they differ), measured in the same run; and the longest request's
                      blocks copied inside the prefill pool as ipc's copy patterns (bench/transfer/pools.py)

`--break skip-block:K|skip-all` (tests only) makes our senders drop part of every request: the
exact column must then read NO (tests/test_bench_honesty.py).

Writes JSON (with provenance: commit, versions, GPU clocks and power at start and end) and markdown
to bench/results/transfer-<machine>-<date>.{json,md} and prints the markdown.

Methods beside the transports (bench/transfer/pools.py): zmq-curve (every KV byte through CURVE, the
bench's own keys in both processes) and <transport>-fragmented (both pools scattered first).

`--profile-transfer DIR` (bench/transfer/profile.py): after the table, one more ipc bulk transfer at the
longest length with its finish() under torch.profiler (and one ipc-fragmented, into DIR/fragmented, where
that method ran): the copies with their sizes and gaps on the GPU, the CUDA calls, any synchronisation, the
Python functions before the first copy; summarised in the JSON and markdown, the traces in DIR.

GPU (the lead runs it):  pdserve-bench transfer                    (qwen2.5-7b, cuda, 1k 4k 16k 32k)
                         pdserve-bench transfer --decode-device cuda:1
    issue 35, every row and verdict in one call (docs/benchmarks.md: about 5-6 minutes on an H200):
                         pdserve-bench transfer --model qwen2.5-7b --device cuda:0 --lengths 4k,32k --repeats 3 \\
                             --warmup 1 --modes bulk,layer --no-seed-method --tokens 8 --profile-transfer DIR \\
                             --transports zmq,zmq-curve,ipc,nixl,ipc-fragmented,nixl-fragmented,zmq-fragmented
CPU smoke test:          pdserve-bench transfer --model tiny --device cpu --lengths 64,256 --repeats 2 \\
                             --transports ipc,zmq,nixl
"""

from __future__ import annotations

import argparse
import datetime
import json
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.transfer.check import FAULTS, parse_fault, run_seed
from pdserve.bench.transfer.pools import parse_method, worker_keys
from pdserve.bench.transfer.table_report import aggregate, markdown, targets
from pdserve.settings.worker import TransferConfig
from pdserve.protocol.enums import MODES, TRANSPORTS

REPLY = "@bench "  # bench/transfer/roles.py prefixes its replies with it
SEED_METHOD = "seed-copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    parser.add_argument("--device", default="cuda:0", help="prefill device: cuda:N or cpu (default cuda:0)")
    parser.add_argument("--decode-device", default=None, help="decode device (default: the prefill device)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    parser.add_argument("--lengths", default="1k,4k,16k,32k", help="prompt lengths in tokens; 1k = 1024")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds per transport and length, each running plain, bulk and layer once (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before those (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every run's prompt and every round's order")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help="comma separated methods: transports, zmq-curve, <transport>-fragmented "
                             "(bench/transfer/pools.py; default: every transport)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated (default bulk,layer)")
    parser.add_argument("--no-seed-method", action="store_true", help="skip the seed's contiguous-copy baseline")
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens decoded and compared (default 20)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="size of the copy-bandwidth buffer (default 1024 on CUDA, 64 on CPU)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="per transfer (default 60)")
    parser.add_argument("--kv-streams", type=int, default=None, help="zmq's data streams per decode worker (default: the workers' --kv-streams default)")
    parser.add_argument("--out", default=None, help="output path without suffix (default bench/results/...)")
    parser.add_argument("--profile-transfer", default=None, metavar="DIR",
                        help="after the table, one more ipc bulk transfer at the longest length with its finish() "
                             "under torch.profiler (and one ipc-fragmented, into DIR/fragmented, where that method "
                             "ran): the copies, their sizes, gaps, CUDA calls, any synchronisation and the Python "
                             "functions before the first copy, in the JSON and markdown; the traces in DIR (needs "
                             "ipc in --transports)")
    parser.add_argument("--break", dest="fault", default=None,
                        help=f"tests only: our senders drop part of every request ({', '.join(FAULTS)})")


class Child:
    """A helper process driven by JSON lines: one command per stdin line, one reply per stdout line
    starting with `reply` (libraries such as NIXL log to stdout too: other lines go to stderr)."""

    def __init__(self, name: str, argv: list[str], reply: str = REPLY):
        self.name, self.reply = name, reply
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     cwd=provenance.REPO)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(self.reply):
                self.lines.put(json.loads(line[len(self.reply):]))
            else:
                sys.stderr.write(line)

    def read(self, wait_s: float) -> dict:
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                return self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise RuntimeError(f"the {self.name} process exited with code {self.proc.returncode}; "
                                       "its error is above") from None
        raise RuntimeError(f"the {self.name} process gave no answer within {wait_s:.0f} s")

    def ask(self, cmd: str, wait_s: float = 900, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.read(wait_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


def role_process(role: str, args: argparse.Namespace, max_len: int) -> Child:
    argv = [sys.executable, "-m", "pdserve.bench.transfer.roles", role, "--model", args.model, "--device", args.device,
            "--decode-device", args.decode_device, "--block-size", str(args.block_size), "--max-len", str(max_len),
            "--tokens", str(args.tokens), "--transports", args.transports, "--deadline-s", str(args.deadline_s)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if role == "prefill" and args.fault:
        argv += ["--break", args.fault]
    if args.keys:
        argv += ["--keys", args.keys]
    if args.kv_streams:
        argv += ["--kv-streams", str(args.kv_streams)]
    return Child(role, argv)


def log(msg: str) -> None:
    print(f"[transfer-bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    lengths = parse_counts(args.lengths)
    transports = [t for t in args.transports.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    for t in transports:
        parse_method(t)
    if args.profile_transfer and "ipc" not in transports:
        raise ValueError("--profile-transfer profiles an ipc transfer: add ipc to --transports")
    bad = [m for m in modes if m not in MODES]
    if bad or args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"unknown modes {bad}, or --repeats below 1, or --warmup below 0")
    args.keys = worker_keys() if any(parse_method(t)[1] == "curve" for t in transports) else None
    parse_fault(args.fault)  # refuse an unknown fault before loading anything
    args.decode_device = args.decode_device or args.device
    device = torch.device(args.device)
    prov = provenance.collect([args.device, args.decode_device])
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / (
        f"transfer-{provenance.machine_slug(device)}-{datetime.date.today().isoformat()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    bw_bytes = (args.bandwidth_mib or (1024 if device.type == "cuda" else 64)) * 2**20

    log(f"starting prefill ({args.device}) and decode ({args.decode_device}) processes with {args.model}")
    t0 = time.monotonic()
    decode = role_process("decode", args, max(lengths))
    prefill = role_process("prefill", args, max(lengths))
    try:
        addresses = decode.read(1800)["addresses"]
        model = prefill.read(1800)
        log(f"loaded in {time.monotonic() - t0:.1f} s: {model['model']}, {model['layout']}")
        bandwidth = {"bytes": bw_bytes, "d2d_gbps": prefill.ask("bandwidth", nbytes=bw_bytes, to=args.device)["gbps"]}
        if args.decode_device != args.device:
            bandwidth["to_decode_gbps"] = prefill.ask("bandwidth", nbytes=bw_bytes, to=args.decode_device)["gbps"]
        longest_blocks = -(-max(lengths) // args.block_size)
        bandwidth["paged_run"] = prefill.ask("paged_copy", blocks=longest_blocks)
        log(f"copy bandwidth: {bandwidth}")
        result = {
            "benchmark": "transfer",
            "complete": False,  # until every length is in: a run cut short still leaves what it measured
            "provenance": prov,
            "config": {"model": model["model"], "dtype": model["dtype"], "layout": model["layout"],
                       "kv_bytes_per_token": model["bytes_per_token"], "num_layers": model["num_layers"],
                       "lengths": lengths, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
                       "tokens_compared": args.tokens, "transports": transports, "modes": modes,
                       "device": args.device, "decode_device": args.decode_device, "fault": args.fault,
                       "kv_streams": args.kv_streams or TransferConfig.streams},
            "bandwidth": bandwidth,
            "lengths": [],
        }
        def partial(row: dict) -> None:  # after each method: a run cut short keeps what it measured
            out.with_suffix(".json").write_text(json.dumps({**result, "lengths": [*result["lengths"], row]},
                                                           indent=1) + "\n")

        for n in lengths:
            result["lengths"].append(measure_length(n, args, prefill, decode, addresses, transports, modes,
                                                    partial))
            out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        if args.profile_transfer:
            n = max(lengths)
            for method, key, where in (("ipc", "profile", Path(args.profile_transfer)),
                                       ("ipc-fragmented", "profile_fragmented", Path(args.profile_transfer) / "fragmented")):
                if method not in transports:
                    continue
                log(f"{n} tokens: one {method} bulk transfer under torch.profiler -> {where}")
                run = one_run(f"profile-{method}-bulk-{n}", n, run_seed(args.seed, n, method, "profile", 0), method,
                              "bulk", prefill, decode, profile=str(where))
                result[key] = {"method": method, "mode": "bulk", "tokens": n, "exact": run.get("exact"),
                               "error": run.get("error"), "transfer_ms": run.get("transfer_ms"),
                               "copies": run.get("copies"), "runs": run.get("runs"), "summary": run.get("profile")}
    finally:
        prefill.close()
        decode.close()
        if args.keys:
            shutil.rmtree(Path(args.keys).parent, ignore_errors=True)

    result["complete"] = True
    provenance.finish(prov)
    result["targets"] = targets(result)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text + "\n")
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    print(text)
    return 0


def measure_length(n: int, args, prefill: Child, decode: Child, addresses: dict, transports: list[str],
                   modes: list[str], partial=None) -> dict:
    groups = list(transports)
    if not args.no_seed_method:
        info = decode.ask("seed_buffer", n=n)["info"]
        prefill.ask("seed_prepare", n=n, info=info)
        groups.append(SEED_METHOD)
    row = {"tokens": n, "kv_bytes": None, "results": []}
    plain_all: list[float] = []
    for method in groups:
        log(f"{n} tokens: {method}: plain, {', '.join(modes)} interleaved x {args.repeats} (+{args.warmup} warm-up)")

        def arm(name: str):
            def go(i: int) -> dict:
                seed = run_seed(args.seed, n, method, name, i)
                if name == "plain":
                    return prefill.ask("prefill", n=n, seed=seed)
                return one_run(f"{method}-{name}-{n}-{i}", n, seed, method, name, prefill, decode)
            return go

        got = ab.interleave({name: arm(name) for name in ["plain", *modes]}, args.repeats,
                            seed=run_seed(args.seed, n, method, "order"), warmup=args.warmup)
        plain = [r["prefill_ms"] for r in got.results["plain"]]
        plain_all += plain
        for mode in modes:
            row["results"].append(aggregate(method, mode, got.results[mode], plain, got.results.get("bulk")))
            row["results"][-1]["orders"] = got.orders
        row["kv_bytes"] = row["kv_bytes"] or next((r["kv_bytes"] for m in modes for r in got.results[m]
                                                    if "kv_bytes" in r), None)
        if partial is not None:
            partial(row)
    row["prefill_ms"] = ab.summary(plain_all)
    return row


def one_run(rid: str, n: int, seed: int, method: str, mode: str, prefill: Child, decode: Child,
            profile: str | None = None) -> dict:
    prepared = decode.ask("prepare", id=rid, n=n, seed=seed, method=method)
    if "error" in prepared:
        return {**prepared, "seed": seed}
    if method == SEED_METHOD:
        sent = prefill.ask("seed", id=rid, n=n, seed=seed, mode=mode)
        got = decode.ask("seed_decode", id=rid, n=n, first_token=sent["first_token"], logits_sha=sent["logits_sha"])
        return {**sent, **got, "seed": seed}
    sent = prefill.ask("transfer", id=rid, n=n, seed=seed, transport=method, mode=mode, peer=prepared["address"],
                       dst=prepared["blocks"], profile=profile)
    got = decode.ask("decode", id=rid, n=n, transport=method, first_token=sent.get("first_token", -1),
                     logits_sha=sent.get("logits_sha", ""))
    return {**sent, **got, "seed": seed, "error": sent.get("error") or got.get("error")}


if __name__ == "__main__":  # `python -m pdserve.bench.transfer.table ...`, the same as `pdserve-bench transfer ...`
    _parser = argparse.ArgumentParser(prog="pdserve-bench transfer", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
