"""`pdserve-bench offload`'s arms: one engine, the tiers sized for the longest length, and one round.

    Bench(args, lengths, out)      the engine (unchunked, no prefix cache) and a HostTier per host arm
                                   (pinned, pageable; disk: a HostTier over a DiskTier)
    Bench.round(n, r, rng)         a seeded prompt's reference run and prefill, then every arm once in a
                                   shuffled order: {arm: its offload and reload figures, exact or not}
    Bench.reload_and_check(...)    reserve, poison, reload (timed), adopt, decode, compare bitwise
    parse_fault(text)              `--break skip-block:K | corrupt:K` (tests only: the check must then fail)
"""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine.decode import sync
from pdserve.bench.transfer.check import poison, prompt_ids, run_seed, scrub, step_logits
from pdserve.workers.engine.block_pool import blocks_for, paired_runs, runs

ARMS = ("recompute", "plain-pinned", "gpu", "pinned", "pageable", "disk")
FAULTS = ("skip-block:K", "corrupt:K")


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
            self.tiers["disk"] = HostTier(L, cap, self.device, pinned=True, below=self.disk, evict_ahead=0.0)
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
        logits = step_logits(self.engine, req)
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
        logits = step_logits(self.engine, req)
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
