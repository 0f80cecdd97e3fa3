"""`pdserve-bench transfer`: the seed's KV transfer table, regenerated from a paged cache.

Two processes on one machine (bench/transfer_roles.py), each loading the model once: a prefill
process on --device and a decode process on --decode-device (the same GPU by default). Per
context length:

    prefill ms        plain prefill_only, median / min / max of --prefill-runs
    per transport (ipc, nixl, zmq) and mode (bulk, layer), --repeats runs of: decode reserves
                      blocks -> prefill (+ layer-wise pushes) -> finish -> decode adopts, --tokens
                      greedy tokens, compared with a colocated run on the decode engine (token ids
                      and logits, bitwise)
        transfer ms   first copy issued -> last copy complete (zmq: the receiver's ack)
        layer extra   median prefill ms of that mode - plain prefill median
        exposed ms    last copy complete - prefill end: what time-to-first-token pays
        first step    the decode step after adoption (and the colocated one beside it)
    seed-copy         the seed's own method as the baseline: a contiguous (DynamicCache-like) cache,
                      one copy_ per layer for K and V into a contiguous buffer of the decode process
                      (bulk: after prefill; layer: from the per-layer hook, on a side stream)
    bandwidth         a 1 GiB device-to-device copy on the prefill device (and prefill -> decode
                      device when they differ), measured in the same run; and the longest request's
                      blocks copied inside the prefill pool as one strided copy_ and as one copy_ per
                      layer (ipc's pattern)

Writes JSON and markdown to bench/results/transfer-<machine>-<date>.{json,md} and prints the markdown.

GPU (the lead runs it):  pdserve-bench transfer                    (qwen2.5-7b, cuda, 1k 4k 16k 32k)
                         pdserve-bench transfer --decode-device cuda:1
CPU smoke test:          pdserve-bench transfer --model tiny --device cpu --lengths 64,256 --repeats 2 \\
                             --transports ipc,zmq,nixl
"""

from __future__ import annotations

