"""`vllm bench serve`'s habits in `pdserve-bench load`: its flag spellings, its auth, its result file.

    add_refused(parser)       vLLM's flags without a counterpart here, refused by name with what to do instead
    resolve(args)             the vLLM spellings folded into ours (--host/--port -> --base-url, --backend /
                              --endpoint -> chat or completions, --random-input-len / --random-output-len /
                              --random-range-ratio -> --input-len / --output-len, --api-key or
                              $OPENAI_API_KEY and --header -> the headers of every request); a flag that
                              cannot be honoured, or two that disagree, raise ValueError saying so
    vllm_result(block, run)   one result block as vLLM's flat JSON (its top-level keys, so vLLM's tooling
                              reads it), with a few pdserve_* keys pointing back at results.json
    save_results(run, args)   --save-result: one such file per arm and load point, named as vLLM names
                              them (--result-filename for a single file, --result-dir, default --out)

Names and defaults checked against vllm/benchmarks/serve.py and vllm/benchmarks/datasets/arg_utils.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from pdserve.bench.load.metrics import pct_name

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# vLLM's names for the two OpenAI endpoints ("vllm" is its older name for openai)
BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's --dataset-name values we have; the others are refused by name
DATASET_ALIASES = {"random": "synthetic", "synthetic": "synthetic", "sharegpt": "sharegpt", "mooncake": "mooncake",
                   "multiturn": "multiturn"}
VLLM_ONLY_DATASETS = ("burstgpt", "sonnet", "random-mm", "random-rerank", "hf", "custom", "prefix_repetition",
                      "spec_bench", "txt-slices")
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, DEFAULT_NUM_PROMPTS = "1024", "128", 100
# vLLM's flags with no counterpart here: refused by name, with what to do instead
_EXTRA_BODY = "send it in every request with --extra-body '{\"name\": value}'"
REFUSED = {
    "--num-warmups": "warm-up here repeats until TTFT is steady: --warmup-batch, --warmup-max-batches",
    "--save-detailed": "results.json already holds every request's record",
    "--append-result": "each run writes its own files (--save-result)",
    "--metadata": "results.json records the command, machine, versions and commit itself",
    "--profile": "pdserve has no profiler endpoint",
    "--ramp-up-strategy": "sweep rates with --request-rates, or search with --capacity-search",
    "--ramp-up-start-rps": "sweep rates with --request-rates, or search with --capacity-search",
    "--ramp-up-end-rps": "sweep rates with --request-rates, or search with --capacity-search",
    "--temperature": _EXTRA_BODY, "--top-p": _EXTRA_BODY, "--top-k": _EXTRA_BODY, "--min-p": _EXTRA_BODY,
    "--frequency-penalty": _EXTRA_BODY, "--presence-penalty": _EXTRA_BODY, "--repetition-penalty": _EXTRA_BODY,
    "--logprobs": _EXTRA_BODY,
    "--served-model-name": "give the served name as --model",
    "--lora-modules": "pdserve serves no LoRA adapters",
    "--request-id-prefix": "pdserve names each request; its id is in every record",
    "--ready-check-timeout-sec": "an arm's own server is waited for up to --server-timeout",
    "--tokenizer-mode": "--tokenizer takes a pdserve model name or a local HuggingFace folder",
    "--trust-remote-code": "--tokenizer takes a pdserve model name or a local HuggingFace folder",
    "--use-beam-search": "pdserve does not do beam search",
    "--random-prefix-len": "not implemented (a shared prefix: --dataset multiturn, or a Mooncake trace)",
    "--random-batch-size": "embeddings are not served",
    "--no-stream": "every request here is streamed (TTFT and ITL need it)",
    "--no-oversample": "not implemented", "--skip-chat-template": "not implemented",
    "--disable-shuffle": "not implemented",
}


def dataset_name(text: str) -> str:
    """argparse type of --dataset / --dataset-name: vLLM's `random` is our `synthetic`."""
    import argparse

    if text in DATASET_ALIASES:
        return DATASET_ALIASES[text]
    if text in VLLM_ONLY_DATASETS:
        raise argparse.ArgumentTypeError(f"vLLM's {text!r} dataset is not implemented here; use random (synthetic), "
                                         "sharegpt, mooncake or multiturn")
    raise argparse.ArgumentTypeError(f"unknown dataset {text!r}; use {', '.join(DATASET_ALIASES)}")


