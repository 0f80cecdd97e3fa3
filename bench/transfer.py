"""`pdserve-bench transfer`: the seed's KV transfer table, regenerated from a paged cache.

Two processes on one machine (bench/transfer_roles.py), each loading the model once: a prefill
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
                      blocks copied inside the prefill pool as one strided copy_ and as one copy_ per
                      layer (ipc's pattern)

`--break skip-block:K|skip-all` (tests only) makes our senders drop part of every request: the
exact column must then read NO (tests/test_bench_honesty.py).

Writes JSON (with provenance: commit, versions, GPU clocks and power at start and end) and markdown
to bench/results/transfer-<machine>-<date>.{json,md} and prints the markdown.

Methods beside the transports (bench/transfer_pools.py): zmq-curve (every KV byte through CURVE, the
bench's own keys in both processes) and <transport>-fragmented (both pools scattered first).

GPU (the lead runs it):  pdserve-bench transfer                    (qwen2.5-7b, cuda, 1k 4k 16k 32k)
                         pdserve-bench transfer --decode-device cuda:1
                         pdserve-bench transfer --lengths 32k --modes bulk,layer --no-seed-method \\
                             --transports zmq,zmq-curve,ipc,nixl,ipc-fragmented,nixl-fragmented
CPU smoke test:          pdserve-bench transfer --model tiny --device cpu --lengths 64,256 --repeats 2 \\
                             --transports ipc,zmq,nixl
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.engine.steps import machine_slug, parse_counts
from pdserve.bench.transfer_check import FAULTS, parse_fault, run_seed
from pdserve.bench.transfer_pools import parse_method, worker_keys
from pdserve.settings.worker import TransferConfig
from pdserve.protocol.enums import MODES, TRANSPORTS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPLY = "@bench "  # bench/transfer_roles.py prefixes its replies with it
SEED_METHOD = "seed-copy"
# targets (see the issues): ipc bulk at the longest length vs the d2d copy, layer-wise cost, nixl vs ipc,
# zmq bulk's rate
IPC_BW_FRACTION = 0.9
LAYER_EXTRA_FRACTION = 0.005
NIXL_VS_IPC = 1.1
ZMQ_GBPS = 5.0


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
                             "(bench/transfer_pools.py; default: every transport)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated (default bulk,layer)")
    parser.add_argument("--no-seed-method", action="store_true", help="skip the seed's contiguous-copy baseline")
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens decoded and compared (default 20)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="size of the copy-bandwidth buffer (default 1024 on CUDA, 64 on CPU)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="per transfer (default 60)")
    parser.add_argument("--kv-streams", type=int, default=None, help="zmq's data streams per decode worker (default: the workers' --kv-streams default)")
    parser.add_argument("--out", default=None, help="output path without suffix (default bench/results/...)")
    parser.add_argument("--break", dest="fault", default=None,
                        help=f"tests only: our senders drop part of every request ({', '.join(FAULTS)})")


class Child:
    """A helper process driven by JSON lines: one command per stdin line, one reply per stdout line
    starting with `reply` (libraries such as NIXL log to stdout too: other lines go to stderr)."""

    def __init__(self, name: str, argv: list[str], reply: str = REPLY):
        self.name, self.reply = name, reply
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     cwd=Path(__file__).resolve().parents[1])
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
    argv = [sys.executable, "-m", "pdserve.bench.transfer_roles", role, "--model", args.model, "--device", args.device,
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
    bad = [m for m in modes if m not in MODES]
    if bad or args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"unknown modes {bad}, or --repeats below 1, or --warmup below 0")
    args.keys = worker_keys() if any(parse_method(t)[1] == "curve" for t in transports) else None
    parse_fault(args.fault)  # refuse an unknown fault before loading anything
    args.decode_device = args.decode_device or args.device
    device = torch.device(args.device)
    prov = provenance.collect([args.device, args.decode_device])
    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"transfer-{machine_slug(device)}-{datetime.date.today().isoformat()}")
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


def one_run(rid: str, n: int, seed: int, method: str, mode: str, prefill: Child, decode: Child) -> dict:
    prepared = decode.ask("prepare", id=rid, n=n, seed=seed, method=method)
    if "error" in prepared:
        return {**prepared, "seed": seed}
    if method == SEED_METHOD:
        sent = prefill.ask("seed", id=rid, n=n, seed=seed, mode=mode)
        got = decode.ask("seed_decode", id=rid, n=n, first_token=sent["first_token"], logits_sha=sent["logits_sha"])
        return {**sent, **got, "seed": seed}
    sent = prefill.ask("transfer", id=rid, n=n, seed=seed, transport=method, mode=mode, peer=prepared["address"],
                       dst=prepared["blocks"])
    got = decode.ask("decode", id=rid, n=n, transport=method, first_token=sent.get("first_token", -1),
                     logits_sha=sent.get("logits_sha", ""))
    return {**sent, **got, "seed": seed, "error": sent.get("error") or got.get("error")}


def _paired_ms(base: list[float], runs: list[dict]) -> dict | None:
    """runs' prefill against base round by round, over the rounds where the run did not fail."""
    pairs = [(b, r["prefill_ms"]) for b, r in zip(base, runs) if not r.get("error")]
    return ab.paired([b for b, _ in pairs], [r for _, r in pairs]) if pairs else None


