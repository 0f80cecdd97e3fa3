"""`pdserve-bench start`: where a worker's start goes, part by part, and what each graph capture costs.

Builds an Engine for --model/--device as a worker of --role does (workers/warmup.py, start_engine: the
model loaded, the KV pool allocated, the graphs captured, the warm-up request) and reports the parts of
its ready line (workers/engine/start_times.py), each from the same record, plus:

  decode graphs     each graph's capture seconds by (batch, blocks) bucket, in capture order, with the
                    paged-attention kernel's split of that bucket (paged_kernel.decode_split: run-time
                    arguments of the kernel, so every bucket runs one compiled variant) and whether its
                    forward compiles the layers: the first graph (torch.compile's dynamic code, the
                    kernels' Triton variants), and with --decode-graph-forward layers the first of batch 1
                    too (dynamo specialises a size of 1; "cut" runs batch 1's segments over 2 rows);
                    seconds summed over those and over the others
  piecewise graphs  each token bucket's capture seconds (its L + 1 segments; with "cut" decode graphs,
                    the segments they compiled: a piecewise capture compiles nothing)
  compile           torch.compile during the captures: frames compiled, recompiles with dynamo's reasons,
                    seconds by phase; Triton compiles in this process, by kernel (bench/engine/compile_watch.py)
  caches            files in Triton's and Inductor's on-disk caches at start: none is a cold start.
                    --cache-dir DIR points both at DIR; a second run on the same DIR is a warm restart
  --profile DIR     one decode graph's capture (--profile-graph: its index in capture order; default 1,
                    the first after the layers' compile) under torch.profiler and cProfile: the top 15 ops
                    by CPU time and the top 15 Python functions; tables and a gzipped trace in DIR. With
                    no decode graphs (the CPU), the warm-up request is profiled instead, and the JSON says so

Host clock (time.monotonic), the device synchronised at the end of each part and each graph. Writes JSON
with provenance to bench/results/start-<machine>-<date>.json and prints the parts.

GPU run (cold, then warm on the same caches; each well under 3 minutes on an H200):
    pdserve-bench start --model qwen2.5-7b --device cuda:0 --cache-dir /tmp/pc --profile /tmp/prof
A/B of what the decode graphs run (EngineConfig.decode_graph_forward), each on caches of its own:
    pdserve-bench start --decode-graph-forward layers --cache-dir /tmp/pc-layers   (then cut, /tmp/pc-cut)
CPU smoke test: tests/test_start.py (tiny)
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from pdserve.bench import provenance
from pdserve.settings.worker import DECODE_GRAPH_FORWARDS, GRAPH_STARTS
from pdserve.bench.engine import compile_watch

TARGET_AFTER_LOAD_S = 20.0  # issue 33: ready within this long after the model is loaded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="qwen2.5-7b", help="model name or checkpoint dir (default qwen2.5-7b)")
    a("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    a("--role", default="colocated", choices=("colocated", "decode", "prefill"),
      help="the worker role whose start to measure: prefill captures no graphs (default colocated)")
    a("--max-num-seqs", type=int, default=None, help="the engine's --max-num-seqs (default: the worker's)")
    a("--max-model-len", type=int, default=None, help="the engine's --max-model-len (default: the model's)")
    a("--kv-memory-gb", type=float, default=None, help="the KV pool, GiB (default: the worker's)")
    a("--num-blocks", type=int, default=None, help="the KV pool, blocks (default: the worker's)")
    a("--no-warmup", action="store_true", help="skip the warm-up request, as `pdserve-worker --no-warmup`")
    a("--decode-graph-forward", default=None, choices=DECODE_GRAPH_FORWARDS,
      help="what the decode graphs run: the piecewise path's segments (cut) or transformers' forward with "
           "compiled layers (layers); default: the engine's")
    a("--graphs", default=None, choices=GRAPH_STARTS,
      help="every graph at start (all), or of each kind (decode, piecewise) the largest at start and the rest "
           "while idle (lazy); default: the engine's")
    a("--cache-dir", default=None, metavar="DIR",
      help="Triton's and Inductor's compile caches in DIR (default: theirs); a run on an empty DIR starts cold")
    a("--profile", default=None, metavar="DIR", help="profile one decode graph's capture into DIR")
    a("--profile-graph", type=int, default=1, help="which graph, by its index in capture order (default 1)")
    a("--out", default=None, help="JSON path (default bench/results/start-<machine>-<date>.json)")


def engine_config(args: argparse.Namespace):
    from pdserve.settings.worker import EngineConfig

    fields = {k: getattr(args, k) for k in ("max_num_seqs", "max_model_len", "kv_memory_gb", "num_blocks",
                                            "decode_graph_forward", "graphs") if getattr(args, k) is not None}
    return EngineConfig(model=args.model, device=args.device, **fields)


def decode_rows(engine, profiled: tuple[int, int] | None) -> list[dict]:
    """Each captured decode graph in capture order, with its bucket's attention split and whether its
    forward compiles the layers (the first graph, and where the graphs run transformers' forward the
    first of batch 1); the profiled one marked (its seconds include the profilers')."""
    graphs = engine.runner.graphs
    split = None
    if engine.runner.kernels:
        from pdserve.workers.engine.paged_kernel import decode_split

        def split(batch: int, blocks: int) -> list[int]:
            return list(decode_split(batch, engine.layout.num_kv_heads, blocks * engine.layout.block_size,
                                     engine.device))
    seen, rows = set(), []
    for key, s in graphs.capture_s.items():  # insertion order: the order they were captured
        # the shapes dynamo compiles apart: batch 1, and every other batch (the cut's batch 1 runs 2 rows)
        shape = key[0] == 1 and graphs.cut is None
        row = {"batch": key[0], "blocks": key[1], "s": s, "profiled": key == profiled, "compiles": shape not in seen}
        seen.add(shape)
        if split is not None:
            row["split"] = split(*key)
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {"graphs": len(rows), "s": sum(r["s"] for r in rows)}
    if not rows:
        return out
    first = [r["s"] for r in rows if r["compiles"]]
    rest = sorted(r["s"] for r in rows if not r["compiles"])
    out.update(compiling=len(first), compiling_s=sum(first), other_s=sum(rest),
               other_median_s=rest[len(rest) // 2] if rest else None)
    return out


def run(args: argparse.Namespace) -> int:
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.warmup import warm_up

    if args.cache_dir:
        compile_watch.use_cache_dir(args.cache_dir)
    t0 = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.device = str(device)
    prov = provenance.collect([str(device)])
    caches = compile_watch.cache_entries()
    watch = compile_watch.CompileWatch().start()
    engine = Engine(engine_config(args))
    graphs = engine.runner.graphs
    profile, profiled = None, None
    if args.profile and graphs is not None and args.role != "prefill":  # else the warm-up request, below
        order = graphs.capture_order()
        k = min(args.profile_graph, len(order) - 1)
        profiled = order[k]
        with torch.inference_mode():
            graphs.capture(order[:k])
            profile = compile_watch.profile_call(lambda: graphs.capture([profiled]), device, args.profile)
        profile["what"] = f"capture of decode graph {profiled} (batch, blocks), index {k} in capture order"
    if args.role != "prefill":
        engine.warmup()
    if not args.no_warmup:
        if args.profile and profile is None:
            box = {}
            profile = compile_watch.profile_call(lambda: box.setdefault("s", warm_up(engine)), device, args.profile)
            profile["what"] = "the warm-up request (this start captures no decode graphs)"
            engine.start.warmup_s = box["s"]
        else:
            engine.start.warmup_s = warm_up(engine)
    start = engine.start
    start.finish()
    compiled = watch.stop()
    idle = None  # --graphs lazy: the graphs the start left, taken as an idle worker takes them
    if engine.graphs_pending():
        t = time.monotonic()
        while engine.graphs_pending():
            if engine.has_work():  # a step still in flight (overlap) is settled first, as a worker's loop
                engine.step()      # does: no capture is due while the engine has work
            else:
                engine.capture_idle()
        idle = {"decode_graphs": len(graphs.idle) if graphs is not None else 0,
                "piecewise_buckets": len(engine.runner.mixed.idle) if engine.runner.mixed is not None else 0,
                "s": time.monotonic() - t}

    rows = decode_rows(engine, profiled) if graphs is not None else []
    mixed = engine.runner.mixed
    piecewise = [{"tokens": b, "graphs": mixed.cut.num_segments, "s": s, "idle": b in mixed.idle}
                 for b, s in mixed.capture_s.items()] if mixed is not None else []
    result = {
        "benchmark": "start",
        "provenance": provenance.finish(prov),
        "config": {"model": engine.model_name, "device": str(device), "role": args.role, "dtype": engine.layout.dtype,
                   "max_num_seqs": engine.config.max_num_seqs, "max_model_len": engine.max_model_len,
                   "kv_blocks": engine.blocks.num_blocks, "block_size": engine.layout.block_size,
                   "compile": engine.config.compile, "cuda_graphs": graphs is not None,
                   "decode_graph_forward": engine.config.decode_graph_forward,
                   "graphs": engine.config.graphs,
                   "decode_graphs_run_the_cut": graphs is not None and graphs.cut is not None,
                   "batch_buckets": graphs.batch_buckets if graphs is not None else [],
                   "block_buckets": graphs.block_buckets if graphs is not None else [],
                   "mixed_graph_tokens": engine.config.mixed_graph_tokens, "warmup_request": not args.no_warmup,
                   "cache_dir": args.cache_dir, "profiled": args.profile is not None,
                   "clock": "host, time.monotonic; the device synchronised at each part's and each graph's end",
                   "run_s": round(time.monotonic() - t0, 2)},
        "start": start.to_dict(),
        "ready_line": start.describe(),
        "decode_graphs": rows,
        "decode_summary": summarise(rows),
        "graphs_idle": idle,  # lazy: the graphs taken after ready, as an idle worker takes them (null: none)
        "piecewise_graphs": piecewise,
        "compile": compiled,
        "caches_at_start": caches,
        "profile": profile,
        "targets": {"ready_within_20_s_of_load": {
            "target": f"ready <= {TARGET_AFTER_LOAD_S:.0f} s after the model is loaded",
            "measured": start.after_load_s, "met": start.after_load_s <= TARGET_AFTER_LOAD_S}},
    }
    out = Path(args.out) if args.out else \
        provenance.RESULTS_DIR / f"start-{provenance.machine_slug(device)}-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"wrote {out}")
    return 0


def report(result: dict) -> str:
    c, s, d, k = result["config"], result["start"], result["decode_summary"], result["compile"]
    lines = [f"start: {c['model']} on {c['device']} ({c['role']}); {provenance.describe(result['provenance'])}",
             result["ready_line"],
             f"decode graphs: {d['graphs']} in {d['s']:.2f} s"]
    if d["graphs"]:
        lines.append(f"  {d['compiling']} that compile the layers: {d['compiling_s']:.2f} s; the other "
                     f"{d['graphs'] - d['compiling']}: {d['other_s']:.2f} s")
    if result.get("graphs_idle"):
        i = result["graphs_idle"]
        lines.append(f"  after ready, while idle (--graphs lazy): {i['decode_graphs']} decode graphs and "
                     f"{i['piecewise_buckets']} piecewise buckets in {i['s']:.2f} s")
    lines.append(f"piecewise graphs: {s['piecewise_graphs']} in {s['piecewise_graphs_s']:.2f} s")
    triton = "not timed" if k["triton_compiles"] is None else f"{k['triton_compiles']} in {k['triton_compile_s']:.2f} s"
    lines.append(f"compile: {k['dynamo_frames_compiled']} dynamo frames, {k['dynamo_recompiles']} recompiles; "
                 f"Triton compiles in this process: {triton}")
    caches = result["caches_at_start"]
    lines.append(f"caches at start: Triton {caches['triton_files']} files, Inductor {caches['inductor_files']} files")
    t = result["targets"]["ready_within_20_s_of_load"]
    lines.append(f"target: {t['target']}: {'met' if t['met'] else 'MISSED'} ({t['measured']:.2f} s)")
    return "\n".join(lines)