import argparse
import datetime
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.engine_bench import machine_info, machine_slug, parse_counts, summary
from workers.transfer.base import MODES, TRANSPORTS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPLY = "@bench "  # bench/transfer_roles.py prefixes its replies with it
SEED_METHOD = "seed-copy"
# targets (see the issue): ipc bulk at the longest length vs the d2d copy, layer-wise cost, nixl vs ipc
IPC_BW_FRACTION = 0.5
LAYER_EXTRA_FRACTION = 0.005
NIXL_VS_IPC = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    parser.add_argument("--device", default="cuda:0", help="prefill device: cuda:N or cpu (default cuda:0)")
    parser.add_argument("--decode-device", default=None, help="decode device (default: the prefill device)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    parser.add_argument("--lengths", default="1k,4k,16k,32k", help="prompt lengths in tokens; 1k = 1024")
    parser.add_argument("--prefill-runs", type=int, default=9, help="plain prefills per length (default 9)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per transport and mode per length (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before those (default 1)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma separated (default all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated (default bulk,layer)")
    parser.add_argument("--no-seed-method", action="store_true", help="skip the seed's contiguous-copy baseline")
    parser.add_argument("--tokens", type=int, default=20, help="greedy tokens decoded and compared (default 20)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="size of the copy-bandwidth buffer (default 1024 on CUDA, 64 on CPU)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="per transfer (default 60)")
    parser.add_argument("--out", default=None, help="output path without suffix (default bench/results/...)")


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
    argv = [sys.executable, "-m", "bench.transfer_roles", role, "--model", args.model, "--device", args.device,
            "--decode-device", args.decode_device, "--block-size", str(args.block_size), "--max-len", str(max_len),
            "--tokens", str(args.tokens), "--transports", args.transports, "--deadline-s", str(args.deadline_s)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    return Child(role, argv)


def log(msg: str) -> None:
    print(f"[transfer-bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    lengths = parse_counts(args.lengths)
    transports = [t for t in args.transports.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    bad = [t for t in transports if t not in TRANSPORTS] + [m for m in modes if m not in MODES]
    if bad or args.repeats < 1 or args.prefill_runs < 1 or args.warmup < 0:
        raise ValueError(f"unknown transports/modes {bad}, or --repeats/--prefill-runs below 1, or --warmup below 0")
    args.decode_device = args.decode_device or args.device
    device = torch.device(args.device)
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
        rows = [measure_length(n, args, prefill, decode, addresses, transports, modes) for n in lengths]
    finally:
        prefill.close()
        decode.close()

    result = {
        "benchmark": "transfer",
        "machine": {**machine_info(device), "decode_device": args.decode_device},
        "config": {"model": model["model"], "dtype": model["dtype"], "layout": model["layout"],
                   "kv_bytes_per_token": model["bytes_per_token"], "num_layers": model["num_layers"],
                   "lengths": lengths, "prefill_runs": args.prefill_runs, "repeats": args.repeats,
                   "tokens_compared": args.tokens, "transports": transports, "modes": modes,
                   "device": args.device, "decode_device": args.decode_device},
        "bandwidth": bandwidth,
        "lengths": rows,
    }
    result["targets"] = targets(result)
    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"transfer-{machine_slug(device)}-{datetime.date.today().isoformat()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text + "\n")
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    print(text)
    return 0


def measure_length(n: int, args, prefill: Child, decode: Child, addresses: dict, transports: list[str],
                   modes: list[str]) -> dict:
    log(f"{n} tokens: plain prefill x {args.prefill_runs}")
    for _ in range(args.warmup):
        prefill.ask("prefill", n=n)
    plain = summary([prefill.ask("prefill", n=n)["prefill_ms"] for _ in range(args.prefill_runs)])
    row = {"tokens": n, "kv_bytes": None, "prefill_ms": plain, "results": []}
    methods = [(t, m) for t in transports for m in modes]
    if not args.no_seed_method:
        info = decode.ask("seed_buffer", n=n)["info"]
        prefill.ask("seed_prepare", n=n, info=info)
        methods += [(SEED_METHOD, m) for m in modes]
    for transport, mode in methods:
        log(f"{n} tokens: {transport} {mode} x {args.repeats} (+{args.warmup} warm-up)")
        runs = [one_run(f"{transport}-{mode}-{n}-{i}", n, transport, mode, prefill, decode, addresses)
                for i in range(args.warmup + args.repeats)][args.warmup:]
        row["results"].append(aggregate(transport, mode, runs, plain))
        row["kv_bytes"] = row["kv_bytes"] or next((r["kv_bytes"] for r in runs if "kv_bytes" in r), None)
    return row


def one_run(rid: str, n: int, transport: str, mode: str, prefill: Child, decode: Child, addresses: dict) -> dict:
    if transport == SEED_METHOD:
        sent = prefill.ask("seed", id=rid, n=n, mode=mode)
        got = decode.ask("seed_decode", id=rid, n=n, first_token=sent["first_token"], logits_sha=sent["logits_sha"])
        return {**sent, **got}
    reserved = decode.ask("reserve", id=rid, n=n, transport=transport)
    if "error" in reserved:
        return reserved
    sent = prefill.ask("transfer", id=rid, n=n, transport=transport, mode=mode, peer=reserved["address"],
                       dst=reserved["blocks"])
    got = decode.ask("decode", id=rid, n=n, transport=transport, first_token=sent.get("first_token", -1),
                     logits_sha=sent.get("logits_sha", ""))
    return {**sent, **got, "error": sent.get("error") or got.get("error")}


def aggregate(transport: str, mode: str, runs: list[dict], plain: dict) -> dict:
    ok = [r for r in runs if not r.get("error")]
    errors = sorted({r["error"] for r in runs if r.get("error")})
    out = {"transport": transport, "mode": mode, "runs": len(runs), "failed": len(runs) - len(ok),
           "errors": errors, "exact": bool(ok) and len(ok) == len(runs) and all(r["exact"] for r in ok),
           "mismatch": next((r["mismatch"] for r in ok if r.get("mismatch")), None)}
    if not ok:
        return out
    med = {k: statistics.median(r[k] for r in ok) for k in ("transfer_ms", "prefill_ms", "exposed_ms",
                                                            "first_step_ms", "colocated_first_step_ms")}
    out.update({
        "transfer_ms": summary([r["transfer_ms"] for r in ok]),
        "prefill_ms": summary([r["prefill_ms"] for r in ok]),
        "layer_extra_ms": med["prefill_ms"] - plain["median"],
        "exposed_ms": summary([r["exposed_ms"] for r in ok]),
        # ipc on CUDA: last copy complete minus prefill end on the GPU's own clock (events)
        "exposed_gpu_ms": (summary([r["exposed_gpu_ms"] for r in ok])
                           if all(r.get("exposed_gpu_ms") is not None for r in ok) else None),
        "first_step_ms": med["first_step_ms"],
        "colocated_first_step_ms": med["colocated_first_step_ms"],
        "copies": ok[0]["copies"],
        "kv_bytes": ok[0]["kv_bytes"],
        "gbps": ok[0]["kv_bytes"] / (med["transfer_ms"] / 1e3) / 1e9 if med["transfer_ms"] > 0 else None,
    })
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
    out["ipc_bulk_at_least_half_d2d"] = None if ipc_bulk is None else ipc_bulk["gbps"] >= IPC_BW_FRACTION * d2d
    if ipc_layer and ipc_bulk:
        one_layer_ms = ipc_bulk["transfer_ms"]["median"] / layers
        out["ipc_layer_extra_fraction"] = ipc_layer["layer_extra_ms"] / row["prefill_ms"]["median"]
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
        out["nixl_within_2x_ipc"] = out["nixl_over_ipc"] <= NIXL_VS_IPC
    return out


def _ms(s: dict | None, digits: int = 2) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f}"


def markdown(result: dict) -> str:
    m, c, bw = result["machine"], result["config"], result["bandwidth"]
    lines = [
        f"KV transfer bench: {c['model']} {c['dtype']} ({c['layout']}), prefill on {c['device']}, decode on "
        f"{c['decode_device']} ({m['device']}), torch {m['torch']}, transformers {m['transformers']}, {m['date']}",
        f"copy bandwidth ({bw['bytes'] // 2**20} MiB): {bw['d2d_gbps']:.1f} GB/s on the prefill device"
        + (f", {bw['to_decode_gbps']:.1f} GB/s prefill -> decode device" if "to_decode_gbps" in bw else "")
        + f"; the longest request's blocks inside one pool ({bw['paged_run']['bytes'] / 2**20:.1f} MiB): "
          f"{bw['paged_run']['strided_gbps']:.1f} GB/s as one strided copy_, "
          f"{bw['paged_run']['per_layer_gbps']:.1f} GB/s as one copy_ per layer",
        f"prefill: median (min-max) of {c['prefill_runs']}; transfers: median of {c['repeats']}; exact = "
        f"{c['tokens_compared']} greedy tokens and their logits bitwise equal to a colocated run",
        "",
    ]
    for row in result["lengths"]:
        p = row["prefill_ms"]
        kv_mib = (row["kv_bytes"] or 0) / 2**20
        lines += [f"### {row['tokens']} tokens, KV {kv_mib:.1f} MiB, prefill {p['median']:.2f} ms "
                  f"({p['min']:.2f}-{p['max']:.2f})", "",
                  "| transport | mode | transfer ms | % of prefill | GB/s | copies | layer-wise extra ms | exposed ms "
                  "(host) | exposed ms (GPU) | first decode step ms (colocated) | exact |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in row["results"]:
            if "transfer_ms" not in r:
                lines.append(f"| {r['transport']} | {r['mode']} | failed: {'; '.join(r['errors'])[:200]} "
                             "| | | | | | | | NO |")
                continue
            t = r["transfer_ms"]["median"]
            lines.append(
                f"| {r['transport']} | {r['mode']} | {t:.3f} | {100 * t / p['median']:.2f}% | "
                f"{r['gbps'] or 0:.1f} | {r['copies']} | {r['layer_extra_ms']:+.2f} | {_ms(r['exposed_ms'])} | "
                f"{_ms(r.get('exposed_gpu_ms'), 3)} | "
                f"{r['first_step_ms']:.2f} ({r['colocated_first_step_ms']:.2f}) | "
                f"{'yes' if r['exact'] else 'NO'}{' (' + str(r['failed']) + ' failed)' if r['failed'] else ''} |")
        lines.append("")
    t = result["targets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines.append(f"targets at {t['tokens']} tokens:")
    lines.append(f"- all transfers exact: {verdict[t['all_exact']]}")
    if t["ipc_bulk_fraction_of_d2d"] is not None:
        lines.append(f"- ipc bulk >= 50% of the d2d copy bandwidth: {verdict[t['ipc_bulk_at_least_half_d2d']]} "
                     f"({100 * t['ipc_bulk_fraction_of_d2d']:.0f}%)")
    if "ipc_layer_extra_fraction" in t:
        lines.append(f"- ipc layer mode adds <= 0.5% to prefill: {verdict[t['ipc_layer_extra_within_0.5pct']]} "
                     f"({100 * t['ipc_layer_extra_fraction']:+.2f}%)")
        lines.append(f"- ipc layer mode exposes at most one layer's transfer: "
                     f"{verdict[t['ipc_layer_exposed_at_most_one_layer']]} ({t['ipc_layer_exposed_ms']:.3f} ms "
                     f"exposed by {t['ipc_layer_exposed_clock']}, {t['ipc_layer_exposed_host_ms']:.3f} ms as the host "
                     f"saw it; one layer {t['one_layer_transfer_ms']:.3f} ms)")
    if "nixl_over_ipc" in t:
        lines.append(f"- nixl bulk within 2x of ipc bulk: {verdict[t['nixl_within_2x_ipc']]} "
                     f"({t['nixl_over_ipc']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m bench.transfer ...`, the same as `pdserve-bench transfer ...`
    _parser = argparse.ArgumentParser(prog="pdserve-bench transfer", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