def aggregate(transport: str, mode: str, runs: list[dict], plain: list[float], bulk: list[dict] | None) -> dict:
    ok = [r for r in runs if not r.get("error")]
    errors = sorted({r["error"] for r in runs if r.get("error")})
    out = {"transport": transport, "mode": mode, "runs": len(runs), "failed": len(runs) - len(ok),
           "errors": errors, "exact": bool(ok) and len(ok) == len(runs) and all(r["exact"] for r in ok),
           "exact_runs": sum(1 for r in ok if r["exact"]),
           "mismatch": next((r["mismatch"] for r in ok if r.get("mismatch")), None),
           "prompt_seeds": [r["seed"] for r in runs]}
    if not ok:
        return out
    med = {k: statistics.median([r[k] for r in ok if r[k] is not None] or [math.nan])
           for k in ("transfer_ms", "first_step_ms", "colocated_first_step_ms")}
    extra = _paired_ms(plain, runs)
    out.update({
        "transfer_ms": ab.summary([r["transfer_ms"] for r in ok]),
        "prefill_ms": ab.summary([r["prefill_ms"] for r in ok]),
        # this mode's prefill minus the plain prefill of the same round (bench/ab.py)
        "extra_vs_plain": extra,
        "layer_extra_ms": extra["diff"]["median"],
        "exposed_ms": ab.summary([r["exposed_ms"] for r in ok]),
        # ipc on CUDA: last copy complete minus prefill end on the GPU's own clock (events)
        "exposed_gpu_ms": (ab.summary([r["exposed_gpu_ms"] for r in ok])
                           if all(r.get("exposed_gpu_ms") is not None for r in ok) else None),
        "first_step_ms": med["first_step_ms"],
        "colocated_first_step_ms": med["colocated_first_step_ms"],
        "copies": ok[0]["copies"],
        "runs_per_request": statistics.median([r["runs"] for r in ok]) if all("runs" in r for r in ok) else None,
        "kv_bytes": ok[0]["kv_bytes"],
        "gbps": ok[0]["kv_bytes"] / (med["transfer_ms"] / 1e3) / 1e9 if med["transfer_ms"] > 0 else None,
    })
    if mode == "layer" and bulk is not None:
        pairs = [(b, r) for b, r in zip(bulk, runs) if not b.get("error") and not r.get("error")]
        out["extra_vs_bulk"] = _paired_ms([b["prefill_ms"] for b, _ in pairs], [r for _, r in pairs])
    return out


def _find(row: dict, transport: str, mode: str) -> dict | None:
    return next((r for r in row["results"] if r["transport"] == transport and r["mode"] == mode
                 and "transfer_ms" in r), None)


