"""`pdserve-bench engine`: our engine's prefill and decode step against transformers' own.

Same model object, same token ids, same process, one after the other:

    prefill   transformers: model(ids[1, N], past_key_values=DynamicCache(), logits_to_keep=1)
              + greedy first token (the seeds' method)
              ours: Engine.prefill_only(fresh request) (paged KV write + first token), then release
    decode    transformers: model(next[B, 1], past_key_values=cache) on a DynamicCache prefilled
              to `--context` tokens per sequence, + greedy next token read back to the host
              ours: Engine.step() with B requests of `--context` prompt tokens, all in decode

Each number is the median of `--repeats` runs after `--warmup` runs, with
torch.cuda.synchronize() around every timed call. Targets: prefill within 5% of
transformers; decode at batch 1 no slower than transformers; decode at batch 32 within
2x of our own batch 1. Writes JSON (machine, versions, per-length and per-batch numbers)
to bench/results/engine-<machine>-<date>.json and prints a markdown table last.

GPU run:  pdserve-bench engine --model qwen2.5-7b --device cuda
CPU smoke test:  pdserve-bench engine --model tiny --device cpu --lengths 64,128 --batches 1,2 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PREFILL_TOLERANCE = 1.05  # ours / transformers
BATCH_SCALING_LIMIT = 2.0  # our decode step at batch 32 / our batch 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    parser.add_argument("--lengths", default="1024,4096,16384,32768",
                        help="prefill lengths in tokens, comma separated; 1k = 1024 (default 1k,4k,16k,32k)")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma separated (default 1,8,32)")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence for decode (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point; the median is reported (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before each point (default 2)")
    parser.add_argument("--kv-memory-gb", type=float, default=None,
                        help="our engine's KV pool in GiB (default 20 on CUDA, 0.25 on CPU)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/engine-<machine>-<date>.json)")


def parse_counts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if value <= 0:
            raise ValueError(f"counts must be positive, got {part!r}")
        out.append(value)
    if not out:
        raise ValueError(f"no counts in {text!r}")
    return out


# ---- timing --------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def summary(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def repeat(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> dict:
    for _ in range(warmup):
        time_ms(fn, device)
    return summary([time_ms(fn, device) for _ in range(repeats)])


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- transformers, the baseline ------------------------------------------------------------


@torch.inference_mode()
def hf_prefill(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One prefill into a fresh DynamicCache; returns the last token's logits [vocab]."""
    from transformers import DynamicCache

    out = model(input_ids=ids.to(device)[None], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]
    logits.argmax().item()  # the first token, on the host, as our prefill_only returns it
    return logits


def hf_decode_times(model, batch: int, context: int, vocab: int, device: torch.device,
                    warmup: int, repeats: int) -> dict:
    from transformers import DynamicCache

    ids = torch.stack([random_ids(context, vocab, seed=1000 + i) for i in range(batch)]).to(device)
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}  # [B, 1]

        def step():
            out = model(input_ids=state["next"], past_key_values=cache, use_cache=True)
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
            state["next"].tolist()  # tokens on the host, as Engine.step() has them

        result = repeat(step, device, warmup, repeats)
    del cache, state, out
    return result


# ---- our engine ----------------------------------------------------------------------------


