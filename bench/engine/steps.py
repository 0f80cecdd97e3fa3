"""`pdserve-bench engine`: our engine's decode steps against the memory roofline, its prefill
against transformers' (paired, interleaved), and the decodes' gaps while a long prompt prefills.

In one run (qwen2.5-7b on one H200 by default; every list is a flag):

    decode     batch 1, 8, 32, 64 at contexts 1k, 4k, 16k, plus 32 requests with contexts drawn
               (seeded) from 1k-16k: engine.step() wall time, the requests put straight into decode
               (reserve + adopt over a pool of random K/V, bench/engine/decode.py); beside each point
               the roofline: the time to move the weights a step reads plus that batch's KV bytes once,
               measured with a copy kernel in the same run (at the start and again at the end)
    prefill    at each --lengths: transformers (model(ids, DynamicCache(), logits_to_keep=1) + argmax on
               the host, on a second module tree over the same weight tensors) against
               Engine.prefill_only (paged KV write + first token), --pairs rounds, order shuffled per
               round (bench/ab.py): the median of the paired ratios ours/transformers and its spread
    transformers decode   at --hf-decode-context only (not a target): one DynamicCache step against
               one engine step, interleaved the same way
    chunked    --chunk-decodes requests decoding at --chunk-context, then a --chunk-prompt-token prompt
               arrives through add_request; each step's wall time while it prefills and the decodes'
               inter-token gaps (p50, p99, max; their steady gap before the arrival), with
               EngineConfig(chunked_prefill=True) and False (after one untimed rehearsal each); the
               prefill and decode measurements run on the chunked engine (prefill_only does not chunk,
               adopted requests only decode)

Clocks: host perf_counter; decode steps and the chunked scenario's steps are the intervals between
successive Engine.step() returns (a step returns once its tokens are on the host); everything else
has torch.cuda.synchronize() around each timed call. The KV pool is
sized from the points asked; points that do not fit the GPU (free memory minus --reserve-gb) are
skipped and listed. Targets (each reported met or missed with its figures): every decode point
within 2.0x its roofline; batch 1 at 1k <= 5.5 ms; batch 32 at 16k <= 25 ms; prefill within 3%
of transformers at every length; with chunking the decodes' max gap <= 3x their steady gap.
Writes JSON (with provenance) to bench/results/engine-<machine>-<date>.json and prints markdown.

GPU run (about 4-5 minutes on an H200: model ~30 s, first compiles, then the points):
    pdserve-bench engine --model qwen2.5-7b --device cuda:0
CPU smoke test (seconds):  see tests/test_engine_bench.py (tiny model, small lengths)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.engine import decode as dec
from pdserve.bench.engine import mixed as mx
from pdserve.bench.engine.report import markdown, targets
from pdserve.settings.worker import DECODE_GRAPH_FORWARDS

BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    a("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    a("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    a("--seed", type=int, default=0, help="seeds prompts, contexts and A/B orders (default 0)")
    a("--lengths", default="1k,4k,16k,32k", help="prefill lengths in tokens; 1k = 1024 (default 1k,4k,16k,32k)")
    a("--pairs", type=int, default=10, help="prefill rounds, transformers and ours once each (default 10)")
    a("--batches", default="1,8,32,64", help="decode batch sizes (default 1,8,32,64)")
    a("--contexts", default="1k,4k,16k", help="decode contexts in tokens per request (default 1k,4k,16k)")
    a("--mixed-batch", type=int, default=32, help="requests in the mixed-context point; 0 skips it (default 32)")
    a("--mixed-contexts", default="1k,16k", help="low,high: the mixed point's contexts are drawn from it")
    a("--repeats", type=int, default=5, help="timed decode steps per point (default 5)")
    a("--warmup", type=int, default=2, help="untimed steps before those, and untimed prefill rounds (default 2)")
    a("--hf-decode-context", default="1k", help="context of the transformers decode comparison; 0 skips it")
    a("--hf-decode-batches", default=None, help="its batch sizes (default: --batches)")
    a("--chunk-decodes", type=int, default=32, help="chunked scenario: requests decoding (default 32); 0 skips it")
    a("--chunk-context", default="1k", help="chunked scenario: their context (default 1k)")
    a("--chunk-prompt", default="16k", help="chunked scenario: the prompt that arrives (default 16k)")
    a("--chunk-tokens", type=int, default=None, help="prompt tokens per step with chunking (default: EngineConfig's)")
    a("--chunk-steady-steps", type=int, default=16, help="chunked scenario: steps before the arrival (default 16)")
    a("--mixed-step", default="32,1k,5k,512",
      help="decodes,context,prefix,chunk of the mixed-step point (wall vs GPU-busy time); '' skips it")
    a("--profile", default=None, metavar="DIR",
      help="also profile the chunked scenario's prompt steps into DIR (tables and a trace): chunked, its chunks "
           "over a prefix (from its second step, six at most); unchunked, its prompt's step, into DIR/unchunked")
    a("--profile-decode", default=None, metavar="DIR",
      help="also profile decode steps (another run of the point, untimed), tables and a trace: the first point's "
           "into DIR, and every further point at batch 1 into DIR/b1-<context> (the batch-1 points are the ones "
           "furthest from their roofline)")
    a("--decode-graph-forward", default=None, choices=DECODE_GRAPH_FORWARDS,
      help="what the decode graphs run: cut (the piecewise segments) or layers (transformers' forward); "
           "default: the engine's")
    a("--fuse-gate-up", action="store_true",
      help="one gate/up projection in each MLP (EngineConfig.fuse_gate_up; off by default): the A/B of it")
    a("--kv-memory-gb", type=float, default=None, help="cap the decode points' KV pool (GiB); default: sized from them")
    a("--reserve-gb", type=float, default=20.0,
      help="CUDA: memory left free beside the pool for activations, graphs, transformers' cache (default 20)")
    a("--out", default=None, help="JSON path (default bench/results/engine-<machine>-<date>.json)")


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    dec.sync(device)
    start = time.perf_counter()
    fn()
    dec.sync(device)
    return (time.perf_counter() - start) * 1e3


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def log(msg: str) -> None:
    print(f"[engine-bench] {msg}", file=sys.stderr, flush=True)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- transformers, the baseline ------------------------------------------------------------


def hf_twin(model):
    """A second module tree over the same parameter and buffer tensors (no weight copy): it keeps
    transformers' own attention while the engine re-routes the original's."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)