def targets(result: dict) -> dict:
    """The issue's targets at the longest length measured (None: not measured)."""
    row = result["lengths"][-1]
    layers = result["config"]["num_layers"]
    ipc_bulk, ipc_layer = _find(row, "ipc", "bulk"), _find(row, "ipc", "layer")
    nixl_bulk = _find(row, "nixl", "bulk")
    d2d = result["bandwidth"]["d2d_gbps"]
    out = {"tokens": row["tokens"], "all_exact": all(r["exact"] for x in result["lengths"] for r in x["results"])}
    out["ipc_bulk_fraction_of_d2d"] = ipc_bulk["gbps"] / d2d if ipc_bulk else None
    out["ipc_bulk_at_least_0.9_d2d"] = None if ipc_bulk is None else ipc_bulk["gbps"] >= IPC_BW_FRACTION * d2d
    if ipc_layer and ipc_bulk:
        one_layer_ms = ipc_bulk["transfer_ms"]["median"] / layers
        # the median of (layer prefill - plain prefill) over rounds, as a fraction of plain prefill
        diff = ipc_layer["extra_vs_plain"]["diff"]
        out["ipc_layer_extra_fraction"] = diff["median"] / row["prefill_ms"]["median"]
        out["ipc_layer_extra_spread_ms"] = [diff["min"], diff["max"]]
        out["ipc_layer_extra_within_0.5pct"] = out["ipc_layer_extra_fraction"] <= LAYER_EXTRA_FRACTION
        # the GPU's own clock where measured (CUDA events); the host's poll otherwise
        exposed = ipc_layer.get("exposed_gpu_ms") or ipc_layer["exposed_ms"]
        out["ipc_layer_exposed_clock"] = "gpu events" if ipc_layer.get("exposed_gpu_ms") else "host"
        out["ipc_layer_exposed_ms"] = exposed["median"]
        out["ipc_layer_exposed_host_ms"] = ipc_layer["exposed_ms"]["median"]
        out["one_layer_transfer_ms"] = one_layer_ms
        out["ipc_layer_exposed_at_most_one_layer"] = exposed["median"] <= one_layer_ms
    if nixl_bulk and ipc_bulk:
        out["nixl_over_ipc"] = nixl_bulk["transfer_ms"]["median"] / ipc_bulk["transfer_ms"]["median"]
        out["nixl_within_1.1x_ipc"] = out["nixl_over_ipc"] <= NIXL_VS_IPC
    ipc_frag, nixl_frag = _find(row, "ipc-fragmented", "bulk"), _find(row, "nixl-fragmented", "bulk")
    if ipc_frag:
        out["fragmented_runs"] = ipc_frag["runs_per_request"]
        out["ipc_fragmented_fraction_of_d2d"] = ipc_frag["gbps"] / d2d
    if ipc_frag and nixl_frag:
        out["nixl_fragmented_over_ipc_fragmented"] = (nixl_frag["transfer_ms"]["median"]
                                                      / ipc_frag["transfer_ms"]["median"])
    for method in ("zmq", "zmq-curve"):
        got = _find(row, method, "bulk")
        if got:
            out[f"{method}_bulk_gbps"] = got["gbps"]
            out[f"{method}_bulk_at_least_{ZMQ_GBPS:g}_gbps"] = got["gbps"] >= ZMQ_GBPS
    return out


def _ms(s: dict | None, digits: int = 2) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f}"