def add_refused(parser) -> None:
    """vLLM's flags we cannot honour: accepted by the parser only to be refused with the reason."""
    import argparse

    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"vLLM's {option_string} is not supported by pdserve-bench load: {REFUSED[option_string]}")

    g = parser.add_argument_group("vllm bench serve flags refused (each says why)")
    for flag in REFUSED:
        g.add_argument(flag, nargs="*", action=Refuse, help=argparse.SUPPRESS)


def _endpoint(args) -> str:
    if args.backend is not None and args.backend not in BACKENDS:
        raise ValueError(f"--backend {args.backend}: pdserve-bench load speaks OpenAI's HTTP API only: "
                         f"openai or vllm ({COMPLETIONS}), openai-chat ({CHAT})")
    endpoint = None if args.endpoint is None else "/" + args.endpoint.strip("/")
    if endpoint not in (None, COMPLETIONS, CHAT):
        raise ValueError(f"--endpoint {args.endpoint}: only {COMPLETIONS} and {CHAT} are spoken")
    if args.backend is not None and endpoint is not None and BACKENDS[args.backend] != endpoint:
        raise ValueError(f"--backend {args.backend} sends to {BACKENDS[args.backend]}, but --endpoint says {endpoint}")
    # multi-turn defaults to chat: the template's special tokens keep every earlier turn an exact token prefix
    default = CHAT if args.dataset == "multiturn" else COMPLETIONS
    return endpoint or (BACKENDS[args.backend] if args.backend else default)


def _headers(args, environ) -> dict[str, str]:
    headers = {}
    for item in args.header or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--header {item!r}: use KEY=VALUE, e.g. --header x-trace=1")
        headers[key.strip()] = value.strip()
    key = args.api_key or environ.get("OPENAI_API_KEY")
    if key and not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _random_len(n: int | None, ratio: float, default: str) -> str:
    """vLLM's random lengths: n, or uniform over [n (1 - ratio), n (1 + ratio)]."""
    if n is None:
        return default
    if n < 1:
        raise ValueError(f"--random-input-len / --random-output-len must be >= 1, got {n}")
    return str(n) if ratio == 0 else f"uniform:{max(1, math.floor(n * (1 - ratio)))}:{math.ceil(n * (1 + ratio))}"


def _lengths(args) -> None:
    vllm_given = args.random_input_len is not None or args.random_output_len is not None \
        or args.random_range_ratio is not None
    if vllm_given and args.dataset != "synthetic":
        raise ValueError("--random-input-len, --random-output-len and --random-range-ratio shape --dataset-name "
                         f"random only (this run's dataset: {args.dataset}); use --input-len / --output-len")
    for ours, theirs in (("input_len", "random_input_len"), ("output_len", "random_output_len")):
        if getattr(args, ours) is not None and getattr(args, theirs) is not None:
            raise ValueError(f"give --{ours.replace('_', '-')} or --{theirs.replace('_', '-')}, not both")
    ratio = args.random_range_ratio
    if ratio is not None:
        if not 0 <= ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        if args.input_len is not None or args.output_len is not None:
            raise ValueError("--random-range-ratio widens --random-input-len / --random-output-len; with "
                             "--input-len / --output-len write the range itself (uniform:LO:HI)")
    if args.input_len is None:
        args.input_len = _random_len(args.random_input_len, ratio or 0.0, DEFAULT_INPUT_LEN)
    if args.output_len is None:
        args.output_len = _random_len(args.random_output_len, ratio or 0.0, DEFAULT_OUTPUT_LEN)