@torch.inference_mode()
def hf_prefill(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One prefill into a fresh DynamicCache; returns the last token's logits [vocab]."""
    from transformers import DynamicCache

    out = model(input_ids=ids.to(device)[None], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]
    logits.argmax().item()  # the first token, on the host, as our prefill_only returns it
    return logits


@torch.inference_mode()
def hf_decoder(model, batch: int, context: int, vocab: int, device: torch.device, seed: int) -> Callable[[], None]:
    """A DynamicCache prefilled with `batch` x `context` tokens; returns one decode step
    (next token [B, 1] in, greedy token back to the host, as Engine.step() has it)."""
    from transformers import DynamicCache

    ids = torch.stack([random_ids(context, vocab, seed + i) for i in range(batch)]).to(device)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}

    @torch.inference_mode()
    def step() -> None:
        out = model(input_ids=state["next"], past_key_values=cache, use_cache=True)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["next"].tolist()

    return step


# ---- the run -------------------------------------------------------------------------------


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def decode_points(args, batches: list[int], contexts: list[int]) -> list[dict]:
    points = [{"kind": "uniform", "batch": b, "contexts": [c] * b, "context": c} for c in contexts for b in batches]
    if args.mixed_batch:
        low, high = parse_counts(args.mixed_contexts)
        points.append({"kind": "mixed", "batch": args.mixed_batch, "context": None,
                       "contexts": dec.mixed_contexts(args.mixed_batch, low, high, args.seed), "range": [low, high]})
    return points


