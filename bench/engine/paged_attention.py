"""`pdserve-bench attention`: one layer's decode attention over the paged pool, kernel alone.

For one layer of the model's shape (default qwen2.5-7b: 28 query heads, 4 KV heads, head dim
128, bf16, 16-token blocks) and a batch of requests whose blocks are scattered through the pool:

    floor      SDPA over contiguous per-request K/V with enable_gqa (no paging at all)
    copy       one device copy of the same K/V bytes (read + write; the bandwidth ceiling)
    gather     the reference path: gather every request's blocks, then masked SDPA
    ours       paged_kernel.paged_decode, reading the pool in place (each config of --sweep)
    flex       PyTorch FlexAttention over the same pool in place (64-token pages; it refuses 16)

Effective bandwidth = K+V bytes of the batch / time. Target for ours: >= 3 TB/s at batch 32 x
16k. Times: CUDA events, median (min-max) of --repeats after warm-up, rotating among pools
so nothing sits in L2. Then a correctness check of the kernels against the float32 reference
on fresh random inputs with NaN past every request's length: decode and prefill over a prefix,
mixed lengths; and, with --engine, greedy tokens of the whole model through the kernels and
through the reference path, --engine-steps steps at each --engine-contexts.

GPU:  pdserve-bench attention --device cuda --sweep --engine
      pdserve-bench attention --device cuda --sweep --graph 28 --batch 1 --context 16384 \
          --shapes 1x1024,1x4096,1x32768,8x16384 --no-flex        # the split count at small batch, launch-free
CPU (the reference only; the kernels need CUDA or TRITON_INTERPRET=1):  tests cover it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench import ab, provenance

TARGET_TBPS = 3.0
MAX_GRAPHS = 16  # --graph: graphs of rotating inputs at most (16 x 28 calls of batch 1 x 1k keys read 0.9 GiB: past L2)
DEFAULT_CONFIG = dict(waves=8, block_n=128, num_warps=4, num_stages=2, heads_first=True)  # paged_decode's defaults


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=16384, help="keys per request (default 16k)")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10, help="timed runs per arm per round (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--shapes", default=None, help="more batch x context points, e.g. 8x16384,64x4096")
    p.add_argument("--sweep", action="store_true", help="time several kernel configs, not only the default")
    p.add_argument("--graph", type=int, default=0, metavar="N",
                   help="time each arm as a CUDA graph of N calls (rotating pools), replayed: a call's time is the "
                        "replay's / N, with no host launch in it, as in the engine's decode graphs (one call a "
                        "layer: 28 for qwen2.5-7b). Without it each call is timed alone, launch included: at batch 1 "
                        "that is mostly the launch (b1 x 1k read 0.136 ms a call on the H200, 2 MiB of K+V)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--no-timing", action="store_true", help="only the correctness checks (kernels, and --engine)")
    p.add_argument("--engine", action="store_true", help="also compare greedy tokens of qwen2.5-7b, kernels vs reference")
    p.add_argument("--engine-contexts", default="1024,16384")
    p.add_argument("--engine-steps", type=int, default=64)
    p.add_argument("--out", default=None)


def timed(fn, repeats: int, warmup: int = 3) -> dict:
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    ms = []
    for i in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def graphed(fn, calls: int, inputs: int):
    """CUDA graphs of `calls` calls each, graph g capturing fn(g * calls), ..., fn(g * calls + calls - 1), as many
    graphs as it takes to touch all `inputs` rotating inputs once (at most MAX_GRAPHS) -> a function of i that
    replays graph i: consecutive replays read other inputs, so none finds the last one's in L2 (a decode step's
    layers read their own KV, with the weights streaming through between them). Each call runs once first
    (compiles and allocations outside the capture); the graphs share one memory pool, replayed one at a time."""
    count = max(1, min(MAX_GRAPHS, -(-inputs // calls)))
    for i in range(min(calls * count, inputs)):
        fn(i)
    torch.cuda.synchronize()
    pool, graphs = torch.cuda.graph_pool_handle(), []
    for g in range(count):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1], pool=pool):  # on a side stream of its own, as the engine's graphs are
            for j in range(calls):
                fn(g * calls + j)
    return lambda i: graphs[i % count].replay()


def timed_interleaved(arms: dict, rounds: int, repeats: int, per: int = 1) -> dict:
    """Each arm timed `repeats` times per round, arms in a shuffled order every round; an arm's
    figure is the median over rounds of its per-round medians (min-max across rounds beside it),
    so every arm sees the same clocks and drift favours none. per: the calls one run of an arm makes
    (a graph of them, graphed()): its figures are per call."""
    got = ab.interleave({k: (lambda i, fn=fn: timed(fn, repeats, warmup=1)["median_ms"] / per)
                         for k, fn in arms.items()}, rounds=rounds, seed=0, warmup=1)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "rounds": len(v)}
            for k, v in got.results.items()}


def scattered_pools(n_pools: int, batch: int, ctx: int, kvh: int, d: int, bs: int, dev, dtype):
    """Pools holding `batch` requests of `ctx` keys each in blocks at random places."""
    nb = batch * (-(-ctx // bs))
    pools, tables = [], []
    for i in range(n_pools):
        pools.append(torch.randn(nb + 1, 2, bs, kvh, d, device=dev, dtype=dtype))
        tables.append(torch.randperm(nb, device=dev).view(batch, -1))
    return pools, tables


def kernel_timings(args, dev) -> dict:
    from pdserve.workers.engine import attention, paged_kernel as pk

    B, CTX, H, KVH, D, BS = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    dtype = torch.bfloat16
    kv_bytes = 2 * B * CTX * KVH * D * 2
    n_pools = max(2, math.ceil(3 * 2**30 / kv_bytes))  # several GiB in rotation: far past L2
    pools, tables = scattered_pools(n_pools, B, CTX, KVH, D, BS, dev, dtype)
    q = torch.randn(B, H, D, device=dev, dtype=dtype)
    lens = torch.full((B,), CTX, device=dev)
    scale = D ** -0.5
    out: dict = {"batch": B, "context": CTX, "kv_bytes": kv_bytes, "pools_in_rotation": n_pools}

    def gbps(t):
        return round(kv_bytes / (t["median_ms"] * 1e-3) / 1e9, 1)

    contig = [torch.randn(2, B, KVH, CTX, D, device=dev, dtype=dtype) for _ in range(n_pools)]
    dst = torch.empty_like(contig[0])
    q4 = q.unsqueeze(2)
    arms = {
        "floor_sdpa_contiguous": lambda i: F.scaled_dot_product_attention(
            q4, contig[i % n_pools][0], contig[i % n_pools][1], enable_gqa=True),
        "copy_same_bytes_read_write": lambda i: dst.copy_(contig[i % n_pools]),
        "gather_then_sdpa": lambda i: attention.reference_decode(q, pools[i % n_pools], tables[i % n_pools], lens, scale),
    }
    configs = [DEFAULT_CONFIG]
    if args.sweep:
        configs += [dict(waves=w, block_n=bn, num_warps=4, num_stages=ns, heads_first=hf)
                    for w in (0.5, 1, 2, 4, 8) for bn in (32, 64, 128) for ns in (2, 3) for hf in (False, True)
                    if dict(waves=w, block_n=bn, num_warps=4, num_stages=ns, heads_first=hf) != DEFAULT_CONFIG]
    for cfg in configs:
        name = "ours " + ",".join(f"{k}={v}" for k, v in cfg.items())
        try:  # compile first: a config the compiler refuses (e.g. shared memory) is reported, not fatal
            pk.paged_decode(q, pools[0], tables[0], lens, scale, CTX, **cfg)
        except Exception as e:
            out.setdefault("refused", {})[name] = repr(e)[:200]
            continue
        arms[name] = lambda i, cfg=cfg: pk.paged_decode(q, pools[i % n_pools], tables[i % n_pools], lens, scale, CTX, **cfg)
        out.setdefault("splits", {})[name] = pk.decode_split(B, KVH, CTX, dev, cfg["waves"], cfg["block_n"])
    out["timed_as"] = f"a CUDA graph of {args.graph} calls, replayed" if args.graph else "each call alone"
    if args.graph:
        for name in list(arms):
            try:
                arms[name] = graphed(arms[name], args.graph, n_pools)
            except Exception as e:  # an arm that cannot be captured is reported, not timed another way
                out.setdefault("not_graphed", {})[name] = repr(e)[:200]
                del arms[name]
    rows = timed_interleaved(arms, args.rounds, args.repeats, max(1, args.graph))
    if "copy_same_bytes_read_write" in rows:
        rows["copy_same_bytes_read_write"]["note"] = "reads and writes the K+V bytes: its GB/s counts both"
    del contig, dst
    for name, (split_len, num_splits) in out.get("splits", {}).items():
        if name in rows:
            rows[name].update(split_len=split_len, num_splits=num_splits)
    ours = {k: v for k, v in rows.items() if k.startswith("ours")}
    best_name = min(ours, key=lambda k: ours[k]["median_ms"])
    best = dict(ours[best_name], name=best_name)
    out["ours_default"] = dict(ours["ours " + ",".join(f"{k}={v}" for k, v in DEFAULT_CONFIG.items())])
    out["ours_best"] = best
    if not args.no_flex:
        rows.update(flex_timing(q, B, CTX, KVH, D, dev, dtype, args.repeats))
    for name, t in rows.items():
        if "median_ms" in t:
            t["GBps"] = gbps(t) * (2 if name.startswith("copy") else 1)
    out["rows"] = rows
    out["ours_best_TBps"] = round(gbps(best) / 1000, 3)
    out["ours_default_TBps"] = round(gbps(out["ours_default"]) / 1000, 3)
    out["target_TBps"] = TARGET_TBPS
    out["target_met"] = out["ours_default_TBps"] >= TARGET_TBPS  # the config the engine runs
    return out


def flex_timing(q, B, CTX, KVH, D, dev, dtype, repeats) -> dict:
    """FlexAttention over a paged pool in place: the pool's pages as one physical sequence, a block
    mask that gives request b exactly its pages (64 tokens each: its smallest KV block)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError as e:
        return {"flex_page64": {"error": repr(e)}}
    page = 64
    npages = B * CTX // page
    pool = torch.randn(npages, 2, page, KVH, D, device=dev, dtype=dtype)
    table = torch.randperm(npages, device=dev).view(B, -1).to(torch.int32)
    k = pool[:, 0].reshape(1, npages * page, KVH, D).transpose(1, 2).expand(B, -1, -1, -1)
    v = pool[:, 1].reshape(1, npages * page, KVH, D).transpose(1, 2).expand(B, -1, -1, -1)
    num = torch.full((B, 1, 1), CTX // page, dtype=torch.int32, device=dev)
    idx = torch.zeros(B, 1, 1, npages, dtype=torch.int32, device=dev)
    idx[:, 0, 0, : CTX // page] = table
    mask = BlockMask.from_kv_blocks(torch.zeros_like(num), idx, full_kv_num_blocks=num, full_kv_indices=idx,
                                    BLOCK_SIZE=(128, page), seq_lengths=(1, npages * page))
    fa = torch.compile(flex_attention, dynamic=False)
    q4 = q.unsqueeze(2)
    try:
        t = timed(lambda i: fa(q4, k, v, block_mask=mask, enable_gqa=True), repeats)
    except Exception as e:
        return {"flex_page64": {"error": repr(e)[:300]}}
    t["note"] = "one pool of 64-token pages (not rotated)"
    return {"flex_page64": t}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def kernel_check(args, dev, seed: int = 0) -> dict:
    """Kernels vs the float32 reference on random bf16 inputs, NaN past every length."""
    from pdserve.workers.engine import attention, paged_kernel as pk

    g = torch.Generator(device="cpu").manual_seed(seed)
    H, KVH, D, BS = args.heads, args.kv_heads, args.head_dim, args.block_size
    lens = [1, 15, 16, 17, 300, 1024, 4099, 16384] + torch.randint(1, 16384, (24,), generator=g).tolist()
    nbs = [-(-n // BS) for n in lens]
    total = sum(nbs) + 8
    pool = torch.randn(total, 2, BS, KVH, D, generator=g).to(dev, torch.bfloat16)
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(len(lens), max(nbs), dtype=torch.long)
    for s, (n, nb) in enumerate(zip(lens, nbs)):
        table[s, :nb] = torch.tensor(order[:nb])
        order = order[nb:]
        pool[table[s, nb - 1], :, (n - 1) % BS + 1:] = float("nan")
    table = table.to(dev)
    q = torch.randn(len(lens), H, D, generator=g).to(dev, torch.bfloat16)
    ctx = torch.tensor(lens, device=dev)
    scale = D ** -0.5
    want = attention.reference_decode(q.float(), pool.float(), table, ctx, scale)
    got = pk.paged_decode(q, pool, table, ctx, scale, max(lens))
    res = {"decode_rel_err": rel_err(got, want), "decode_finite": bool(torch.isfinite(got).all())}
    # prefill over a prefix: the last 300 (or fewer) positions of each request as one chunk
    chunks, row = [], 0
    for s, n in enumerate(lens):
        m = min(300, n)
        chunks.append((s, row, m, n - m))
        row += m
    qp = torch.randn(row, H, D, generator=g).to(dev, torch.bfloat16)
    tiles = torch.tensor(pk.prefill_tiles(chunks, H // KVH), dtype=torch.int32, device=dev)
    outp = torch.full_like(qp, float("nan"))
    pk.paged_prefill(qp, pool, table, tiles, scale, outp)
    wantp = torch.cat([attention.reference_prefix(qp[r:r + m].float(), pool.float(), table[s], pos, scale)
                       for s, r, m, pos in chunks])
    res["prefix_rel_err"] = rel_err(outp, wantp)
    res["prefix_finite"] = bool(torch.isfinite(outp).all())
    res["ok"] = res["decode_finite"] and res["prefix_finite"] and res["decode_rel_err"] < 1e-2 and res["prefix_rel_err"] < 1e-2
    return res


def engine_check(args) -> list[dict]:
    """qwen2.5-7b (random weights, bf16) through the kernels and through the reference path, one
    model (fused and compiled as the engine runs it on CUDA), the same prompt, chunked prefill then
    --engine-steps decode steps:
      free      each path greedy on its own: are the tokens equal, where do they part;
      forced    the kernel path fed the reference's tokens (teacher forcing), so every step's
                logits compare like for like: the largest difference, and each step where the
                argmax differs with the reference's top-2 margin there.
    Random weights give flat logits (near ties are common), so a parting of the free runs alone
    proves little; the forced run says whether each disagreement is a tie within the measured
    rounding (`ok`: every disagreement has a margin below the largest logit difference, and that
    difference is under 0.5)."""
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.engine.models import load_model
    from pdserve.workers.engine.request import Request, SamplingParams

    loaded = load_model("qwen2.5-7b", torch.bfloat16, args.device)
    engines = {backend: Engine(EngineConfig(model="qwen2.5-7b", device=args.device, kv_memory_gb=8,
                                            attention=backend, max_num_seqs=8, prefix_cache=False), loaded=loaded)
               for backend in ("auto", "reference")}

    def generate(eng, rid, prompt, forced=None):
        req = Request(rid, prompt, SamplingParams(max_tokens=args.engine_steps, ignore_eos=True), return_logits=True)
        logits = []
        eng.add_request(req)
        while not req.finished:
            for o in eng.step():
                logits.append(o.logits)
                if forced is not None:  # the next step feeds the reference's token, not ours
                    req.output_ids[-1] = forced[len(logits) - 1]
        return list(req.output_ids) if forced is None else None, torch.stack(logits)

    out = []
    for ctx in [int(c) for c in args.engine_contexts.split(",")]:
        prompt = torch.randint(0, 150000, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
        res = {"context": ctx, "steps": args.engine_steps}
        ref_tokens, ref_logits = generate(engines["reference"], f"ref-{ctx}", prompt)
        ours_tokens, _ = generate(engines["auto"], f"ours-{ctx}", prompt)
        _, forced_logits = generate(engines["auto"], f"forced-{ctx}", prompt, forced=ref_tokens)
        part = next((i for i, (x, y) in enumerate(zip(ours_tokens, ref_tokens)) if x != y), None)
        res["free_tokens_equal"], res["free_first_divergence"] = ours_tokens == ref_tokens, part
        diff = (forced_logits - ref_logits).abs()
        res["forced_max_abs_logit_diff"] = diff.max().item()
        res["forced_mean_abs_logit_diff"] = diff.mean().item()
        top2 = ref_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        disagree = (forced_logits.argmax(-1) != ref_logits.argmax(-1)).nonzero().flatten().tolist()
        res["forced_argmax_disagreements"] = [{"step": i, "reference_margin": margins[i]} for i in disagree]
        res["reference_min_top2_margin"] = min(margins)
        res["ok"] = res["forced_max_abs_logit_diff"] < 0.5 and all(
            margins[i] < res["forced_max_abs_logit_diff"] for i in disagree)
        out.append(res)
        print(json.dumps(res), flush=True)
    return out


def run(args) -> int:
    dev = torch.device(args.device)
    if dev.type != "cuda":
        raise SystemExit("pdserve-bench attention times CUDA kernels; run it on a GPU (tests check the kernels on CPU)")
    record = provenance.collect([args.device])
    record["what"] = "decode attention, one layer, kernel alone"
    record["check"] = kernel_check(args, dev)
    print(json.dumps(record["check"]), flush=True)
    record["timing"] = None if args.no_timing else kernel_timings(args, dev)
    record["more_shapes"] = []
    for shape in (args.shapes.split(",") if args.shapes else []):
        b, c = (int(x) for x in shape.split("x"))
        more = kernel_timings(argparse.Namespace(**{**vars(args), "batch": b, "context": c, "no_flex": True}), dev)
        record["more_shapes"].append(more)
    if args.engine:
        record["engine_check"] = engine_check(args)
    provenance.finish(record)
    gpu = ((record.get("gpus") or [{}])[0].get("name") or "gpu").lower().replace(" ", "-")
    path = Path(args.out) if args.out else provenance.RESULTS_DIR / f"attention-{gpu}-{time.strftime('%Y-%m-%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    for t in [record["timing"]] + record["more_shapes"]:
        if t is not None:
            table_of(t)
    print(f"check ok: {record['check']['ok']}; engine check ok: "
          f"{[r['ok'] for r in record.get('engine_check', [])]}; JSON: {path}")
    return 0


def table_of(t: dict) -> None:
    print(f"\n| batch {t['batch']} x {t['context']} keys, {t['kv_bytes'] / 2**30:.2f} GiB K+V, {t['timed_as']} "
          f"| median ms a call | GB/s |")
    print("|---|---:|---:|")
    for name, row in t["rows"].items():
        if "median_ms" in row:
            splits = f" ({row['num_splits']} splits of {row['split_len']})" if "num_splits" in row else ""
            print(f"| {name}{splits} | {row['median_ms']:.4f} | {row['GBps']:.0f} |")
        else:
            print(f"| {name} | error | {row['error'][:60]} |")
    print(f"ours (default) {t['ours_default_TBps']} TB/s, best {t['ours_best_TBps']} ({t['ours_best']['name']}); "
          f"target >= {TARGET_TBPS}: {'met' if t['target_met'] else 'MISSED'}")
