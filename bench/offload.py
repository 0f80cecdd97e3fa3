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
written from outside: Engine.reserve / adopt, as in bench/transfer_roles.py).

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
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.engine.steps import machine_slug, parse_counts
from pdserve.bench.engine.decode import sync
from pdserve.bench.transfer_check import poison, prompt_ids, run_seed, scrub
from pdserve.workers.engine.block_pool import blocks_for, paired_runs, runs

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ARMS = ("recompute", "plain-pinned", "gpu", "pinned", "pageable", "disk")
DEFAULT_LENGTHS = {"smollm2-135m": "1k,4k", "tiny": "64,256"}
FAULTS = ("skip-block:K", "corrupt:K")
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


def parse_fault(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    kind, _, arg = text.partition(":")
    if kind in ("skip-block", "corrupt"):
        try:
            return kind, int(arg)
        except ValueError:
            pass
    raise ValueError(f"unknown fault {text!r}; choose one of {', '.join(FAULTS)} (K: a block index)")


def log(msg: str) -> None:
    print(f"[offload-bench] {msg}", file=sys.stderr, flush=True)


def timed(fn, device: torch.device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3, out


class Bench:
    """The engine, the tiers (sized for the longest length) and one round's arms."""

    def __init__(self, args, lengths: list[int], out: Path):
        from pdserve.settings.worker import EngineConfig
        from pdserve.workers.engine.engine import Engine
        from pdserve.workers.engine.kv_tiers.disk import DiskTier
        from pdserve.workers.engine.kv_tiers.host import HostTier

        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        max_len = max(lengths)
        bs = args.block_size
        # source + (recompute or reloaded request) at once, each with room to decode
        blocks = 2 * (blocks_for(max_len, bs) + blocks_for(args.tokens + 1, bs)) + 8
        self.engine = Engine(EngineConfig(model=args.model, device=str(self.device), dtype=args.dtype, block_size=bs,
                                          num_blocks=blocks, max_num_seqs=4, max_batched_tokens=max(8192, max_len),
                                          chunked_prefill=False, prefix_cache=False,
                                          max_model_len=max_len + args.tokens + 1))
        # unchunked: the reference's prefill is one step, as prefill_only's: the same KV, bit for bit;
        # no prefix cache: recompute must compute, and a reservation must get blocks without this KV
        self.layout = L = self.engine.layout
        self.entry_bytes = L.num_layers * L.block_bytes
        self.row = L.block_bytes // L.itemsize
        nb = blocks_for(max_len, bs)
        cap = nb * self.entry_bytes
        self.arms = [a for a in args.arms.split(",") if a]
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
        self.tiers = {}
        if "pinned" in self.arms:
            self.tiers["pinned"] = HostTier(L, cap, self.device, pinned=True)
        if "pageable" in self.arms:
            self.tiers["pageable"] = HostTier(L, cap, self.device, pinned=False)
        self.disk_dir = None
        if "disk" in self.arms:
            self.disk_dir = Path(args.disk_dir) if args.disk_dir else Path(tempfile.mkdtemp(
                prefix="offload-disk-", dir=out.parent))
            self.disk = DiskTier(self.disk_dir, 2 * cap + (64 << 20), L, model_id=self.engine.model_name)
            self.tiers["disk"] = HostTier(L, cap, self.device, pinned=True, disk=self.disk, evict_ahead=0.0)
        self.gpu_buf = torch.empty((nb, L.num_layers, self.row), dtype=L.torch_dtype, device=self.device) \
            if "gpu" in self.arms else None
        if "plain-pinned" in self.arms:
            self.plain_host = torch.empty(cap, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self.plain_dev = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self.fault = parse_fault(args.fault)
        self.page_cache: str | None = None

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
        if self.disk_dir is not None and not self.args.disk_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)

    # ---- one round ----------------------------------------------------------------------

    def reference(self, prompt: list[int]) -> dict:
        """The colocated run: greedy tokens and every step's logits, never offloaded."""
        from pdserve.workers.engine.request import Request, SamplingParams

        req = Request(f"ref-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=self.args.tokens, ignore_eos=True),
                      return_logits=True)
        self.engine.add_request(req)
        logits = []
        while not req.finished:
            logits += [o.logits for o in self.engine.step() if o.request_id == req.request_id]
        if req.finish_reason == "error":
            raise RuntimeError(f"the reference run failed: {req.error}")
        return {"tokens": list(req.output_ids), "logits": logits}

    def round(self, n: int, r: int, rng: random.Random) -> dict:
        from pdserve.workers.engine.request import Request, SamplingParams

        seed = run_seed(self.args.seed, n, r)
        prompt = prompt_ids(self.engine.vocab_size, n, seed)
        ref = self.reference(prompt)
        src = Request(f"src-{n}-{r}", prompt, SamplingParams(max_tokens=self.args.tokens, ignore_eos=True))
        result = self.engine.prefill_only(src)
        first = {"token": result.first_token, "logits": result.logits.detach().float().cpu()}
        first_ok = first["token"] == ref["tokens"][0] and torch.equal(first["logits"], ref["logits"][0])
        blocks = list(result.block_ids)
        hashes = [hashlib.blake2b(f"{seed}/{n}/{r}/{i}".encode(), digest_size=16).digest() for i in range(len(blocks))]
        ctx = {"n": n, "r": r, "seed": seed, "prompt": prompt, "ref": ref, "first": first, "blocks": blocks,
               "hashes": hashes}
        order = ["recompute", *[a for a in ARMS if a in self.arms and a != "recompute"]]
        rng.shuffle(order)
        out = {"order": order, "source_first_exact": first_ok}
        try:
            for arm in order:
                out[arm] = getattr(self, "arm_" + arm.replace("-", "_"))(ctx)
        finally:
            self.engine.release(src.request_id)
            scrub(self.engine.kv.pool)
        return out

    def arm_recompute(self, ctx) -> dict:
        from pdserve.workers.engine.request import Request, SamplingParams

        req = Request(f"recompute-{ctx['n']}-{ctx['r']}", ctx["prompt"], SamplingParams(max_tokens=1, ignore_eos=True))
        ms, result = timed(lambda: self.engine.prefill_only(req), self.device)
        self.engine.release(req.request_id)
        return {"ms": ms, "first_token_equal": result.first_token == ctx["first"]["token"]}

    def arm_plain_pinned(self, ctx) -> dict:
        nbytes = len(ctx["blocks"]) * self.entry_bytes
        host, dev = self.plain_host[:nbytes], self.plain_dev[:nbytes]
        off, _ = timed(lambda: host.copy_(dev, non_blocking=True), self.device)
        back, _ = timed(lambda: dev.copy_(host, non_blocking=True), self.device)
        return {"offload_ms": off, "reload_ms": back, "bytes": nbytes}

    def _reload_items(self, ctx, dst: list[int]) -> list[tuple[bytes, int]]:
        items = list(zip(ctx["hashes"], dst))
        if self.fault and self.fault[0] == "skip-block":
            del items[self.fault[1] % len(items)]
        return items

    def arm_gpu(self, ctx) -> dict:
        """The ceiling: the blocks copied to another GPU buffer and back (one strided copy per run of
        consecutive blocks, as the tiers move them to and from their staging buffers)."""
        L, blocks = self.layout, ctx["blocks"]
        view = self.engine.kv.pool.view(L.num_layers, -1, self.row).transpose(0, 1)  # [blocks, layers, row]
        buf = self.gpu_buf[:len(blocks)]

        def offload():
            off = 0
            for start, n in runs(blocks):
                buf[off:off + n].copy_(view[start:start + n])
                off += n

        ms, _ = timed(offload, self.device)
        if self.fault and self.fault[0] == "corrupt":
            buf[self.fault[1] % len(blocks), 0, :16] += 1.0

        def reload(dst: list[int]):
            items = self._reload_items(ctx, dst)
            pairs = paired_runs([dst.index(b) for _, b in items], [b for _, b in items])

            def go():
                for s, d, n in pairs:
                    view[d:d + n].copy_(buf[s:s + n])
            return go

        return {"offload_ms": ms, **self.reload_and_check(ctx, reload)}

    def arm_pinned(self, ctx) -> dict:
        return self.host_arm(ctx, self.tiers["pinned"])

    def arm_pageable(self, ctx) -> dict:
        return self.host_arm(ctx, self.tiers["pageable"])

    def _corrupt_host(self, tier, ctx) -> None:
        if self.fault and self.fault[0] == "corrupt":
            h = ctx["hashes"][self.fault[1] % len(ctx["hashes"])]
            tier.flush()
            tier.host[tier._entries[h].slot, 0, :16] += 1.0

    def host_arm(self, ctx, tier) -> dict:
        pool, items = self.engine.kv.pool, list(zip(ctx["hashes"], ctx["blocks"]))
        off, stored = timed(lambda: tier.store(pool, items), self.device)
        if stored != len(items):
            raise RuntimeError(f"the host tier took {stored} of {len(items)} blocks")
        self._corrupt_host(tier, ctx)
        try:
            return {"offload_ms": off, **self.reload_and_check(ctx, lambda dst: self._tier_load(tier, ctx, dst))}
        finally:
            tier.discard(ctx["hashes"])

    def _tier_load(self, tier, ctx, dst):
        items = self._reload_items(ctx, dst)
        state = {}

        def go():
            handle = tier.load(self.engine.kv.pool, items)
            handle.wait()
            state["handle"] = handle

        go.state = state
        return go

    def arm_disk(self, ctx) -> dict:
        tier, pool = self.tiers["disk"], self.engine.kv.pool
        items = list(zip(ctx["hashes"], ctx["blocks"]))

        def offload():
            tier.store(pool, items)
            tier.spill(ctx["hashes"])
            tier.flush()

        off, _ = timed(offload, self.device)
        if self.fault and self.fault[0] == "corrupt":
            self._corrupt_file(ctx["hashes"][self.fault[1] % len(items)])
        try:
            if self.args.drop_cache != "none":
                self.page_cache = self.disk.drop_page_cache(self.args.drop_cache)
            cold = self.reload_and_check(ctx, lambda dst: self._tier_load(tier, ctx, dst))
            tier.spill(ctx["hashes"])  # already on disk: only the host copies go
            warm = self.reload_and_check(ctx, lambda dst: self._tier_load(tier, ctx, dst))
        finally:
            tier.discard(ctx["hashes"])
        return {"offload_ms": off, **cold, "warm": warm}

    def _corrupt_file(self, h: bytes) -> None:
        name, index = self.disk._where[h]
        f = self.disk._files[name]
        with open(self.disk.dir / name, "r+b") as fh:
            fh.seek(f.payload_offset + index * self.entry_bytes + 1)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x40]))

    # ---- the check -----------------------------------------------------------------------

    def reload_and_check(self, ctx, make_reload) -> dict:
        """Reserve blocks, poison them, reload into them (timed), adopt, decode, compare."""
        from pdserve.workers.engine.request import Request, SamplingParams

        rid = f"reload-{ctx['n']}-{ctx['r']}-{time.monotonic_ns()}"
        dst = self.engine.reserve(rid, ctx["n"])
        if dst is None:
            raise RuntimeError(f"no room for {ctx['n']} tokens in the pool")
        poison(self.engine.kv.pool, dst, ctx["seed"])
        reload = make_reload(dst)
        ms, _ = timed(reload, self.device)
        out = {"reload_ms": ms, "bytes": len(dst) * self.entry_bytes}
        handle = getattr(reload, "state", {}).get("handle")
        if handle is not None:
            out["copy_ms"] = {k: v * 1e3 for k, v in handle.tier_seconds.items()}
            if handle.error is not None:
                out["error"] = handle.error
        req = Request(rid, ctx["prompt"], SamplingParams(max_tokens=self.args.tokens, ignore_eos=True),
                      return_logits=True)
        try:
            self.engine.adopt(req, ctx["first"]["token"])
        except Exception as e:
            return {**out, "exact": False, "mismatch": f"adopt failed: {e}"}
        logits = []
        while not req.finished:
            logits += [o.logits for o in self.engine.step() if o.request_id == rid]
        ref = ctx["ref"]
        step = next((i + 1 for i, (a, b) in enumerate(zip(logits, ref["logits"][1:]))
                     if a is None or not torch.equal(a, b)), None)
        failed = req.finish_reason == "error"
        exact = (not failed and "error" not in out and req.output_ids == ref["tokens"] and step is None
                 and len(logits) == len(ref["logits"]) - 1)
        out["exact"] = exact
        if "error" in out:
            out["mismatch"] = f"the reload failed: {out['error']}"
        elif failed:
            out["mismatch"] = f"decoding from the reloaded KV failed: {req.error}"
        elif not exact:
            out["mismatch"] = f"first differing logits at generated token {step}"
        scrub(self.engine.kv.pool)
        return out


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
    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"offload-{machine_slug(device)}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
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