def profiled_points(points: list[dict], folder: str | None) -> list[tuple[str, dict]]:
    """(folder, point) for each decode point --profile-decode profiles: the first into `folder`, then every
    further batch-1 point into folder/b1-<context>; none without a folder."""
    if not folder or not points:
        return []
    return [(folder, points[0])] + [(str(Path(folder) / f"b1-{p['context'] or p['range']}"), p)
                                    for p in points[1:] if p["batch"] == 1]


def make_engine(loaded, device: torch.device, dtype: torch.dtype, **fields):
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.engine.kv_cache import dtype_name

    engine = Engine(EngineConfig(model=loaded.name, device=str(device), dtype=dtype_name(dtype),
                                 block_size=BLOCK_SIZE, prefix_cache=False, **fields), loaded=loaded)
    dec.fill_random(engine.kv.pool)
    return engine


def run(args: argparse.Namespace) -> int:
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.models import load_model

    lengths, batches, contexts = parse_counts(args.lengths), parse_counts(args.batches), parse_counts(args.contexts)
    hf_ctx = 0 if args.hf_decode_context.strip() == "0" else parse_counts(args.hf_decode_context)[0]
    hf_batches = parse_counts(args.hf_decode_batches) if args.hf_decode_batches else batches
    if args.repeats < 1 or args.warmup < 0 or args.pairs < 1:
        raise ValueError("--repeats and --pairs must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prov = provenance.collect([str(device)])
    t_start = time.monotonic()

    log(f"loading {args.model} on {device}")
    loaded = load_model(args.model, args.dtype, str(device))
    load_s = time.monotonic() - t_start
    model = loaded.model
    dtype = next(model.parameters()).dtype
    vocab = model.config.vocab_size
    twin = hf_twin(model)
    weights = dec.weight_bytes(model)
    bpt = kv_bytes_per_token(model, dtype)
    log(f"loaded in {load_s:.1f} s ({dtype}); a decode step reads {weights['read_per_step'] / 1e9:.2f} GB of weights")

    # ---- which decode points fit, and the pool they need
    steps = args.warmup + args.repeats + 2
    points = decode_points(args, batches, contexts)
    for p in points:
        p["blocks"] = sum(dec.blocks_for(c + steps, BLOCK_SIZE) for c in p["contexts"])
        p["kv_bytes"] = sum(p["contexts"]) * bpt
        p["bytes"] = weights["read_per_step"] + p["kv_bytes"]
    block_bytes = bpt * BLOCK_SIZE
    if args.kv_memory_gb:
        budget = int(args.kv_memory_gb * 2**30 // block_bytes)
    elif device.type == "cuda":
        budget = int((torch.cuda.mem_get_info(device)[0] - args.reserve_gb * 2**30) // block_bytes)
    else:
        budget = None
    skipped = [p for p in points if budget is not None and p["blocks"] > budget]
    points = [p for p in points if p not in skipped]
    for p in skipped:
        log(f"skipping decode batch {p['batch']} ({p['kind']}): needs {p['blocks'] * block_bytes / 2**30:.1f} GiB "
            f"of KV, {budget * block_bytes / 2**30:.1f} GiB fit")
    hf_points = hf_batches if hf_ctx else []
    chunk = None
    if args.chunk_decodes:
        chunk = {"decodes": args.chunk_decodes, "context": parse_counts(args.chunk_context)[0],
                 "prompt": parse_counts(args.chunk_prompt)[0], "steady_steps": args.chunk_steady_steps,
                 "after_steps": 4, "seed": args.seed}
        chunk_tokens = args.chunk_tokens or EngineConfig(device=str(args.device)).step_chunk_tokens
        chunk["max_prefill_steps"] = dec.chunked_steps_bound(chunk["prompt"], chunk_tokens)
        chunk_steps = chunk["steady_steps"] + chunk["max_prefill_steps"] + chunk["after_steps"] + 4
        chunk_blocks = chunk["decodes"] * dec.blocks_for(chunk["context"] + chunk_steps, BLOCK_SIZE) \
            + dec.blocks_for(chunk["prompt"] + chunk["after_steps"] + 2, BLOCK_SIZE)
    mixed_shape = parse_counts(args.mixed_step) if args.mixed_step else None  # decodes, context, prefix, chunk
    mixed_blocks = 0
    if mixed_shape:
        b, ctx, pre, n = mixed_shape
        mixed_blocks = b * dec.blocks_for(ctx + 2, BLOCK_SIZE) + dec.blocks_for(pre + n + 1, BLOCK_SIZE)
    num_blocks = max([p["blocks"] for p in points]
                     + [dec.blocks_for(max(lengths) + 1, BLOCK_SIZE)]
                     + [b * dec.blocks_for(hf_ctx + args.warmup + args.pairs + 2, BLOCK_SIZE) for b in hf_points]
                     + ([chunk_blocks] if chunk else [])
                     + ([mixed_blocks] if mixed_blocks else [])) + 8

    log(f"roofline copies for {len(points)} points (start)")
    roof_start = dec.copy_roofline([p["bytes"] for p in points], device, args.warmup, args.repeats)

    # ---- one engine, chunked prefill on: prefill A/B, transformers decode A/B, the decode points
    # (adopted requests only decode: the chunked flag does not touch them), then the chunked scenario
    max_len = max(max(lengths) + 1, max((c for p in points for c in p["contexts"]), default=0) + steps + 4,
                  hf_ctx + steps + 4,
                  chunk["prompt"] + 8 if chunk else 0, chunk["context"] + chunk_steps + 4 if chunk else 0,
                  mixed_shape[2] + mixed_shape[3] + 2 if mixed_shape else 0)
    shape = dict(num_blocks=num_blocks, max_num_seqs=max([p["batch"] for p in points] + hf_points + [1]
                                                         + ([mixed_shape[0] + 1] if mixed_shape else [])
                                                         + ([chunk["decodes"] + 1] if chunk else [])),
                 max_batched_tokens=max(8192, max(lengths)), max_model_len=max(max_len, loaded.max_model_len))
    if args.decode_graph_forward:
        shape["decode_graph_forward"] = args.decode_graph_forward
    if args.fuse_gate_up:
        shape["fuse_gate_up"] = True
    if chunk:
        shape["chunk_tokens"] = chunk_tokens
    engine = make_engine(loaded, device, dtype, chunked_prefill=True, **shape)
    log(f"engine: {engine.layout.num_blocks} blocks of {BLOCK_SIZE} tokens "
        f"({engine.layout.num_blocks * block_bytes / 2**30:.1f} GiB)")
    prefill_rows = [prefill_ab(engine, twin, n, vocab, device, args) for n in lengths]
    free(device)
    hf_rows = [hf_decode_ab(engine, twin, b, hf_ctx, vocab, device, args) for b in hf_points]
    free(device)
    for i, p in enumerate(points):
        log(f"decode batch {p['batch']}, {p['kind']} context {p['context'] or p['range']}")
        p["ours_ms"] = dec.decode_point(engine, p["contexts"], device, args.warmup, args.repeats,
                                        seed=args.seed + i, tag=f"decode-{i}")
    for folder, p in profiled_points(points, args.profile_decode):  # further runs, profiled, times not reported
        log(f"decode batch {p['batch']}, context {p['context'] or p['range']}, profiled into {folder}")
        dec.profiled(engine, device, lambda: dec.decode_point(engine, p["contexts"], device, 2, 10,
                                                                seed=args.seed, tag="decode-profiled"),
                     folder, steps=13)  # the first launch (overlapped: nothing back), then 12 read
    mixed_step = None
    if mixed_shape:
        b, ctx, pre, n = mixed_shape
        log(f"mixed step: {b} decodes at {ctx} + {n} prompt tokens at a {pre}-token prefix")
        mixed_step = mx.mixed_step_point(engine, device, b, ctx, pre, n, max(10, args.repeats), args.seed)
    chunked = {}
    for on in ((True, False) if chunk else ()):
        if not on:  # the same engine with chunked prefill off, its pool only as large as the scenario needs
            del engine  # (the pool's size does not change a step's time; two large pools might not fit at once)
            free(device)
            engine = make_engine(loaded, device, dtype, chunked_prefill=False,
                                 **{**shape, "num_blocks": chunk_blocks + 8})
        log(f"chunked scenario, chunked_prefill={on}: {chunk['decodes']} decodes at {chunk['context']}, "
            f"a {chunk['prompt']}-token prompt arrives")
        dec.chunked_scenario(engine, device, tag=f"rehearsal-{on}", **chunk)  # untimed: shapes, graphs, compiles
        chunked["on" if on else "off"] = {"chunked_prefill": on, "chunk_tokens": chunk_tokens if on else None,
                                          **chunk, **dec.chunked_scenario(engine, device, tag=f"chunk-{on}", **chunk)}
        if args.profile:  # a third run, profiled, whose times are not the ones reported: chunked, its chunks over
            # a prefix (from its second step); unchunked, the prompt's step, into DIR/unchunked
            folder = args.profile if on else str(Path(args.profile) / "unchunked")
            log(f"chunked scenario profiled into {folder}")
            dec.chunked_scenario(engine, device, tag="profiled", profile=folder, profile_from=1 if on else 0, **chunk)
    del engine
    free(device)
    log("roofline copies (end)")
    roof_end = dec.copy_roofline([p["bytes"] for p in points], device, args.warmup, args.repeats)

    decode_rows = [beside_roofline(p, roof_start[p["bytes"]], roof_end[p["bytes"]]) for p in points]
    result = {
        "benchmark": "engine",
        "provenance": provenance.finish(prov),
        "config": {
            "model": loaded.name, "dtype": str(dtype).removeprefix("torch."), "block_size": BLOCK_SIZE,
            "kv_bytes_per_token": bpt, "weight_bytes": weights, "seed": args.seed,
            "repeats": args.repeats, "warmup": args.warmup, "pairs": args.pairs,
            "lengths": lengths, "batches": batches, "contexts": contexts, "model_load_s": round(load_s, 2),
            "decode_graph_forward": args.decode_graph_forward or EngineConfig().decode_graph_forward,
            "fuse_gate_up": bool(args.fuse_gate_up),
            "run_s": round(time.monotonic() - t_start, 1),
            "roofline_method": "one copy_ of N/2 bytes into N/2 bytes (N = weights a step reads + the batch's KV "
                               "bytes): N bytes of memory traffic; the median over the copies at the start and the "
                               "end of the run; host clock with device synchronisation",
        },
        "decode": decode_rows,
        "skipped": [{"kind": p["kind"], "batch": p["batch"], "context": p["context"],
                     "kv_gib_needed": p["blocks"] * block_bytes / 2**30,
                     "kv_gib_available": budget * block_bytes / 2**30} for p in skipped],
        "prefill": prefill_rows,
        "transformers_decode": hf_rows,
        "chunked": chunked,
        "mixed_step": mixed_step,
    }
    result["targets"] = targets(result)
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / (
        f"engine-{provenance.machine_slug(device)}-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} after {result['config']['run_s']} s")
    print(markdown(result))
    return 0


def beside_roofline(p: dict, start: dict, end: dict) -> dict:
    """A decode point's row: its step time, the copies of its bytes at the start and the end of the
    run (their median together is the roofline), and ours / roofline."""
    roof = ab.summary(start["runs"] + end["runs"])
    row = {k: p[k] for k in ("kind", "batch", "context", "kv_bytes", "bytes", "ours_ms")}
    if p["kind"] == "mixed":
        row.update(contexts=p["contexts"], range=p["range"], context_sum=sum(p["contexts"]))
    row.update(roofline_ms=roof, copy_gbps=p["bytes"] / (roof["median"] / 1e3) / 1e9,
               roofline_start_ms=start["median"], roofline_end_ms=end["median"],
               copy_chunks=[start["chunks"], end["chunks"]], ratio=p["ours_ms"]["median"] / roof["median"],
               tokens_per_s=p["batch"] / p["ours_ms"]["median"] * 1e3)
    return row


def prefill_ab(engine, twin, n: int, vocab: int, device: torch.device, args) -> dict:
    from pdserve.workers.engine.request import Request, SamplingParams

    log(f"prefill {n} tokens: transformers and ours interleaved x {args.pairs}")
    prompts: dict[int, tuple[torch.Tensor, list[int]]] = {}
    calls = itertools.count()

    def prompt(i: int) -> tuple[torch.Tensor, list[int]]:  # one prompt per round, shared by both arms
        if i not in prompts:
            prompts.clear()
            ids = random_ids(n, vocab, seed=args.seed * 1_000_003 + n * 1009 + i)
            prompts[i] = (ids, ids.tolist())
        return prompts[i]

    def ours(ids: list[int]):
        tag = f"prefill-{n}-{next(calls)}"
        result = engine.prefill_only(Request(tag, ids, SamplingParams(max_tokens=1, ignore_eos=True)))
        engine.release(tag)
        return result

    def timed(arm: str, i: int) -> float:
        ids, as_list = prompt(i)  # made before the clock starts
        if arm == "transformers":
            return time_ms(lambda: hf_prefill(twin, ids, device), device)
        return time_ms(lambda: ours(as_list), device)

    arms = {"transformers": lambda i: timed("transformers", i), "ours": lambda i: timed("ours", i)}
    got = ab.interleave(arms, args.pairs, seed=args.seed + n, warmup=args.warmup)
    check_ids = random_ids(n, vocab, seed=n)  # sanity, not a target: the same last-token logits
    theirs, mine = hf_prefill(twin, check_ids, device).float().cpu(), ours(check_ids.tolist())
    paired = ab.paired(got.results["transformers"], got.results["ours"])
    return {
        "tokens": n,
        "transformers_ms": ab.summary(got.results["transformers"]),
        "ours_ms": ab.summary(got.results["ours"]),
        "paired": paired,
        "ratio": paired["ratio"]["median"],
        "orders": got.orders,
        "first_token_agrees": int(mine.first_token) == int(theirs.argmax()),
        "max_abs_logit_diff": float((mine.logits.float().cpu() - theirs).abs().max()),
    }


def hf_decode_ab(engine, twin, batch: int, context: int, vocab: int, device: torch.device, args) -> dict:
    log(f"decode step at {context}, batch {batch}: transformers and ours interleaved x {args.pairs}")
    hf_step = hf_decoder(twin, batch, context, vocab, device, seed=args.seed + 7 * batch)
    # tokens: the adopted first one, one per step, and one more step to read the last back (overlap)
    reqs = dec.adopt_batch(engine, [context] * batch, f"hf-ab-{batch}", args.warmup + args.pairs + 2, args.seed)
    ours = dec.BatchDecode(engine, reqs, device)
    try:
        got = ab.interleave({"transformers": lambda i: time_ms(hf_step, device), "ours": lambda i: ours.step()},
                            args.pairs, seed=args.seed + batch, warmup=args.warmup)
        tokens = ours.flush()
    finally:
        for r in reqs:
            engine.abort(r.request_id)
        dec.settle(engine)
    paired = ab.paired(got.results["transformers"], got.results["ours"])
    return {"batch": batch, "context": context, "transformers_ms": ab.summary(got.results["transformers"]),
            "ours_ms": ab.summary(got.results["ours"]), "paired": paired, "ratio": paired["ratio"]["median"],
            "ours_tokens": [tokens[r.request_id] for r in reqs]}


if __name__ == "__main__":  # `python -m pdserve.bench.engine.steps ...`, the same as `pdserve-bench engine ...`
    _parser = argparse.ArgumentParser(prog="pdserve-bench engine", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
