"""`pdserve-bench cpu`: the engine's decode on the CPU against transformers' `generate()`, side by side.

In one run, for each --threads (torch's thread count, the same for every arm) and each --batches:
--pairs rounds, each with its own prompts (random ids, seeded, fresh per round: nothing is served
from a prefix cache), decoded by every arm, the order shuffled per round (bench/ab.py), after one
untimed round:

    transformers   generate(ids [B, P], greedy, exactly --new-tokens new tokens, no EOS stop) on a
                   second module tree over the same weights (steps.hf_twin); a streamer stamps the
                   host clock each time a step's tokens arrive
    ours           the engine as the worker builds it (EngineConfig defaults for the device: chunked
                   prefill, prefix cache, the CPU's chunk budget; its KV pool --kv-memory-gb): B requests
                   (ignore_eos, --new-tokens), step() until done; each step's return stamped
    served         (--served) the same prompts through a `pdserve` server the bench starts per thread
                   count (the CPU default with --threads T, or --server-args on top: bench/engine/
                   cpu_served.py), sent at once as
                   token ids by the load generator's request; its time per token is the requests' mean
                   TPOT as `pdserve-bench load` reports it, (E2E - TTFT) / (tokens - 1), with every gap
                   between tokens (ITL) and TTFT beside it; its text is compared with
                   transformers' tokens detokenized

A round's time per token: (last token's stamp - first token's) / (new tokens - 1): decode only, the
prefill excluded, every per-token cost inside the loop included (theirs: logits processors, stopping
criteria; ours: scheduling, inputs, sampling, detokenizing, stop checks). Reported per arm (median,
min, max over rounds) and paired (ours / transformers round by round: median and spread). Both arms'
greedy tokens are compared (float32: they should agree). Beside them the floor at that thread count:
one copy of the bytes a decode step reads (the weights, plus the batch's KV at the mean context)
measured with a copy kernel (decode.copy_roofline). The machine may be shared: the 1-minute load
average is recorded with every round.

Target (item 5 of issue 33): ours <= transformers at batch 1, the median of the paired ratios; with
--served, served <= transformers there too (the load bench holding the same).
Writes JSON with provenance to bench/results/engine-cpu[-served]-<machine>-<date>-<commit>.json; prints
markdown.

    pdserve-bench cpu --threads 1,2 --batches 1,4 --pairs 8
    pdserve-bench cpu --threads 1 --batches 1,4 --pairs 8 --served
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench import ab, provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.engine import decode as dec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="smollm2-135m", help="model name or checkpoint dir (default smollm2-135m, the CPU default)")
    a("--threads", default="1", help="torch thread counts, each run by every arm (default 1)")
    a("--batches", default="1", help="requests decoded at once (default 1)")
    a("--prompt-tokens", type=int, default=128, help="prompt length of every request (default 128)")
    a("--new-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    a("--pairs", type=int, default=5, help="rounds per point, each arm once per round (default 5)")
    a("--seed", type=int, default=0, help="seeds prompts and round orders (default 0)")
    a("--kv-memory-gb", type=float, default=0.25, help="the engine's KV pool (default 0.25)")
    a("--served", action="store_true",
      help="also serve each round's prompts through a pdserve server the bench starts per thread count (TPOT, ITL)")
    a("--server-args", default="",
      help="--served: flags for that server, before the bench's --model and --threads (default none: the CPU "
           "default), e.g. '--prefill-workers 0 --decode-workers 0 --kv-memory-gb 0.25'")
    a("--out", default=None,
      help="JSON path (default bench/results/engine-cpu[-served]-<machine>-<date>-<commit>.json)")


def log(msg: str) -> None:
    print(f"[cpu-bench] {msg}", file=sys.stderr, flush=True)


class Stamps:
    """A generate() streamer that stamps the host clock at each put: the prompt first, then each step's tokens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def per_token_ms(stamps: list[float]) -> float:
    """(last - first) / (tokens - 1) over the stamps of each token (or batch of tokens) arriving."""
    if len(stamps) < 2:
        raise ValueError("per-token time needs at least two tokens")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


@torch.inference_mode()
def theirs(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    gen = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    # eos_token_id [] stops nowhere; None would fall back to the model's own (SmolLM2: <|im_end|>, <|endoftext|>):
    # generate() merges a config's unset fields with the model's, and pads a row that met one with pad_token_id
    gen.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=None, eos_token_id=[],
               pad_token_id=0, temperature=None, top_p=None, top_k=None)
    stamps = Stamps()
    ids = torch.tensor(prompts)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=stamps)
    generated = out[:, len(prompts[0]):].tolist()
    if any(len(g) != new_tokens for g in generated):
        raise RuntimeError(f"transformers generated {[len(g) for g in generated]} tokens, {new_tokens} asked")
    return per_token_ms(stamps.times[1:]), generated  # stamps[0]: the prompt


