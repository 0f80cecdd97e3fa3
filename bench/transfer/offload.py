"""`pdserve-bench offload`: the second seed's table regenerated from our serving path. Is moving a
cache back cheaper than rebuilding it?

One process, one engine. Per context length, --warmup untimed rounds then --repeats rounds, each
with its own seeded prompt: first its colocated run (the never-offloaded reference: --tokens greedy
tokens and every step's logits), then its prefill (prefill_only: the source blocks), then these
arms in an order shuffled per round (seeded):

    recompute     prefill_only of the same prompt again, synchronised: the cost of rebuilding
    plain-pinned  one plain copy_ of the same bytes between a pinned host buffer and the GPU, each
                  way: the reference the pinned tier is held to (issue target: within 1.5x)
    gpu           gather the blocks into another GPU buffer and scatter them back: the ceiling
    pinned        HostTier (pinned): store() then load()
    pageable      HostTier(pinned=False): the same path from ordinary host memory
    disk          HostTier + DiskTier: store(), spill() and the background write (flush) is the
                  offload; the page cache is dropped (--drop-cache), then load() reads, verifies
                  and copies (cold); spill again and load once more without dropping (warm)

Every reload is checked: the destination blocks are reserved and poisoned with NaN first, filled by
the reload, adopted with the prefill's first token, then --tokens greedy tokens decoded with their
logits, all compared bitwise with the reference (the path of a request continued from blocks
written from outside: Engine.reserve / adopt, as in bench/transfer/roles.py); the arms and the check
are in bench/transfer/offload_arms.py.

Reported per length: each arm's offload and reload ms (median, min-max), reload GB/s, speed-up
over recompute (median of the per-round ratios), exact; prefill us/token; the break-even link
speed (KV bytes per token / prefill seconds per token); pinned reload against the plain copy
(median of per-round ratios). Clocks: host perf_counter with a device synchronise around each
timed call; the tiers' own copy time (CUDA events, disk read wall time) beside it.

`--break skip-block:K` leaves block K out of every reload; `--break corrupt:K` changes block K's
stored copy after the offload (the disk tier must refuse it by checksum). Either way the exact
column must read NO (tests/test_offload_bench.py).

GPU (the lead runs it; about 4 minutes on an H200):
    pdserve-bench offload --model qwen2.5-7b --device cuda:0
CPU smoke test: pdserve-bench offload --model tiny --device cpu --lengths 64 --repeats 1 --warmup 0
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.transfer.offload_arms import ARMS, FAULTS, Bench, parse_fault
from pdserve.workers.engine.block_pool import blocks_for

DEFAULT_LENGTHS = {"smollm2-135m": "1k,4k", "tiny": "64,256"}
# the seed's H100 figures (Qwen2.5-7B, 32k tokens, reload ms; recompute = its prefill), for the table
SEED_H100_MS = {("qwen2.5-7b", 32768): {"recompute": 1201, "pinned": 68, "pageable": 238, "disk": 403}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    a("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    a("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    a("--lengths", default=None, help="context lengths; 1k = 1024 (default 1k,4k,16k,32k; smollm2-135m 1k,4k)")
    a("--repeats", type=int, default=5, help="timed rounds per length (default 5)")
    a("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    a("--tokens", type=int, default=20, help="greedy tokens decoded from each reloaded cache (default 20)")
    a("--seed", type=int, default=0, help="seeds prompts and arm orders (default 0)")
    a("--block-size", type=int, default=16)
    a("--arms", default=",".join(ARMS), help=f"arms to run (default all: {','.join(ARMS)}); recompute always runs")
    a("--disk-dir", default=None, help="the disk tier's directory (default: a temporary one beside --out, removed after)")
    a("--drop-cache", default="fadvise", choices=("fadvise", "drop_caches", "none"),
      help="before each cold disk read: posix_fadvise(DONTNEED) on the tier's files (default), "
           "/proc/sys/vm/drop_caches (root, the whole machine), or none")
    a("--break", dest="fault", default=None, help=f"tests only: {', '.join(FAULTS)} (the check must then fail)")
    a("--out", default=None, help="output path without suffix (default bench/results/offload-<machine>-<date>)")


def log(msg: str) -> None:
    print(f"[offload-bench] {msg}", file=sys.stderr, flush=True)


def summarize(n: int, rounds: list[dict], bench: Bench) -> dict:
    L = bench.layout
    nb = blocks_for(n, L.block_size)
    recompute = [r["recompute"]["ms"] for r in rounds]
    row = {"tokens": n, "blocks": nb, "kv_bytes": nb * bench.entry_bytes, "kv_bytes_per_token": L.bytes_per_token,
           "recompute_ms": ab.summary(recompute),
           "source_first_exact": all(r["source_first_exact"] for r in rounds),
           "recompute_first_token_equal": all(r["recompute"]["first_token_equal"] for r in rounds),
           "orders": [r["order"] for r in rounds], "arms": {}}
    s_per_token = ab.spread(recompute)["median"] / 1e3 / n
    row["prefill_us_per_token"] = s_per_token * 1e6
    row["break_even_gbps"] = L.bytes_per_token / s_per_token / 1e9
    for arm in ARMS[1:]:
        if arm not in rounds[0]:
            continue
        per_round = [r[arm] for r in rounds]
        for name, pick in ((arm, lambda x: x), (arm + "-warm", lambda x: x["warm"])):
            if name.endswith("-warm") and "warm" not in per_round[0]:
                continue
            got = [pick(x) for x in per_round]
            reload = [g["reload_ms"] for g in got]
            a = {"reload_ms": ab.summary(reload),
                 "offload_ms": ab.summary([x["offload_ms"] for x in per_round]),
                 "reload_gbps": got[0]["bytes"] / ab.spread(reload)["median"] * 1e3 / 1e9,
                 "speedup": ab.paired(reload, recompute)["ratio"]}
            if arm != "plain-pinned":
                a["exact"] = all(g["exact"] for g in got)
                a["exact_runs"] = sum(g["exact"] for g in got)
                a["mismatch"] = next((g["mismatch"] for g in got if not g["exact"]), None)
                a["errors"] = [g["error"] for g in got if "error" in g]
            if "copy_ms" in got[0]:
                a["copy_ms"] = {t: ab.summary([g["copy_ms"].get(t, 0.0) for g in got]) for t in got[0]["copy_ms"]}
            row["arms"][name] = a
    if "pinned" in row["arms"] and "plain-pinned" in row["arms"]:
        pinned = [r["pinned"]["reload_ms"] for r in rounds]
        plain = [r["plain-pinned"]["reload_ms"] for r in rounds]
        row["pinned_vs_plain_copy"] = ab.paired(plain, pinned)["ratio"]  # per round: pinned / plain
    return row


def targets(result: dict) -> dict:
    rows = result["lengths"]
    tiers = [a for row in rows for name, a in row["arms"].items() if "exact" in a]
    out = {"all_exact": bool(tiers) and all(a["exact"] for a in tiers) and all(r["source_first_exact"] for r in rows)}
    last = rows[-1]
    ratio = last.get("pinned_vs_plain_copy")
    if ratio is not None:
        out["pinned_reload_vs_plain_copy"] = {"tokens": last["tokens"], "ratio": ratio["median"], "limit": 1.5,
                                              "met": ratio["median"] <= 1.5}
    return out


def _ms(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# pdserve-bench offload: {c['model']} on {c['device']}", "",
             provenance.describe(result["provenance"]), ""]
    if c["fault"]:
        lines += [f"**FAULT INJECTED: {c['fault']}** (tests only: the exact column must read NO)", ""]
    lines += [f"median (min-max) of {c['repeats']} rounds after {c['warmup']} warm-up, arms interleaved in a "
              f"shuffled order per round; host clock with a device synchronise around each call. Every tier's reload "
              f"is checked: poisoned destination, then {c['tokens']} greedy tokens and their logits bitwise against a "
              f"never-offloaded run. Disk reads cold after: {c['page_cache']}.", ""]
    head = ["tokens", "KV MiB", "arm", "offload ms", "reload ms", "reload GB/s", "speed-up vs recompute", "exact",
            "seed H100 ms"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in result["lengths"]:
        mib = f"{row['kv_bytes'] / 2**20:.2f}"
        seed = SEED_H100_MS.get((c["model"], row["tokens"]), {})
        lines.append(f"| {row['tokens']} | {mib} | recompute | - | {_ms(row['recompute_ms'])} | - | 1x | - | "
                     f"{seed.get('recompute', '-')} |")
        for name, a in row["arms"].items():
            exact = "-" if "exact" not in a else ("yes" if a["exact"] else "NO")
            lines.append(f"| {row['tokens']} | {mib} | {name} | {_ms(a['offload_ms'])} | {_ms(a['reload_ms'])} | "
                         f"{a['reload_gbps']:.1f} | {a['speedup']['median']:.1f}x | {exact} | {seed.get(name, '-')} |")
    lines += ["", "| tokens | prefill us/token | break-even GB/s | pinned reload / plain pinned copy_ |",
              "|---|---|---|---|"]
    for row in result["lengths"]:
        r = row.get("pinned_vs_plain_copy")
        ratio = "-" if r is None else f"{r['median']:.2f}x"
        lines.append(f"| {row['tokens']} | {row['prefill_us_per_token']:.2f} | {row['break_even_gbps']:.2f} | {ratio} |")
    t = result["targets"]
    lines += ["", f"all reloads exact: {'yes' if t['all_exact'] else 'NO'}"]
    if "pinned_reload_vs_plain_copy" in t:
        p = t["pinned_reload_vs_plain_copy"]
        lines.append(f"pinned reload at {p['tokens']} tokens within {p['limit']}x of a plain pinned copy_: "
                     f"{'met' if p['met'] else 'MISSED'} ({p['ratio']:.2f}x)")
    mismatches = [(row["tokens"], n, a["mismatch"]) for row in result["lengths"] for n, a in row["arms"].items()
                  if a.get("mismatch")]
    for tokens, name, why in mismatches:
        lines.append(f"- {tokens} tokens, {name}: {why}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    lengths = parse_counts(args.lengths or DEFAULT_LENGTHS.get(args.model, "1k,4k,16k,32k"))
    if args.repeats < 1 or args.warmup < 0 or args.tokens < 2:
        raise ValueError("--repeats must be >= 1, --warmup >= 0 and --tokens >= 2")
    parse_fault(args.fault)
    device = torch.device(args.device)
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / (
        f"offload-{provenance.machine_slug(device)}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance.collect([str(device)])
    t0 = time.monotonic()
    with torch.inference_mode():
        log(f"loading {args.model} on {device}")
        bench = Bench(args, lengths, out)
        log(f"ready in {time.monotonic() - t0:.1f} s; KV {bench.layout.bytes_per_token} bytes/token")
        rng = random.Random(args.seed)
        rows = []
        try:
            for n in lengths:
                rounds = []
                for r in range(-args.warmup, args.repeats):
                    got = bench.round(n, r, rng)
                    if r >= 0:
                        rounds.append(got)
                rows.append(summarize(n, rounds, bench))
                log(f"{n} tokens: recompute {rows[-1]['recompute_ms']['median']:.1f} ms; " + ", ".join(
                    f"{k} {a['reload_ms']['median']:.1f} ms" for k, a in rows[-1]["arms"].items()))
        finally:
            bench.close()
    result = {"provenance": prov,
              "config": {"model": args.model, "device": str(bench.device), "dtype": bench.layout.dtype,
                         "lengths": lengths, "repeats": args.repeats, "warmup": args.warmup, "tokens": args.tokens,
                         "seed": args.seed, "block_size": args.block_size, "arms": bench.arms,
                         "layout": bench.layout.describe(), "entry_bytes": bench.entry_bytes,
                         "pinned": bench.device.type == "cuda", "fault": args.fault,
                         "page_cache": bench.page_cache or ("not dropped" if args.drop_cache == "none" else None),
                         "clock": "host perf_counter, device synchronised around each timed call; copy_ms: the "
                                  "tiers' CUDA events (disk: + read and verify wall time)",
                         "elapsed_s": time.monotonic() - t0},
              "lengths": rows}
    result["targets"] = targets(result)
    provenance.finish(prov)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0