def ours_prefill(engine, ids: torch.Tensor, tag: str):
    from workers.engine.request import Request, SamplingParams

    req = Request(tag, ids.tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
    result = engine.prefill_only(req)
    engine.release(tag)
    return result


def ours_decode_times(engine, batch: int, context: int, vocab: int, device: torch.device,
                      warmup: int, repeats: int) -> dict:
    """B requests of `context` prompt tokens, stepped until all decode together; then time steps."""
    from workers.engine.request import Request, SamplingParams

    setup_steps = _setup_steps(batch, context, engine.config.max_batched_tokens)
    params = SamplingParams(max_tokens=setup_steps + warmup + repeats + 4, ignore_eos=True)
    reqs = [Request(f"bench-decode-b{batch}-{i}", random_ids(context, vocab, seed=1000 + i).tolist(), params)
            for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    try:
        for _ in range(setup_steps):
            if all(r.output_ids for r in reqs) and not engine.scheduler.waiting:
                break
            engine.step()
        if not all(r.output_ids for r in reqs):
            raise RuntimeError(f"batch {batch}: not every request was prefilled after {setup_steps} steps; "
                               f"raise --kv-memory-gb")

        def step():
            outs = engine.step()
            if len(outs) != batch:
                raise RuntimeError(f"a decode step of batch {batch} returned {len(outs)} outputs")

        return repeat(step, device, warmup, repeats)
    finally:
        for r in reqs:
            engine.abort(r.request_id)


def _setup_steps(batch: int, context: int, max_batched_tokens: int) -> int:
    # the scheduler alternates prefill and decode steps while requests are admitted
    return 2 * math.ceil(batch * context / max_batched_tokens) + 4


# ---- the run -------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def machine_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def log(msg: str) -> None:
    print(f"[engine-bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.engine.kv_cache import dtype_name
    from workers.engine.models import load_model

    lengths, batches = parse_counts(args.lengths), parse_counts(args.batches)
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv_gb = args.kv_memory_gb or (20.0 if device.type == "cuda" else 0.25)

    log(f"loading {args.model} on {device}")
    t0 = time.monotonic()
    loaded = load_model(args.model, args.dtype, str(device))
    load_s = time.monotonic() - t0
    model = loaded.model
    dtype = next(model.parameters()).dtype
    vocab = model.config.vocab_size
    log(f"loaded in {load_s:.1f} s ({dtype})")

    # transformers first: the engine switches the model's attention to the paged one
    hf_prefill_ms, hf_logits = {}, {}
    for n in lengths:
        ids = random_ids(n, vocab, seed=n)
        log(f"transformers prefill {n} tokens")
        hf_prefill_ms[n] = repeat(lambda: hf_prefill(model, ids, device), device, args.warmup, args.repeats)
        hf_logits[n] = hf_prefill(model, ids, device).float().cpu()
        _free(device)
    hf_decode_ms = {}
    for b in batches:
        log(f"transformers decode step, batch {b}, context {args.context}")
        hf_decode_ms[b] = hf_decode_times(model, b, args.context, vocab, device, args.warmup, args.repeats)
        _free(device)

    decode_tokens = args.context + _setup_steps(max(batches), args.context, 8192) + args.warmup + args.repeats + 4
    config = EngineConfig(
        model=args.model, device=str(device), dtype=dtype_name(dtype), block_size=16,
        kv_memory_gb=kv_gb, max_num_seqs=max(64, max(batches)), max_batched_tokens=8192,
        # a prompt of exactly the model's context still needs room for its first token
        max_model_len=max(loaded.max_model_len, max(lengths) + 1, decode_tokens),
    )
    engine = Engine(config, loaded=loaded)
    log(f"engine: {engine.layout.num_blocks} blocks of {engine.layout.block_size} tokens ({kv_gb} GiB)")
    prefill_rows = []
    for n in lengths:
        ids = random_ids(n, vocab, seed=n)
        log(f"engine prefill {n} tokens")
        ours = repeat(lambda: ours_prefill(engine, ids, f"bench-prefill-{n}"), device, args.warmup, args.repeats)
        check = ours_prefill(engine, ids, f"bench-prefill-{n}-check")
        ratio = ours["median"] / hf_prefill_ms[n]["median"]
        prefill_rows.append({
            "tokens": n,
            "kv_bytes": n * engine.layout.bytes_per_token,
            "transformers_ms": hf_prefill_ms[n],
            "ours_ms": ours,
            "ratio": ratio,
            "target": f"ours <= {PREFILL_TOLERANCE} x transformers",
            "met": ratio <= PREFILL_TOLERANCE,
            # sanity, not a target: the same last-token logits (bf16 kernels may differ slightly)
            "first_token_agrees": int(check.first_token) == int(hf_logits[n].argmax()),
            "max_abs_logit_diff": float((check.logits.float().cpu() - hf_logits[n]).abs().max()),
        })
        _free(device)
    decode_rows = []
    for b in batches:
        log(f"engine decode step, batch {b}, context {args.context}")
        ours = ours_decode_times(engine, b, args.context, vocab, device, args.warmup, args.repeats)
        decode_rows.append({
            "batch": b,
            "context": args.context,
            "transformers_ms": hf_decode_ms[b],
            "ours_ms": ours,
            "ratio": ours["median"] / hf_decode_ms[b]["median"],
            "ours_tokens_per_s": b / ours["median"] * 1e3,
            "transformers_tokens_per_s": b / hf_decode_ms[b]["median"] * 1e3,
        })
        _free(device)

    result = {
        "benchmark": "engine",
        "machine": machine_info(device),
        "config": {
            "model": loaded.name, "dtype": dtype_name(dtype), "block_size": config.block_size,
            "kv_memory_gb": kv_gb, "kv_blocks": engine.layout.num_blocks,
            "kv_bytes_per_token": engine.layout.bytes_per_token,
            "repeats": args.repeats, "warmup": args.warmup, "decode_context": args.context,
            "lengths": lengths, "batches": batches, "model_load_s": round(load_s, 2),
        },
        "prefill": prefill_rows,
        "decode": decode_rows,
        "targets": targets(prefill_rows, decode_rows),
    }
    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"engine-{machine_slug(device)}-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    print(markdown(result))
    return 0


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def targets(prefill_rows: list[dict], decode_rows: list[dict]) -> dict:
    by_batch = {row["batch"]: row for row in decode_rows}
    b1, b32 = by_batch.get(1), by_batch.get(32)
    return {
        "prefill_within_5pct": {str(row["tokens"]): row["met"] for row in prefill_rows},
        # null: the batch sizes needed for that target were not measured
        "decode_b1_not_slower": None if b1 is None else b1["ours_ms"]["median"] <= b1["transformers_ms"]["median"],
        "decode_b32_within_2x_b1": None if b1 is None or b32 is None
        else b32["ours_ms"]["median"] <= BATCH_SCALING_LIMIT * b1["ours_ms"]["median"],
    }


def _cell(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def markdown(result: dict) -> str:
    m, c = result["machine"], result["config"]
    lines = [
        f"engine bench: {c['model']} {c['dtype']} on {m['device']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, median of {c['repeats']} (min-max), ms",
        "",
        "| prefill tokens | transformers | ours | ours/transformers | within 5% |",
        "|---:|---:|---:|---:|:---:|",
    ]
    for row in result["prefill"]:
        lines.append(f"| {row['tokens']} | {_cell(row['transformers_ms'])} | {_cell(row['ours_ms'])} | "
                     f"{row['ratio']:.3f} | {'yes' if row['met'] else 'NO'} |")
    lines += ["", f"| decode batch (context {c['decode_context']}) | transformers | ours | ours/transformers | ours tok/s |",
              "|---:|---:|---:|---:|---:|"]
    for row in result["decode"]:
        lines.append(f"| {row['batch']} | {_cell(row['transformers_ms'])} | {_cell(row['ours_ms'])} | "
                     f"{row['ratio']:.3f} | {row['ours_tokens_per_s']:.0f} |")
    t = result["targets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines += ["", f"decode b1 <= transformers b1: {verdict[t['decode_b1_not_slower']]}; "
                  f"decode b32 <= 2x our b1: {verdict[t['decode_b32_within_2x_b1']]}"]
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m bench.engine_bench ...`, the same as `pdserve-bench engine ...`
    _parser = argparse.ArgumentParser(prog="pdserve-bench engine", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
