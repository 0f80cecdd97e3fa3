"""`pdserve-bench load`: latency under load, colocated vs disaggregated, against any OpenAI-compatible server.

    pdserve-bench load --policies colocated,disaggregated --request-rates 1,2,4 \\
        --input-len uniform:128:1024 --long-fraction 0.25 --long-input-len uniform:8192:16384 \\
        --output-len 128 --num-prompts 100 --goodput ttft:2000 tpot:50

Open loop (--request-rate / --request-rates: Poisson, or gamma with --burstiness) or closed loop
(--concurrency N[,M...]). With several policies, request i goes with policy i mod n through one shared
schedule, and each prompt length is sent once per policy (--num-prompts is per policy), so the
policies meet the same machine state and the same lengths. The offered rate is the total.

Writes results.json (vllm-bench-serve field names; one block per policy and load point), summary.md
and PNG plots into --out (default bench/results/load-<date>/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("synthetic", "sharegpt", "mooncake")


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # "rate" | "concurrency" | "trace"
    value: float | None

    @property
    def label(self) -> str:
        if self.kind == "rate":
            return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        return f"trace x{self.value:g}"

    @property
    def axis(self) -> str:
        return {"rate": "offered request rate (req/s, all policies)", "concurrency": "requests in flight",
                "trace": "trace speedup"}[self.kind]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    t.add_argument("--policies", type=_names, default=None,
                   help="comma-separated pdserve policies to interleave, e.g. colocated,disaggregated "
                        "(default: send no policy field)")
    t.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="synthetic")
    w.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake JSONL file")
    w.add_argument("--num-prompts", type=int, default=100,
                   help="distinct prompts per load point; each goes once per policy (trace: first N lines)")
    w.add_argument("--input-len", default="1024", help="N, fixed:N, uniform:LO:HI or normal:MEAN:STD tokens")
    w.add_argument("--output-len", default="128", help="as --input-len; max_tokens of each request")
    w.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of prompts drawn from --long-input-len instead (a long/short mix)")
    w.add_argument("--long-input-len", default="uniform:8192:16384")
    w.add_argument("--sharegpt-output-len", type=int, default=None, help="override the reply lengths")
    w.add_argument("--max-model-len", type=int, default=None, help="ShareGPT: skip prompt+output longer than this")
    w.add_argument("--trace-block-size", type=int, default=512, help="Mooncake: tokens per hash id")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="Mooncake: replay this many times faster")
    w.add_argument("--no-pair", action="store_true",
                   help="do not send each prompt once per policy; request i still gets policy i mod n")
    w.add_argument("--tokenizer", default=None,
                   help="count tokens exactly with this tokenizer (a pdserve model name or a local HF dir); "
                        "default: one token per generated word, ~4 characters per token for dataset text")
    w.add_argument("--seed", type=int, default=0)

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=None, help="requests/s, all policies together (inf: all at once)")
    lo.add_argument("--request-rates", type=_floats, default=None, help="a sweep, e.g. 1,2,4")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    lo.add_argument("--concurrency", type=_floats, default=None, help="closed loop: requests in flight (a list sweeps)")
    lo.add_argument("--num-warmups", type=int, default=1, help="unrecorded requests per policy before measuring")

    r = p.add_argument_group("requests and results")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (output lengths vary)")
    r.add_argument("--stream-usage", action="store_true", help="send stream_options.include_usage")
    r.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    r.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:50 (metrics: ttft, tpot, e2el)")
    r.add_argument("--percentiles", type=_floats, default=[50.0, 90.0, 99.0])
    r.add_argument("--out", default=None, help="output folder (default bench/results/load-<date>/)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def load_points(args) -> list[LoadPoint]:
    if args.dataset == "mooncake":
        if args.request_rate is not None or args.request_rates or args.concurrency:
            raise ValueError("a Mooncake trace is replayed at its own timestamps: leave out --request-rate(s) and "
                             "--concurrency (use --trace-speedup to replay it faster)")
        return [LoadPoint("trace", args.trace_speedup)]
    if args.concurrency and (args.request_rate is not None or args.request_rates):
        raise ValueError("choose open loop (--request-rate/--request-rates) or closed loop (--concurrency), not both")
    if args.concurrency:
        if any(c < 1 or not float(c).is_integer() for c in args.concurrency):
            raise ValueError(f"--concurrency takes whole numbers >= 1, got {args.concurrency}")
        return [LoadPoint("concurrency", c) for c in args.concurrency]
    rates = args.request_rates or [args.request_rate if args.request_rate is not None else math.inf]
    if any(r <= 0 for r in rates):
        raise ValueError(f"request rates must be > 0, got {rates}")
    return [LoadPoint("rate", r) for r in rates]


def make_samples(args, builder, copies: int, text_seed: int):
    from bench.workload import LengthDist, mooncake_samples, sharegpt_samples, synthetic_samples
    if args.dataset == "synthetic":
        return synthetic_samples(args.num_prompts, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len),
                                 builder, seed=args.seed, text_seed=text_seed, long_fraction=args.long_fraction,
                                 long_input_len=LengthDist.parse(args.long_input_len), copies=copies)
    if args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "sharegpt":
        return sharegpt_samples(args.dataset_path, args.num_prompts, builder, seed=args.seed,
                                output_len=args.sharegpt_output_len, max_len=args.max_model_len, copies=copies)
    return mooncake_samples(args.dataset_path, builder, n=args.num_prompts, block_size=args.trace_block_size,
                            speedup=args.trace_speedup, seed=text_seed)


def workload_text(args) -> str:
    if args.dataset == "synthetic":
        text = f"synthetic, input {args.input_len}, output {args.output_len}"
        if args.long_fraction > 0:
            text += f", {args.long_fraction:.0%} long with input {args.long_input_len}"
    else:
        text = f"{args.dataset} {args.dataset_path}"
    text += f", {args.num_prompts} prompts per point" + ("" if args.no_pair else " per policy")
    text += ", ignore_eos" if not args.no_ignore_eos else ""
    return text + f", tokens {'by ' + args.tokenizer if args.tokenizer else 'approximated'}"


def plan(samples, policies, point: LoadPoint, args, point_index: int):
    from bench.load_runner import Planned
    from bench.workload import arrival_times, assign_policies
    assigned = assign_policies(len(samples), policies)
    if point.kind == "rate":
        times = arrival_times(len(samples), point.value, args.burstiness, seed=args.seed + point_index)
    elif point.kind == "trace":
        times = [s.arrival_s for s in samples]
    else:
        times = [None] * len(samples)
    return [Planned(i, s, pol, None if t is None else float(t)) for i, (s, pol, t) in
            enumerate(zip(samples, assigned, times))]


def result_blocks(records, duration: float, point: LoadPoint, args, slos, percentiles) -> list[dict]:
    from bench.metrics import summarize
    policies = args.policies or [None]
    blocks = []
    for policy in policies:
        mine = [r for r in records if r.policy == policy]
        rate = point.value if point.kind == "rate" else None
        block = {
            "policy": policy,
            "load_kind": point.axis,
            "load_label": point.label,
            "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
            "policy_request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate / len(policies)),
            "burstiness": args.burstiness if point.kind == "rate" else None,
            "max_concurrency": int(point.value) if point.kind == "concurrency" else None,
            "trace_speedup": point.value if point.kind == "trace" else None,
        }
        block.update(summarize(mine, duration, slos, percentiles))
        blocks.append(block)
    return blocks


async def _run_async(args, builder, points, slos, percentiles) -> tuple[str, list[dict]]:
    from tqdm import tqdm

    from bench.load_runner import SendOptions, run_closed_loop, run_open_loop, warmup
    from client import AsyncClient

    policies = args.policies
    copies = len(policies) if policies and not args.no_pair and args.dataset != "mooncake" else 1
    opts = SendOptions(ignore_eos=not args.no_ignore_eos, stream_usage=args.stream_usage, extra_body=args.extra_body)
    blocks: list[dict] = []
    async with AsyncClient(args.base_url, model=args.model, timeout_s=args.request_timeout) as client:
        model = await client.resolve_model()
        for k, point in enumerate(points):
            samples = make_samples(args, builder, copies, text_seed=args.seed + 1000 * (k + 1))
            if k == 0 and args.num_warmups > 0:
                firsts = samples[::copies][: args.num_warmups]
                print(f"warmup: {len(firsts)} request(s) per policy", file=sys.stderr)
                await warmup(client, firsts, policies or [None], opts)
            planned = plan(samples, policies, point, args, k)
            bar = tqdm(total=len(planned), desc=point.label, disable=args.no_progress, file=sys.stderr)
            try:
                if point.kind == "concurrency":
                    records, duration = await run_closed_loop(client, planned, int(point.value), opts,
                                                              lambda r: bar.update())
                else:
                    records, duration = await run_open_loop(client, planned, opts, lambda r: bar.update())
            finally:
                bar.close()
            blocks += result_blocks(records, duration, point, args, slos, percentiles)
    return model, blocks


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _command_line() -> str:
    prog = Path(sys.argv[0])
    head = ["python", "-m", "bench.load"] if prog.name == "load.py" else [prog.name]
    return shlex.join(head + sys.argv[1:])


def run(args) -> int:
    from bench.load_report import environment, markdown, write_json
    from bench.metrics import parse_slos
    from bench.workload import LengthDist, PromptBuilder, WorkloadError, load_tokenizer

    try:
        points = load_points(args)
        slos = parse_slos(args.goodput)
        for spec in (args.input_len, args.output_len, args.long_input_len):
            LengthDist.parse(spec)
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        builder = PromptBuilder(load_tokenizer(args.tokenizer) if args.tokenizer else None)
    except ValueError as e:  # WorkloadError included
        print(f"pdserve-bench load: {e}", file=sys.stderr)
        return 2
    percentiles = sorted(set(args.percentiles) | {50.0, 99.0})
    env = environment()
    out = Path(args.out) if args.out else Path("bench") / "results" / f"load-{env['date']}"

    from bench.load_runner import WarmupFailed
    from client import ClientError
    try:
        model, blocks = asyncio.run(_run_async(args, builder, points, slos, percentiles))
    except (ClientError, WarmupFailed, WorkloadError) as e:
        print(f"pdserve-bench load: {e}", file=sys.stderr)
        return 1
    run_record = {
        "date": env["date"],
        "environment": env,
        "command": _command_line(),
        "base_url": args.base_url,
        "model": model,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "policies": args.policies,
        "workload": workload_text(args),
        "slos_ms": slos,
        "percentiles": percentiles,
        "args": {k: _jsonable(v) for k, v in vars(args).items() if not k.startswith("_")},
        "results": blocks,
    }
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        from bench.plots import plot_all
        run_record["plots"] = [p.name for p in plot_all(blocks, out)]
    write_json(out / "results.json", run_record)
    summary = markdown(run_record, percentiles)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"results in {out}/", file=sys.stderr)
    return 0 if all(b["completed"] > 0 for b in blocks) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.load ...`, the same as `pdserve-bench load ...`."""
    parser = argparse.ArgumentParser(prog="pdserve-bench load", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
