"""`pdserve-bench offline`: an offline workload through the engine, beside its floor and its peer.

`--prompts` prompts of `--min-len`..`--max-len` tokens (seeded, random ids), `--out-tokens` each, EOS
ignored, all added at once and run to the end (Engine.generate), greedy and sampled (`--sampling`: at
`--temperature` 0.8, each prompt seeded), for each engine configuration in
`--configs` (default: the default config; unchunked; larger chunk budgets), one engine whose scheduler
is switched between them (the same graphs and weights), and transformers' own continuous batching
(`generate_batch`, its paged attention) on the same model and prompts, greedy and sampled alike:
`--rounds` rounds, the arms in a shuffled order each round (bench/ab.py's rule: A/B in one run, interleaved).
Targets (issue 33), for greedy and sampled each: the default config within 2x its floor, and at least 4x
the throughput of transformers' batching.

The floor is measured in the same run (bench/engine/mixed.py): the prompt tokens at the speed of whole
unchunked prompts of the workload's mean length, plus the decode steps of an ideal schedule at their
roofline (the weights and the batch's KV bytes at the measured copy speed). Writes JSON with provenance
to bench/results/offline-<machine>-<date>.json and prints a table.

GPU run (about 5 minutes on an H200: greedy and sampled):  pdserve-bench offline --model qwen2.5-7b --device cuda:0
CPU smoke test: tests/test_engine_bench.py (tiny model, a few prompts, no peer)
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.engine import decode as dec
from pdserve.bench.engine import mixed as mx
from pdserve.bench import provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.engine.steps import hf_twin, kv_bytes_per_token

FLOOR_LIMIT = 2.0  # the default config's wall time / its floor, greedy and sampled alike
PEER_SPEEDUP = 4.0  # transformers' wall time / the default config's
MODES = ("greedy", "sampled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    a("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    a("--prompts", type=int, default=128, help="prompts in the workload (default 128)")
    a("--min-len", default="256", help="shortest prompt, tokens (default 256)")
    a("--max-len", default="2k", help="longest prompt, tokens (default 2k)")
    a("--out-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    a("--configs", default="default,unchunked,chunk1024,chunk2048",
      help="engine configurations: default, unchunked, chunkN (chunk_tokens N) (default: those four)")
    a("--sampling", default="greedy,sampled",
      help="greedy, sampled (at --temperature, each prompt seeded), or both (default both)")
    a("--temperature", type=float, default=0.8, help="the sampled runs' temperature (default 0.8)")
    a("--rounds", type=int, default=1, help="rounds of every arm, shuffled per round (default 1)")
    a("--peer", action=argparse.BooleanOptionalAction, default=True,
      help="run transformers' continuous batching on the same prompts (default on)")
    a("--kv-memory-gb", type=float, default=40.0, help="the engine's KV pool (default 40)")
    a("--seed", type=int, default=0, help="seeds the prompts and the order (default 0)")
    a("--out", default=None, help="JSON path (default bench/results/offline-<machine>-<date>.json)")


def _scheduler_for(name: str, default_chunk: int) -> tuple[bool, int]:
    if name == "default":
        return True, default_chunk
    if name == "unchunked":
        return False, default_chunk
    if name.startswith("chunk") and name[5:].isdigit():
        return True, int(name[5:])
    raise ValueError(f"unknown config {name!r}: default, unchunked or chunkN")


def hf_peer(twin, prompts: list[list[int]], out: int, device: torch.device, temperature: float = 0.0,
            seed: int = 0) -> dict:
    """transformers' continuous batching (generate_batch) over the same prompts, greedy or sampled at
    `temperature` (its whole distribution, as the engine's: no top-k or top-p; one seed for the run)."""
    from transformers import GenerationConfig

    if temperature:
        torch.manual_seed(seed)
        cfg = GenerationConfig(max_new_tokens=out, min_new_tokens=out, do_sample=True, temperature=temperature,
                               top_k=0, top_p=1.0, eos_token_id=None)
    else:
        cfg = GenerationConfig(max_new_tokens=out, min_new_tokens=out, do_sample=False, eos_token_id=None)
    dec.sync(device)
    t = time.perf_counter()
    results = twin.generate_batch(inputs=prompts, generation_config=cfg)
    dec.sync(device)
    wall = time.perf_counter() - t
    made = sum(len(r.generated_tokens) for r in results.values())
    return {"wall_s": wall, "gen_tokens": made, "out_tok_s": made / wall}


def run(args: argparse.Namespace) -> int:
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.engine.kv_cache import dtype_name
    from pdserve.workers.engine.models import load_model

    modes = [m.strip() for m in args.sampling.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--sampling: greedy, sampled or both, got {args.sampling!r}")

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prov = provenance.collect([str(device)])
    t0 = time.monotonic()
    loaded = load_model(args.model, None, str(device))
    model = loaded.model
    dtype = next(model.parameters()).dtype
    twin = hf_twin(model) if args.peer else None
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    base = EngineConfig(device=str(device))
    arms = {n: _scheduler_for(n, base.step_chunk_tokens) for n in names}
    widest = max(c for _, c in arms.values())
    # the piecewise path sized for the widest arm's chunk (graphs up to the worker's graph limit, as served)
    engine = Engine(EngineConfig(model=loaded.name, device=str(device), dtype=dtype_name(dtype), prefix_cache=False,
                                 kv_memory_gb=args.kv_memory_gb, chunk_tokens=widest),
                    loaded=loaded)
    warmup_s = engine.warmup()
    lo, hi = parse_counts(args.min_len)[0], parse_counts(args.max_len)[0]
    prompts = mx.offline_prompts(args.prompts, lo, hi, engine.vocab_size, args.seed)
    lengths = [len(p) for p in prompts]
    engine.generate(prompts[:4], None)  # compiles and lazy starts outside the timed runs
    if "sampled" in modes:  # the sampled step's own first run too
        engine.generate(prompts[:4], mx.offline_params(4, 2, args.temperature, args.seed))

    def label(name: str, mode: str) -> str:
        return name if mode == "greedy" else f"{name} sampled"

    temps = {"greedy": 0.0, "sampled": args.temperature}
    arm_of = {label(n, m): (n, m) for m in modes for n in names + (["transformers"] if args.peer else [])}
    runs: dict[str, list[dict]] = {a: [] for a in arm_of}
    order = random.Random(args.seed)
    for rnd in range(args.rounds):
        arms_now = list(runs)
        order.shuffle(arms_now)
        for arm in arms_now:
            name, mode = arm_of[arm]
            print(f"round {rnd + 1}: {arm}", flush=True)
            if name == "transformers":
                try:
                    runs[arm].append(hf_peer(twin, prompts, args.out_tokens, device, temps[mode], args.seed))
                except Exception as e:  # the peer's failure is reported, not ours to hide or to die of
                    runs[arm].append({"error": f"{type(e).__name__}: {e}"})
                continue
            engine.scheduler.chunked, engine.scheduler.chunk_tokens = arms[name]
            runs[arm].append(mx.offline_run(engine, prompts, args.out_tokens, device, temps[mode], args.seed))
    engine.scheduler.chunked, engine.scheduler.chunk_tokens = True, base.step_chunk_tokens

    mean_len = round(statistics.mean(lengths))
    speed = mx.prefill_speed(engine, mean_len, 5, device, args.seed + 1)
    weights = dec.weight_bytes(model)["read_per_step"]
    bpt = kv_bytes_per_token(model, dtype)
    copy = dec.copy_roofline([1 << 32], device, 2, 5)[1 << 32]
    copy_bps = (1 << 32) / (copy["median"] / 1e3)
    prefill_floor = speed["s_per_token"] * sum(lengths)
    decode_floor = mx.decode_floor_s(lengths, args.out_tokens, base.max_num_seqs, weights, bpt, copy_bps)
    floor = prefill_floor + decode_floor

    def wall(name: str) -> float | None:
        good = [r["wall_s"] for r in runs.get(name, []) if "wall_s" in r]
        return statistics.median(good) if good else None

    table = {a: {"wall_s": wall(a), "over_floor": wall(a) / floor if wall(a) else None, "runs": runs[a]} for a in runs}
    for a, (name, mode) in arm_of.items():
        if name != "transformers":
            peer = wall(label("transformers", mode))
            table[a]["over_transformers"] = wall(a) / peer if peer and wall(a) else None
    default_name = names[0]
    targets = {}
    for mode in modes:
        row = table[label(default_name, mode)]
        over, vs = row["over_floor"], row["over_transformers"]
        targets[f"{mode}_within_{FLOOR_LIMIT:g}x_floor"] = {
            "target": f"the {default_name} config's {mode} wall time <= {FLOOR_LIMIT:g}x its floor",
            "measured": over, "met": None if over is None else over <= FLOOR_LIMIT}
        targets[f"{mode}_{PEER_SPEEDUP:g}x_transformers"] = {
            "target": f"the {default_name} config's {mode} run >= {PEER_SPEEDUP:g}x transformers' batching "
                      f"(its wall time / theirs <= {1 / PEER_SPEEDUP:g})",
            "measured": vs, "met": None if vs is None else vs <= 1 / PEER_SPEEDUP}
    result = {
        "benchmark": "offline",
        "provenance": provenance.finish(prov),
        "config": {"model": loaded.name, "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts,
                   "prompt_tokens": sum(lengths), "min_len": lo, "max_len": hi, "out_tokens": args.out_tokens,
                   "rounds": args.rounds, "seed": args.seed, "sampling": modes, "temperature": args.temperature,
                   "configs": {n: {"chunked": c, "chunk_tokens": t}
                                                                       for n, (c, t) in arms.items()},
                   "warmup_s": warmup_s, "run_s": round(time.monotonic() - t0, 1)},
        "floor": {"s": floor, "prefill_s": prefill_floor, "decode_s": decode_floor, "prefill_speed": speed,
                  "copy_gbps": copy_bps / 1e9, "weight_bytes_per_step": weights, "kv_bytes_per_token": bpt,
                  "method": "prompt tokens x s/token of whole unchunked prompts of the mean length, plus the "
                            "decode steps of batches of max_num_seqs at weights + KV bytes over the copy speed"},
        "arms": table,
        "targets": targets,
    }
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / f"offline-{provenance.machine_slug(device)}-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"offline: {args.prompts} prompts ({sum(lengths)} tokens) x {args.out_tokens} out; floor {floor:.2f} s "
          f"(prefill {prefill_floor:.2f} + decode {decode_floor:.2f})")
    print("| arm | wall s | / floor | / transformers |\n|---|---|---|---|")
    for n, row in table.items():
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {n} | {f(row['wall_s'])} | {f(row['over_floor'])} | {f(row.get('over_transformers'))} |")
    for t in targets.values():
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"- {t['target']}: {verdict} (measured {measured})")
    print(f"wrote {out}")
    return 0
