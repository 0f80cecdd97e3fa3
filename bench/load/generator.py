"""`pdserve-bench load`: latency under load, colocated vs disaggregated, against any OpenAI-compatible server.

    pdserve-bench load --policies colocated,disaggregated --capacity-search --goodput ttft:2000 tpot:100 \\
        --input-len uniform:256:1024 --long-fraction 0.25 --long-input-len uniform:4096:8192 --output-len 64
    pdserve-bench load --arm 'colocated=colocated:--prefill-workers 0 --decode-workers 0' \\
        --arm 'disaggregated=disaggregated:--no-colocated' --server-args '--model qwen2.5-7b --devices cuda:0' ...

Each arm (a policy, or an --arm with its own fresh server) runs alone: its own runs, on the same
seeded prompt lengths and the same seeded arrival schedule (at any rate, the same gaps scaled by
1/rate), and its throughput from its own run's duration; the prompts' words are new per run and per
invocation (a nonce, recorded) unless --text-seed or --reuse-prompts says otherwise. --arm starts each
arm's server in turn (`pdserve` by default), so arms get the same devices one after the other. Arms sharing one server
(--policies) alternate per load point (ABBA...). --policy-runs interleaved is the old shared run:
request i goes with policy i mod n through one schedule, the offered rate is the total, and the
policies time-share the server (labelled as such everywhere).

--capacity-search finds each arm's capacity: the highest Poisson rate at which >= --goodput-target
(0.9) of the requests meet the --goodput SLOs (DistServe's goodput) and the queue does not grow,
doubling then bisecting within --search-max-probes, then sweeps capacity x --sweep-factors. Each of
those runs sends --probe-seconds (60) of arrivals or --probe-min-requests, whichever is more, so a
queue has time to build; a probe that would not end within --arm-budget does not start. Every open-loop run is judged for
saturation (bench/load/capacity.py). Before an arm's first run, warm-up batches go until two in a row
agree on median TTFT (--warmup-tolerance, at most --warmup-max-batches). A run that still carries
start-up effects (the arm's first after an unsteady warm-up, or a first quarter much slower than the
rest) is flagged cold, with its reason, and reported all the same (bench/load/capacity.py).

Writes results.json (vllm-bench-serve field names; one block per arm and run), summary.md, PNG plots
and each started server's log into --out (default bench/results/load-<date>/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from pathlib import Path

from pdserve.bench.load.capacity import PROBE_JUDGES
from pdserve.bench.load.arms import CACHE_MODES, Arm, ArmError, with_cache_modes
from pdserve.bench.load.vllm_compat import CHAT, COMPLETIONS, add_refused, dataset_name, resolve
from pdserve.bench.load.session import LoadPoint, Session, run_interleaved, run_separate

DATASETS = ("synthetic", "sharegpt", "mooncake", "multiturn")
POLICY_RUNS = ("separate", "interleaved")
POLICY_RUNS_NOTE = {
    "separate": "each arm in its own runs (same seeded lengths and arrival schedule); throughput from its own duration",
    "interleaved": "policies interleaved in one shared run (request i gets policy i mod n; they time-share the "
                   "server); offered rate is the total; throughput over each policy's own requests' span",
}


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="the server (default http://127.0.0.1:8000, or --host/--port)")
    t.add_argument("--host", default=None, help="vLLM's spelling: --base-url http://HOST:PORT")
    t.add_argument("--port", type=int, default=None)
    t.add_argument("--endpoint", default=None,
                   help=f"{COMPLETIONS} (default) or {CHAT} (the default for --dataset multiturn); a prompt goes to "
                        "chat as one user message")
    t.add_argument("--backend", default=None, help="vLLM's spelling: openai (completions) or openai-chat (chat)")
    t.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' with every request (default: $OPENAI_API_KEY)")
    t.add_argument("--header", nargs="*", action="extend", default=None, metavar="KEY=VALUE",
                   help="headers for every request (an Authorization here wins over --api-key)")
    t.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    t.add_argument("--policies", type=_names, default=None,
                   help="comma-separated pdserve policies, each an arm on the --base-url server, e.g. "
                        "colocated,disaggregated (default: send no policy field)")
    t.add_argument("--policy-runs", choices=POLICY_RUNS, default="separate",
                   help="separate: each policy in its own runs (default); interleaved: one shared run, "
                        "request i with policy i mod n")
    t.add_argument("--arm", action="append", default=None, metavar="LABEL=POLICY:FLAGS",
                   help="an arm with its own fresh server, started with --server-command --server-args FLAGS "
                        "(repeat; arms run one after another); worker flags go as --worker-arg=FLAG")
    t.add_argument("--cache-arms", type=_names, default=None, metavar="MODE,...",
                   help=f"each --arm once per KV cache mode ({', '.join(CACHE_MODES)}), labelled ARM:MODE, the "
                        "worker flags added for it (bench/load/arms.py)")
    t.add_argument("--cache-host-gb", type=float, default=None, help="--cache-arms: host tier size of the +host modes")
    t.add_argument("--cache-disk-dir", default=None, help="--cache-arms: disk tier folder of the +disk mode")
    t.add_argument("--cache-disk-gb", type=float, default=None, help="--cache-arms: disk tier size of the +disk mode")
    t.add_argument("--server-args", default="", help="flags for every arm's server, e.g. '--model qwen2.5-7b'")
    t.add_argument("--server-command", default=None,
                   help="what starts an arm's server (default: this python -m pdserve.server.cli --port 0 --parent-pid PID)")
    t.add_argument("--server-timeout", type=float, default=900.0, help="seconds for an arm's server to be ready")
    t.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", "--dataset-name", type=dataset_name, default="synthetic",
                   help=f"{', '.join(DATASETS)} (vLLM's 'random' is synthetic)")
    w.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake JSONL file")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per run (default 100; interleaved: per policy; trace: first N lines)")
    w.add_argument("--input-len", default=None,
                   help="N, fixed:N, uniform:LO:HI or normal:MEAN:STD tokens (default 1024; multiturn: the first "
                        "message)")
    w.add_argument("--output-len", default=None, help="as --input-len (default 128); max_tokens of each request")
    w.add_argument("--random-input-len", type=int, default=None, help="vLLM's spelling of --input-len N")
    w.add_argument("--random-output-len", type=int, default=None, help="vLLM's spelling of --output-len N")
    w.add_argument("--random-range-ratio", type=float, default=None,
                   help="with --random-*-len N: lengths uniform over [N (1 - R), N (1 + R)], as vLLM")
    w.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of prompts drawn from --long-input-len instead (exactly round(n x share) of them)")
    w.add_argument("--long-input-len", default="uniform:8192:16384")
    w.add_argument("--sharegpt-output-len", type=int, default=None, help="override the reply lengths")
    w.add_argument("--max-model-len", type=int, default=None, help="ShareGPT: skip prompt+output longer than this")
    w.add_argument("--trace-block-size", type=int, default=512, help="Mooncake: tokens per hash id")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="Mooncake: replay this many times faster")
    w.add_argument("--no-pair", action="store_true",
                   help="interleaved: do not send each prompt once per policy; request i still gets policy i mod n")
    w.add_argument("--tokenizer", default=None,
                   help="count tokens exactly with this tokenizer (a pdserve model name or a local HF dir); "
                        "default: one token per generated word, ~4 characters per token for dataset text")
    w.add_argument("--seed", type=int, default=0, help="prompt lengths and arrival times")
    w.add_argument("--text-seed", type=int, default=None,
                   help="the prompts' words (default: a fresh nonce per invocation, in results.json, so a second "
                        "invocation against the same server does not meet its prefix cache)")
    w.add_argument("--reuse-prompts", action="store_true",
                   help="every run sends the same words (from --text-seed, else --seed): a warm prefix cache on "
                        "purpose; the report gives the cached share either way")

    m = p.add_argument_group("multi-turn (--dataset multiturn, bench/load/multiturn.py)")
    m.add_argument("--conversations", type=int, default=8, help="conversations per run")
    m.add_argument("--turns", type=int, default=3, help="turns per conversation")
    m.add_argument("--new-message-len", default="128", help="each later turn's new user message, as --input-len")
    m.add_argument("--think-time", type=float, default=0.0, help="seconds from a reply to the next turn")

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=None, help="requests/s (inf: all at once)")
    lo.add_argument("--request-rates", type=_floats, default=None, help="a sweep, e.g. 1,2,4")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    lo.add_argument("--concurrency", type=_floats, default=None,
                    help="closed loop: requests in flight (a list sweeps; multiturn: conversations in flight)")
    lo.add_argument("--max-concurrency", type=int, default=None,
                    help="open loop: at most this many requests in flight, later sends wait (as vLLM)")
    lo.add_argument("--run-seconds", type=float, default=0.0,
                    help="a given rate point sends at least this many seconds of arrivals (rate x seconds "
                         "requests, and at least --num-prompts); 0: --num-prompts alone")
    lo.add_argument("--capacity-search", action="store_true",
                    help="find each arm's capacity under --goodput, then sweep around it (instead of given rates)")
    lo.add_argument("--search-start-rate", type=float, default=1.0, help="req/s of the first probe")
    lo.add_argument("--search-max-probes", type=int, default=8)
    lo.add_argument("--search-precision", type=float, default=0.1,
                    help="stop when first failing rate / best passing rate - 1 is at most this")
    lo.add_argument("--goodput-target", type=float, default=0.9, help="share of requests that must meet the SLOs")
    lo.add_argument("--probe-seconds", type=float, default=60.0,
                    help="a capacity-search run (probe or sweep) sends at least this many seconds of arrivals "
                         "(rate x seconds requests), so a queue can build and the probe can fail")
    lo.add_argument("--probe-min-requests", type=int, default=None,
                    help="and at least this many requests (default --num-prompts)")
    lo.add_argument("--probe-judge", choices=PROBE_JUDGES, default=PROBE_JUDGES[0],
                    help="a probe passes when >= --goodput-target met the SLOs and (goodput+queue, the default) its "
                         "queue did not grow over the window (lateness slope, bench/load/capacity.py)")
    lo.add_argument("--no-probe-early-stop", dest="probe_early_stop", action="store_false",
                    help="run every capacity probe whole (default: a probe stops once so many of its requests "
                         "missed an SLO that it cannot pass, and the server is left to go idle: "
                         "bench/load/early_stop.py)")
    lo.add_argument("--sweep-factors", type=_floats, default=[0.5, 1.0, 1.5], help="sweep rates = capacity x these")
    lo.add_argument("--arm-budget", type=float, default=math.inf,
                    help="seconds of search and sweep per arm; no further run starts past it (default: no limit)")

    wu = p.add_argument_group("warm-up (per arm, before its first run)")
    wu.add_argument("--warmup-batch", type=int, default=4,
                    help="requests per warm-up batch, sent at once, lengths spanning the workload's (0: no warm-up)")
    wu.add_argument("--warmup-max-batches", type=int, default=6)
    wu.add_argument("--warmup-tolerance", type=float, default=0.1,
                    help="steady when two batches' median TTFTs differ by at most this share")

    r = p.add_argument_group("requests and results")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (output lengths vary)")
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (the default; vLLM's spelling)")
    r.add_argument("--stream-usage", action="store_true", help="send stream_options.include_usage")
    r.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    r.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput and the verdict, e.g. ttft:2000 tpot:50 (metrics: ttft, tpot, itl: a "
                        "request's longest gap, e2el); without it the verdict assumes ttft:2000 tpot:100 itl:500")
    r.add_argument("--percentiles", "--metric-percentiles", type=_floats, default=[50.0, 90.0, 99.0],
                   help="percentiles reported (50 and 99 always are)")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="--save-result: the metrics whose statistics its files carry (of ttft,tpot,itl,e2el)")
    r.add_argument("--out", default=None, help="output folder (default bench/results/load-<date>/)")
    r.add_argument("--save-result", action="store_true",
                   help="also one vLLM-shaped flat JSON per arm and load point (vllm bench serve's keys)")
    r.add_argument("--result-dir", default=None, help="--save-result's folder (default --out)")
    r.add_argument("--result-filename", default=None,
                   help="--save-result's file name (several blocks: numbered after it)")
    r.add_argument("--label", default=None, help="--save-result: the label its file names start with (default: "
                                                 "the backend)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no tqdm progress bar")
    add_refused(p)


def load_points(args) -> list[LoadPoint]:
    """The given points; with --capacity-search none (the search picks the rates)."""
    if args.dataset == "multiturn":
        if args.capacity_search or args.policy_runs == "interleaved":
            raise ValueError("a multi-turn run takes given points only: --concurrency N (conversations in flight) "
                             "or --request-rate R (conversations started per second), each arm in its own runs "
                             "(no --capacity-search, no --policy-runs interleaved)")
        if args.concurrency and (args.request_rate is not None or args.request_rates):
            raise ValueError("choose --request-rate(s) (conversations per second) or --concurrency (conversations "
                             "in flight), not both")
        if args.turns < 1 or args.conversations < 1 or args.think_time < 0:
            raise ValueError("need --conversations >= 1, --turns >= 1 and --think-time >= 0")
        if args.concurrency:
            return [LoadPoint("concurrency", c, conversations=True) for c in args.concurrency]
        rates = args.request_rates or [args.request_rate if args.request_rate is not None else math.inf]
        return [LoadPoint("rate", r, conversations=True) for r in rates]
    if args.capacity_search:
        if args.dataset == "mooncake" or args.request_rate is not None or args.request_rates or args.concurrency:
            raise ValueError("--capacity-search picks its own Poisson rates: leave out --request-rate(s) and "
                             "--concurrency (and Mooncake traces, which keep their timestamps)")
        if not args.goodput:
            raise ValueError("--capacity-search needs the SLOs it searches under: --goodput ttft:MS tpot:MS")
        if args.policy_runs == "interleaved":
            raise ValueError("--capacity-search runs each arm alone; it cannot be combined with --policy-runs "
                             "interleaved")
        if not 0 < args.goodput_target <= 1 or args.search_start_rate <= 0 or args.search_precision <= 0:
            raise ValueError("need 0 < --goodput-target <= 1, --search-start-rate > 0, --search-precision > 0")
        if args.probe_seconds < 0 or (args.probe_min_requests is not None and args.probe_min_requests < 1):
            raise ValueError("need --probe-seconds >= 0 and --probe-min-requests >= 1")
        return []
    if args.dataset == "mooncake":
        if args.request_rate is not None or args.request_rates or args.concurrency:
            raise ValueError("a Mooncake trace is replayed at its own timestamps: leave out --request-rate(s) and "
                             "--concurrency (use --trace-speedup to replay it faster)")
        return [LoadPoint("trace", args.trace_speedup)]
    if args.run_seconds < 0:
        raise ValueError(f"--run-seconds must be >= 0, got {args.run_seconds}")
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


def arms_of(args):
    """The arms, in run order: --arm specs, else one per --policies entry on the --base-url server."""
    if args.arm:
        if args.policies:
            raise ValueError("give the arms by --arm (each its own server) or by --policies (one server), not both")
        if args.policy_runs == "interleaved":
            raise ValueError("--arm starts one server per arm, one after another: it needs --policy-runs separate")
        arms = [Arm.parse(spec) for spec in args.arm]
    else:
        arms = [Arm(p or "default", p) for p in (args.policies or [None])]
    if args.cache_arms:
        arms = with_cache_modes(arms, args.cache_arms, host_gb=args.cache_host_gb, disk_dir=args.cache_disk_dir,
                                disk_gb=args.cache_disk_gb)
    elif args.cache_host_gb is not None or args.cache_disk_dir is not None or args.cache_disk_gb is not None:
        raise ValueError("--cache-host-gb / --cache-disk-dir / --cache-disk-gb size the modes of --cache-arms: "
                         "add --cache-arms (or give the worker flags in each --arm)")
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"arm labels must differ, got {labels}")
    return arms


def workload_text(args) -> str:
    from pdserve.bench.load.workload import long_count
    if args.dataset == "multiturn":
        think = f", {args.think_time:g} s think time" if args.think_time else ""
        return (f"multiturn: {args.conversations} conversations x {args.turns} turns, first message {args.input_len}, "
                f"each later message {args.new_message_len}, replies {args.output_len}{think}, each turn's prompt "
                f"the previous one + the reply returned + the new message, over {args.endpoint}"
                + (", ignore_eos" if not args.no_ignore_eos else "")
                + f", tokens {'by ' + args.tokenizer if args.tokenizer else 'approximated'}")
    if args.dataset == "synthetic":
        text = f"synthetic, input {args.input_len}, output {args.output_len}"
        if args.long_fraction > 0:
            k = long_count(args.num_prompts, args.long_fraction)
            text += f", {k} of {args.num_prompts} prompts long ({k / args.num_prompts:.0%}) with input {args.long_input_len}"
    else:
        text = f"{args.dataset} {args.dataset_path}"
    interleaved = args.policy_runs == "interleaved"
    text += f" over {args.endpoint}"
    if args.capacity_search:
        text += (f", each search run >= {args.probe_seconds:g} s of arrivals and >= "
                 f"{args.probe_min_requests or args.num_prompts} prompts")
    else:
        text += f", {args.num_prompts} prompts per run" + (" per policy" if interleaved and not args.no_pair else "")
        if args.run_seconds:
            text += f", each rate point >= {args.run_seconds:g} s of arrivals"
    text += f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    text += ", ignore_eos" if not args.no_ignore_eos else ""
    return text + f", tokens {'by ' + args.tokenizer if args.tokenizer else 'approximated'}"


SECRET_ARGS = ("api_key", "header", "headers")  # never written down; of the headers only the names are


def _recorded_args(args) -> dict:
    out = {k: _jsonable(v) for k, v in vars(args).items() if not k.startswith("_") and k not in SECRET_ARGS}
    out["api_key"] = "(set)" if args.api_key else None
    out["header_names"] = sorted(getattr(args, "headers", None) or {}) or None
    return out


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _command_line() -> str:
    prog = Path(sys.argv[0])
    modules = {"generator.py": "pdserve.bench.load.generator", "cli.py": "pdserve.bench.cli"}
    head = ["python", "-m", modules[prog.name]] if prog.name in modules else [prog.name]
    return shlex.join(head + redacted(sys.argv[1:]))


def redacted(argv: list[str]) -> list[str]:
    """The command line without the API key's value, nor a header's (it may carry a token)."""
    out, hide_next = [], False
    for a in argv:
        if hide_next and not a.startswith("--"):
            out.append(a.partition("=")[0] + "=(not recorded)" if "=" in a else "(not recorded)")
            hide_next = not out[-1].startswith("(")  # --header takes several KEY=VALUE words
            continue
        hide_next = a in ("--api-key", "--header")
        flag, eq, _ = a.partition("=")
        out.append(f"{flag}=(not recorded)" if eq and flag in ("--api-key", "--header") else a)
    return out


def run(args) -> int:
    from pdserve.bench.load.report import environment, markdown, write_json
    from pdserve.bench.load.metrics import parse_slos
    from pdserve.bench.load.verdict import judge
    from pdserve.bench.load.workload import (LengthDist, PromptBuilder, WorkloadError, load_tokenizer, long_count,
                                             prompt_text)

    try:
        resolve(args)
        points = load_points(args)
        arms = arms_of(args)
        slos = parse_slos(args.goodput)
        for spec in (args.input_len, args.output_len, args.long_input_len, args.new_message_len):
            LengthDist.parse(spec)
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        builder = PromptBuilder(load_tokenizer(args.tokenizer) if args.tokenizer else None)
        text = prompt_text(args.seed, args.text_seed, args.reuse_prompts)
        args.text_seed = text["text_seed"]
    except ValueError as e:  # WorkloadError included
        print(f"pdserve-bench load: {e}", file=sys.stderr)
        return 2
    percentiles = sorted(set(args.percentiles) | {50.0, 99.0})
    env = environment()
    out = Path(args.out) if args.out else Path("bench") / "results" / f"load-{env['date']}"
    out.mkdir(parents=True, exist_ok=True)
    session = Session(args, builder, slos, percentiles, out)
    runner = run_interleaved if args.policy_runs == "interleaved" else run_separate

    from pdserve.bench.load.runner import WarmupFailed
    from pdserve.client import ClientError
    try:
        arm_infos, blocks = asyncio.run(runner(session, arms, points))
    except (ClientError, WarmupFailed, WorkloadError, ArmError) as e:
        print(f"pdserve-bench load: {e}", file=sys.stderr)
        return 1
    model = next(info["model"] for info in arm_infos if "model" in info)
    n_long = long_count(args.num_prompts, args.long_fraction) if args.dataset == "synthetic" else None
    run_record = {
        "date": env["date"],
        "environment": env,
        "command": _command_line(),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "backend": args.backend,
        "model": model,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "policies": [arm.policy for arm in arms if arm.policy] or None,
        "policy_runs": args.policy_runs,
        "policy_runs_note": POLICY_RUNS_NOTE[args.policy_runs],
        "arms": arm_infos,
        "workload": workload_text(args),
        "long_prompts_per_run": n_long,
        "prompt_text": text,
        "slos_ms": slos,
        "goodput_target": args.goodput_target if slos else None,
        "percentiles": percentiles,
        "args": _recorded_args(args),
        "results": blocks,
    }
    run_record["verdict"] = judge(run_record)
    if not args.no_plots:
        from pdserve.bench.load.plots import plot_all
        run_record["plots"] = [p.name for p in plot_all(blocks, out)]
    write_json(out / "results.json", run_record)
    if args.save_result:
        from pdserve.bench.load.vllm_compat import save_results
        run_record["vllm_results"] = [str(p) for p in save_results(run_record, args)]
        write_json(out / "results.json", run_record)
    summary = markdown(run_record, percentiles)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"results in {out}/", file=sys.stderr)
    failed_arms = [info["label"] for info in arm_infos if "error" in info]
    if failed_arms:
        print(f"pdserve-bench load: arm(s) {', '.join(failed_arms)} failed (their errors are in results.json)",
              file=sys.stderr)
    return 0 if all(b["completed"] > 0 for b in blocks) and not failed_arms else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.bench.load.generator ...`, the same as `pdserve-bench load ...`."""
    parser = argparse.ArgumentParser(prog="pdserve-bench load", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