def ours(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    from pdserve.workers.engine.request import Request, SamplingParams

    reqs = [Request(f"{tag}-{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    stamps: list[float] = []
    while not all(r.finished for r in reqs):
        outs = engine.step()
        now = time.perf_counter()
        got = {o.request_id for o in outs}
        if got and got != {r.request_id for r in reqs}:  # equal prompts: every token of the batch at once
            raise RuntimeError(f"{tag}: a step returned tokens for {len(got)} of {len(reqs)} requests")
        if got:
            stamps.append(now)
    if len(stamps) != new_tokens or any(r.finish_reason != "length" for r in reqs):
        raise RuntimeError(f"{tag}: {len(stamps)} token steps, finish reasons {[r.finish_reason for r in reqs]}")
    return per_token_ms(stamps), [list(r.output_ids) for r in reqs]


def point(engine, twin, threads: int, batch: int, args, vocab: int, bytes_per_step: int, served=None,
          tokenizer=None) -> dict:
    torch.set_num_threads(threads)
    log(f"threads {threads}, batch {batch}: transformers generate() and the engine interleaved x {args.pairs}")
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 1009 * batch + threads)
    prompts: dict[int, list[list[int]]] = {}
    loads: dict[int, float] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {"transformers": {}, "ours": {}}
    records: dict[int, dict] = {}  # the served arm's requests, per round

    def round_prompts(i: int) -> list[list[int]]:  # fresh per round, shared by both arms
        if i not in prompts:
            prompts[i] = torch.randint(0, vocab, (batch, args.prompt_tokens), generator=gen).tolist()
            loads[i] = os.getloadavg()[0]
        return prompts[i]

    def arm(name: str):
        def run(i: int) -> float:
            p = round_prompts(i)
            tag = f"t{threads}-b{batch}-{i}"
            if name == "served":
                ms, records[i] = served.round(p, args.new_tokens, tag)
                return ms
            ms, toks = (theirs(twin, p, args.new_tokens) if name == "transformers"
                        else ours(engine, p, args.new_tokens, tag))
            tokens[name][i] = toks
            return ms
        return run

    arms = {name: arm(name) for name in ("transformers", "ours", "served") if name != "served" or served is not None}
    got = ab.interleave(arms, args.pairs, seed=args.seed + 31 * batch + threads, warmup=1)
    floor = dec.copy_roofline([bytes_per_step], torch.device("cpu"), warmup=1, repeats=5)[bytes_per_step]
    paired = ab.paired(got.results["transformers"], got.results["ours"])
    rounds = range(args.pairs)
    row = {
        "threads": threads, "batch": batch,
        "transformers_ms_per_token": ab.summary(got.results["transformers"]),
        "ours_ms_per_token": ab.summary(got.results["ours"]),
        "paired": paired, "ratio": paired["ratio"]["median"], "orders": got.orders,
        "floor_ms": floor, "floor_bytes": bytes_per_step,
        "tokens_agree": [tokens["transformers"][i] == tokens["ours"][i] for i in rounds],
        "loadavg_1m": [loads[i] for i in rounds],
    }
    if served is not None:
        from pdserve.bench.engine.cpu_served import expected_text

        served_paired = ab.paired(got.results["transformers"], got.results["served"])
        row.update({
            "served_ms_per_token": ab.summary(got.results["served"]), "served_paired": served_paired,
            "served_ratio": served_paired["ratio"]["median"],
            "served_itl_ms": ab.spread([x for i in rounds for x in records[i]["itl_ms"]]),
            "served_ttft_ms": ab.spread([x for i in rounds for x in records[i]["ttft_ms"]]),
            "served_workers": sorted({w for i in rounds for w in records[i]["workers"]}),
            # the served text against transformers' greedy tokens detokenized (float32: they should agree)
            "served_text_agrees": [records[i]["texts"] == [expected_text(tokenizer, t)
                                                           for t in tokens["transformers"][i]] for i in rounds],
        })
    return row


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.engine.steps import hf_twin, kv_bytes_per_token
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.engine.models import load_model

    threads, batches = parse_counts(args.threads), parse_counts(args.batches)
    if args.pairs < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        raise ValueError("--pairs must be >= 1, --new-tokens >= 2 and --prompt-tokens >= 1")
    if args.server_args and not args.served:
        raise ValueError("--server-args sets the served arm's server: give --served too")
    prov = provenance.collect(["cpu"])
    t_start = time.monotonic()
    load_start = os.getloadavg()
    log(f"loading {args.model} on the CPU (load average {load_start[0]:.2f})")
    loaded = load_model(args.model, None, "cpu")
    twin = hf_twin(loaded.model)  # before the engine re-routes the original's attention
    engine = Engine(EngineConfig(model=loaded.name, device="cpu", kv_memory_gb=args.kv_memory_gb), loaded=loaded)
    model = loaded.model
    dtype = next(model.parameters()).dtype
    weights = dec.weight_bytes(model)
    bpt = kv_bytes_per_token(model, dtype)
    context = args.prompt_tokens + args.new_tokens // 2
    rows, servers = [], {}
    for t in threads:
        served = None
        if args.served:
            from pdserve.bench.engine.cpu_served import Served

            log(f"starting pdserve with {t} torch threads a worker for the served arm")
            served = Served(args.model, t, Path(tempfile.mkdtemp(prefix="pdserve-cpu-bench-")),
                            shlex.split(args.server_args))
            servers[t] = {"command": served.command, "ready": served.ready, "log": str(served.log)}
        try:
            rows += [point(engine, twin, t, b, args, model.config.vocab_size,
                           weights["read_per_step"] + b * context * bpt, served, loaded.tokenizer) for b in batches]
        finally:
            if served is not None:
                served.close()
    for r in rows:
        r["ours_over_floor"] = r["ours_ms_per_token"]["median"] / r["floor_ms"]["median"]
        r["transformers_over_floor"] = r["transformers_ms_per_token"]["median"] / r["floor_ms"]["median"]
    b1 = [r for r in rows if r["batch"] == 1]
    target = {"target": "ours <= transformers generate() per token at batch 1 (median of paired ratios)"
                        + (", and served (TPOT) too" if args.served else ""),
              "measured": {r["threads"]: r["ratio"] for r in b1} or None}
    if args.served:
        target["served_measured"] = {r["threads"]: r["served_ratio"] for r in b1} or None
    target["met"] = all(r["ratio"] <= 1.0 and r.get("served_ratio", 0) <= 1.0 for r in b1) if b1 else None
    result = {
        "benchmark": "engine-cpu",
        "provenance": provenance.finish(prov),
        "config": {"model": loaded.name, "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                   "batches": batches, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                   "pairs": args.pairs, "seed": args.seed, "kv_memory_gb": args.kv_memory_gb,
                   "weight_bytes": weights, "kv_bytes_per_token": bpt,
                   "engine": {k: getattr(engine.config, k) for k in ("chunked_prefill", "prefix_cache", "block_size",
                                                                      "max_num_seqs")}
                   | {"chunk_tokens": engine.config.step_chunk_tokens, "overlap": engine.overlap},
                   "served": servers or None,
                   "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                   "run_s": round(time.monotonic() - t_start, 1),
                   "clock": "host perf_counter; a round's ms per token is (last token - first token) / "
                            "(new tokens - 1), the prefill excluded"},
        "points": rows,
        "target": target,
    }
    commit = (prov.get("commit") or "unknown")[:7]
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / (
        f"engine-cpu{'-served' if args.served else ''}-{provenance.machine_slug(torch.device('cpu'))}-"
        f"{datetime.date.today().isoformat()}-{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out} after {result['config']['run_s']} s")
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    served = bool(result["config"].get("served"))
    head = "| threads | batch | transformers ms/token | ours ms/token | ours / transformers (paired) "
    if served:
        head += "| served TPOT ms | served / transformers (paired) | served ITL p50 (max) ms "
    lines = [f"engine decode on the CPU vs transformers generate(): {provenance.describe(result['provenance'])}", "",
             head + "| floor ms | tokens agree | load avg |", "|---:" * (8 if served else 5) + "|---:|---|---|"]

    def spread(s: dict, digits: int) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    for r in result["points"]:
        cells = [r["threads"], r["batch"], spread(r["transformers_ms_per_token"], 1), spread(r["ours_ms_per_token"], 1),
                 spread(r["paired"]["ratio"], 3)]
        if served:
            cells += [spread(r["served_ms_per_token"], 1), spread(r["served_paired"]["ratio"], 3),
                      f"{r['served_itl_ms']['median']:.1f} ({r['served_itl_ms']['max']:.1f})"]
        agree = f"{sum(r['tokens_agree'])}/{len(r['tokens_agree'])}"
        if served:
            agree += f", served text {sum(r['served_text_agrees'])}/{len(r['served_text_agrees'])}"
        cells += [f"{r['floor_ms']['median']:.1f}", agree, f"{min(r['loadavg_1m']):.1f}-{max(r['loadavg_1m']):.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    t = result["target"]
    measured = f"measured {t['measured']}" + (f", served {t['served_measured']}" if served else "")
    lines += ["", f"target: {t['target']}: {measured}, met {t['met']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pdserve-bench cpu", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