def markdown(result: dict) -> str:
    c, bw = result["config"], result["bandwidth"]
    lines = [
        f"KV transfer bench: {c['model']} {c['dtype']} ({c['layout']}), prefill on {c['device']}, decode on "
        f"{c['decode_device']}; {provenance.describe(result['provenance'])}"
        + (f"; FAULT INJECTED: {c['fault']}" if c.get("fault") else ""),
        f"copy bandwidth ({bw['bytes'] // 2**20} MiB): {bw['d2d_gbps']:.1f} GB/s on the prefill device"
        + (f", {bw['to_decode_gbps']:.1f} GB/s prefill -> decode device" if "to_decode_gbps" in bw else "")
        + f"; the longest request's blocks inside one pool ({bw['paged_run']['bytes'] / 2**20:.1f} MiB): "
          f"{bw['paged_run']['strided_gbps']:.1f} GB/s as one strided copy_, "
          f"{bw['paged_run']['per_layer_gbps']:.1f} GB/s as one copy_ per layer"
          + (f", {bw['paged_run']['memcpy2d_gbps']:.1f} GB/s as one 2D memcpy" if bw['paged_run'].get('memcpy2d_gbps')
             else "")
          + "; every other block of them "
          f"{bw['paged_run']['scattered_gather_gbps']:.1f} GB/s gathered and scattered by index",
        f"{c['repeats']} rounds per transport after {c['warmup']} warm-up, each running plain prefill and "
        f"{' and '.join(c['modes'])} once in a shuffled order; a new seeded prompt per run; medians; extra = that mode's prefill minus "
        f"the plain prefill of the same round, median (min..max) of the paired differences; exact = the reserved "
        f"blocks poisoned with NaN, then {c['tokens_compared']} greedy tokens and their logits bitwise equal to a "
        f"colocated run of the same prompt, in every run",
        "",
    ]
    for row in result["lengths"]:
        p = row["prefill_ms"]
        kv_mib = (row["kv_bytes"] or 0) / 2**20
        lines += [f"### {row['tokens']} tokens, KV {kv_mib:.1f} MiB, prefill {p['median']:.2f} ms "
                  f"({p['min']:.2f}-{p['max']:.2f})", "",
                  "| transport | mode | transfer ms | % of prefill | GB/s | copies (runs) | extra ms vs plain (paired) | "
                  "exposed ms (host) | exposed ms (GPU) | first decode step ms (colocated) | exact |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in row["results"]:
            if "transfer_ms" not in r:
                lines.append(f"| {r['transport']} | {r['mode']} | failed: {'; '.join(r['errors'])[:200]} "
                             "| | | | | | | | NO |")
                continue
            t = r["transfer_ms"]["median"]
            d = r["extra_vs_plain"]["diff"]
            lines.append(
                f"| {r['transport']} | {r['mode']} | {t:.3f} | {100 * t / p['median']:.2f}% | "
                f"{r['gbps'] or 0:.1f} | {r['copies']} ({r.get('runs_per_request') or '-'}) | {d['median']:+.2f} ({d['min']:+.2f}..{d['max']:+.2f}) | "
                f"{_ms(r['exposed_ms'])} | "
                f"{_ms(r.get('exposed_gpu_ms'), 3)} | "
                f"{r['first_step_ms']:.2f} ({r['colocated_first_step_ms']:.2f}) | "
                f"{'yes' if r['exact'] else 'NO'} ({r['exact_runs']}/{r['runs']})"
                f"{' (' + str(r['failed']) + ' failed)' if r['failed'] else ''} |")
        lines.append("")
        for r in row["results"]:
            vs = r.get("extra_vs_bulk")
            if vs:
                d = vs["diff"]
                lines.append(f"- {r['transport']}: layer minus bulk prefill, paired over {vs['pairs']} rounds: "
                             f"{d['median']:+.2f} ms ({d['min']:+.2f}..{d['max']:+.2f})")
        lines.append("")
    t = result["targets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines.append(f"targets at {t['tokens']} tokens:")
    lines.append(f"- all transfers exact: {verdict[t['all_exact']]}")
    if t["ipc_bulk_fraction_of_d2d"] is not None:
        lines.append(f"- ipc bulk >= 90% of the d2d copy bandwidth: {verdict[t['ipc_bulk_at_least_0.9_d2d']]} "
                     f"({100 * t['ipc_bulk_fraction_of_d2d']:.0f}%)")
    if "ipc_layer_extra_fraction" in t:
        lo, hi = t["ipc_layer_extra_spread_ms"]
        lines.append(f"- ipc layer mode adds <= 0.5% to prefill: {verdict[t['ipc_layer_extra_within_0.5pct']]} "
                     f"({100 * t['ipc_layer_extra_fraction']:+.2f}%, median of paired differences; "
                     f"{lo:+.2f}..{hi:+.2f} ms over the rounds)")
        lines.append(f"- ipc layer mode exposes at most one layer's transfer: "
                     f"{verdict[t['ipc_layer_exposed_at_most_one_layer']]} ({t['ipc_layer_exposed_ms']:.3f} ms "
                     f"exposed by {t['ipc_layer_exposed_clock']}, {t['ipc_layer_exposed_host_ms']:.3f} ms as the host "
                     f"saw it; one layer {t['one_layer_transfer_ms']:.3f} ms)")
    if "nixl_over_ipc" in t:
        lines.append(f"- nixl bulk within 1.1x of ipc bulk: {verdict[t['nixl_within_1.1x_ipc']]} "
                     f"({t['nixl_over_ipc']:.2f}x)")
    if "ipc_fragmented_fraction_of_d2d" in t:
        lines.append(f"- fragmented pools ({t['fragmented_runs']:g} runs a request): ipc bulk at "
                     f"{100 * t['ipc_fragmented_fraction_of_d2d']:.0f}% of the d2d copy bandwidth"
                     + (f", nixl {t['nixl_fragmented_over_ipc_fragmented']:.2f}x its time"
                        if "nixl_fragmented_over_ipc_fragmented" in t else ""))
    for method in ("zmq", "zmq-curve"):
        if f"{method}_bulk_gbps" in t:
            lines.append(f"- {method} bulk >= {ZMQ_GBPS:g} GB/s: "
                         f"{verdict[t[f'{method}_bulk_at_least_{ZMQ_GBPS:g}_gbps']]} ({t[f'{method}_bulk_gbps']:.2f} GB/s)")
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m pdserve.bench.transfer ...`, the same as `pdserve-bench transfer ...`
    _parser = argparse.ArgumentParser(prog="pdserve-bench transfer", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