def resolve(args, environ=os.environ) -> None:
    """Fold the vLLM spellings into ours, in place; ValueError for what cannot be honoured."""
    if args.base_url is not None and (args.host is not None or args.port is not None):
        raise ValueError("give --base-url or --host/--port, not both")
    host = args.host or "127.0.0.1"
    args.base_url = (args.base_url or f"http://{'[' + host + ']' if ':' in host else host}:{args.port or 8000}"
                     ).rstrip("/")
    args.endpoint = _endpoint(args)
    args.chat = args.endpoint == CHAT
    args.backend = "openai-chat" if args.chat else "openai"
    args.headers = _headers(args, environ)
    _lengths(args)
    if args.ignore_eos and args.no_ignore_eos:
        raise ValueError("--ignore-eos and --no-ignore-eos contradict each other")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics {args.percentile_metrics!r}: use a comma-separated subset of "
                         f"{','.join(PERCENTILE_METRICS)}")
    args.percentile_metrics = metrics
    if args.max_concurrency is not None:
        if args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.concurrency:
            raise ValueError("--max-concurrency caps an open loop (--request-rate); --concurrency is the closed "
                             "loop itself: give one of them")
        if args.dataset == "multiturn":
            raise ValueError("a multi-turn run counts conversations: give --concurrency N (conversations in "
                             "flight) instead of --max-concurrency")
        if args.policy_runs == "interleaved":
            raise ValueError("--max-concurrency is not implemented for --policy-runs interleaved (the policies "
                             "would share one cap)")
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise ValueError("--result-dir / --result-filename name what --save-result writes: add --save-result")
    if args.dataset == "multiturn":
        if args.num_prompts is not None:
            raise ValueError("a multi-turn run sends --conversations x --turns requests: leave out --num-prompts")
        args.num_prompts = args.conversations * args.turns
    elif args.num_prompts is None:
        args.num_prompts = DEFAULT_NUM_PROMPTS


def vllm_result(block: dict, run: dict, args) -> dict:
    """vLLM's result keys for one block (`vllm bench serve --save-result` without --save-detailed)."""
    rate = block.get("request_rate")
    out = {
        "date": run["date"], "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
        "model_id": run["model_id"], "tokenizer_id": run["tokenizer_id"], "num_prompts": block["num_prompts"],
        "request_rate": "inf" if rate is None else rate, "burstiness": block.get("burstiness") or args.burstiness,
        "max_concurrency": block.get("max_concurrency"),
    }
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests"):
        out[key] = block.get(key)
    for m in args.percentile_metrics:
        for stat in ("mean", "median", "std"):
            out[f"{stat}_{m}_ms"] = block[f"{stat}_{m}_ms"]
        for p in args.percentiles:
            out[f"{pct_name(p)}_{m}_ms"] = block[f"{pct_name(p)}_{m}_ms"]
    out |= {"pdserve_arm": block.get("arm"), "pdserve_policy": block.get("policy"), "pdserve_phase": block.get("phase"),
            "pdserve_point": block.get("point"), "pdserve_cold": block.get("cold"),
            "pdserve_cold_reason": block.get("cold_reason"), "pdserve_results": "results.json"}
    return out


def _safe(text: str) -> str:
    return re.sub(r"[^\w.+-]", "_", str(text))


def result_paths(run: dict, args) -> list[Path]:
    """vLLM's name, {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, with the arm and point added
    when there are several blocks; --result-filename as given for one block, else numbered."""
    blocks = run["results"]
    folder = Path(args.result_dir or args.out)
    model = _safe(str(run["model_id"]).split("/")[-1])
    paths = []
    for i, b in enumerate(blocks):
        if args.result_filename:
            name = Path(args.result_filename)
            paths.append(folder / (name.name if len(blocks) == 1 else f"{name.stem}-{i:02d}-{_safe(b.get('arm'))}"
                                   f"{name.suffix or '.json'}"))
            continue
        rate = b.get("request_rate")
        qps = "inf" if rate in (None, "inf") else f"{float(rate):g}"
        conc = f"-concurrency{b['max_concurrency']}" if b.get("max_concurrency") is not None else ""
        where = "" if len(blocks) == 1 else f"-{_safe(b.get('arm'))}-{i:02d}-{_safe(b.get('phase'))}"
        paths.append(folder / f"{_safe(args.label or args.backend)}{where}-{qps}qps{conc}-{model}-{run['date']}.json")
    return paths


def save_results(run: dict, args) -> list[Path]:
    paths = result_paths(run, args)
    for block, path in zip(run["results"], paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(vllm_result(block, run, args), allow_nan=False))
    return paths
