"""Writing a load run down: results.json (vllm-bench-serve field names, one block per arm and run,
plus where and when it ran) and summary.md (what a reader wants first: how the policies were run, the
verdict in words (bench/load/verdict.py), each arm's warm-up and capacity, then every run with its
saturation and cold marks)."""

from __future__ import annotations

import datetime as dt
import gzip
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path

from pdserve.bench.load.capacity import COLD_MIN_COMPARED, COLD_RATIO, LATENESS_GROWTH_MAX, THROUGHPUT_RATIO_MIN
from pdserve.bench.load.verdict import verdict_lines
from pdserve.bench.load.metrics import SERVER_PHASES, pct_name
from pdserve.workers.engine.compiles import LOG_MARK

PACKAGES = ("pdserve", "httpx", "numpy", "torch", "transformers", "fastapi", "uvicorn", "nixl")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        return f"({cmd[0]} failed: {e})"
    return out.stdout.strip()


def environment() -> dict:
    """The load generator's machine (usually the server's too), software versions and the date."""
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "date": now.astimezone().strftime("%Y%m%d-%H%M%S"),
        "date_utc": now.isoformat(timespec="seconds"),
        "machine": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "gpus": _command_output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"]),
        },
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        **_git(),
    }


def _git() -> dict:
    """The commit measured, as the other benches record it (bench/provenance.py: PDSERVE_COMMIT on a
    copied tree, else git). run_load_gpu.sh records the GPUs' clocks and power beside the JSON."""
    from pdserve.bench import provenance

    state = provenance.git_state()
    return {"git_commit": state["commit"], "git_dirty": state["dirty"]}


def write_json(path: Path, run: dict) -> None:
    # allow_nan=False: an inf or nan that slipped through is a bug to see, not invalid JSON to ship
    path.write_text(json.dumps(run, indent=1, allow_nan=False))


# A run's results are written as results.json; a large one may be committed gzipped (results.json.gz, its
# per-request records run to megabytes: docs/benchmarks.md). Every reader takes either form.
RESULTS = "results.json"


def results_file(folder: str | Path) -> Path | None:
    """FOLDER's results: results.json, else results.json.gz; None where it holds neither."""
    for name in (RESULTS, RESULTS + ".gz"):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def results_files(root: str | Path, pattern: str = "*") -> list[Path]:
    """The results of each folder under ROOT matching PATTERN (a glob of one level), one a folder, plain
    results.json preferred where both are there: what `ROOT.glob(PATTERN + "/results.json")` was, .gz too."""
    return [f for d in sorted(Path(root).glob(pattern)) if d.is_dir() for f in [results_file(d)] if f]


def read_results(path: str | Path) -> dict:
    """A load run's results.json: PATH if it is there, else PATH.gz (so `X/results.json` reads a committed
    `X/results.json.gz`); a PATH ending in .gz is read gzipped. Neither there: FileNotFoundError naming PATH."""
    path = Path(path)
    if not path.is_file() and path.suffix != ".gz" and Path(str(path) + ".gz").is_file():
        path = Path(str(path) + ".gz")
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table_head(cells: list[str]) -> list[str]:
    """A markdown table's header and delimiter rows; one delimiter per header cell, or the table renders as
    raw text."""
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


def _arm(block: dict) -> str:
    return block.get("arm") or block.get("policy") or "default"


def _saturated(block: dict) -> str:
    sat = block.get("saturation") or {}
    if sat.get("saturated") is None:
        return "-"
    ratio, growth = sat.get("throughput_ratio"), sat.get("lateness_growth")
    signals = f"{_fmt(ratio, 2)} / {_fmt(growth, 2)}"
    return f"**yes** ({signals})" if sat["saturated"] else f"no ({signals})"


def _cached(block: dict) -> str:
    """The share of the run's prompt tokens the server said it served from its cache; '-': it said nothing."""
    share = block.get("cached_share")
    if share is None:
        return "-"
    return f"{share:.0%} ({block['total_cached_tokens']} / {block.get('cache_reported_prompt_tokens') or '?'} tok)"


def _cold(block: dict) -> str:
    if "cold" not in block:  # written before the flag existed
        return "-"
    if block["cold"]:
        return f"**yes** ({block['cold_reason']})"
    check = block.get("cold_check") or {}
    if not check.get("judged"):
        return f"no (early/late not compared: {check.get('compared', 0)} < {COLD_MIN_COMPARED})"
    return f"no ({_fmt(check.get('ttft_ratio'), 2)} / {_fmt(check.get('tpot_ratio'), 2)})"


def _arm_lines(run: dict) -> list[str]:
    lines = []
    for arm in run.get("arms") or []:
        where = arm.get("server", {}).get("command") or arm.get("base_url") or "its server not started"
        text = f"- arm **{arm['label']}**: policy {arm.get('policy') or '(server default)'}, {where}"
        if arm.get("error"):
            lines.append(text + f"; **failed, not measured**: {arm['error'].splitlines()[0]}")
            continue
        if arm.get("server", {}).get("startup_s") is not None:
            text += f" (ready in {arm['server']['startup_s']:.0f} s, log {arm['server']['log']})"
        work = arm.get("server", {}).get("serving_work")
        if work:  # compiles or graph captures after ready, each of which held a step (workers/engine/compiles.py)
            first = work[0].split(LOG_MARK, 1)[-1]  # the warning's text, after the worker's name and the mark
            text += (f"; **{arm['server']['serving_work_count']} warning(s) of start-up work while serving** "
                     f"in its log (the first: {first})")
        w = arm.get("warmup")
        if w:
            medians = ", ".join(f"{m:.0f}" for m in w["median_ttft_ms"])
            text += (f"; warm-up: {w['batches']} batch(es) of {w['batch_size']} (median TTFT {medians} ms), "
                     + ("steady" if w["steady"] else f"**not steady** within {w['max_batches']}")
                     + f" at {w['tolerance']:.0%}")
        else:
            text += "; no warm-up"
        lines.append(text)
    return lines


def _capacity_lines(run: dict) -> list[str]:
    caps = [(a["label"], a["capacity"]) for a in run.get("arms") or [] if a.get("capacity")]
    if not caps:
        return []
    target = caps[0][1]["goodput_target"]
    lines = ["", f"Capacity: the highest probed Poisson rate at which >= {target:.0%} of the requests met every "
             "SLO (DistServe's goodput); the first failing rate bounds it from above.", "",
             *_table_head(["arm", "capacity (req/s)", "first failing rate", "converged", "capacity run saturated",
                           "rests on a cold run", "probes (rate: pass/fail)"])]
    flagged = cold_fail = False
    for label, cap in caps:
        at = next((b for b in run["results"] if _arm(b) == label and b.get("phase") == "probe"
                   and b["request_rate"] == cap["capacity_rate"]), None)
        saturated = bool(at and (at.get("saturation") or {}).get("saturated"))
        flagged |= saturated
        probes = ", ".join(f"{p['rate']:.3g}: {'pass' if p['passed'] else 'fail'}" for p in cap["probes"])
        cold = cap.get("rests_on_cold")
        cold_fail |= any(c["run"] == "first failing" for c in cold or [])
        cold_text = "-" if cold is None else \
            ", ".join(f"**{c['run']} run** ({c['rate']:.3g}/s)" for c in cold) or "no"
        lines.append(f"| {label} | {_fmt(cap['capacity_rate'], 3)} | {_fmt(cap['first_failing_rate'], 3)} | "
                     f"{'yes' if cap['converged'] else 'no'}{' (out of time)' if cap.get('out_of_time') else ''} | "
                     f"{'**yes**' if saturated else 'no'} | {cold_text} | {probes} |")
    if flagged:
        lines += ["", "A capacity run marked saturated met the SLOs while its queue grew: a longer run "
                  "(more --num-prompts) would fail it, so that capacity is an upper bound."]
    if cold_fail:
        lines += ["", "A first failing run marked cold may have failed on start-up effects alone (its reason is in "
                  "the runs' table): that capacity is a lower bound. A cold capacity run passed even cold."]
    return lines


def _predicted_cells(t: dict) -> list[str]:
    """The per-turn row's router prediction beside the measured TTFT (metrics.predicted_ttft)."""
    if not t.get("predicted_reported"):
        return ["-", "-", "-"]
    return [f"{_fmt(t['mean_predicted_ttft_ms'])} ({t['predicted_reported']})", _fmt(t["mean_measured_ttft_ms"]),
            f"{t['predicted_ttft_error']:+.0%}; {t['median_predicted_ttft_abs_error']:.0%}"]


def _per_turn_lines(blocks: list[dict], ps: list[str]) -> list[str]:
    """Multi-turn runs: TTFT and reuse per turn index, one row per arm, run and turn."""
    rows = [(b, t) for b in blocks for t in b.get("per_turn") or []]
    if not rows:
        return []
    lines = ["", "Per turn (multi-turn runs; turn 1 is each conversation's first request): TTFT in ms (client clock); "
             "cached = prompt tokens the server reported reused (usage.prompt_tokens_details.cached_tokens), "
             "'-' where it reported none; the tiers they came from, server queue, prefill and reload means from "
             "pdserve `timings`; predicted = the KV-aware router's TTFT prediction (timings.route), mean over the "
             "requests that carried one (n), beside their measured TTFT mean; error = predicted / measured - 1 "
             "of the means, and the median per-request |error| ('-': no prediction, as under least-loaded "
             "routing).", "",
             *_table_head(["arm", "load", "turn", "done", "prompt tok (mean)", "cached tok (mean)", "cached share",
                           "cached from (mean tok)", *(f"TTFT {p}" for p in ps), "TTFT min-max",
                           "server queue (mean)", "server prefill (mean)", "reload (mean)",
                           "predicted TTFT (mean, n)", "measured TTFT (same, mean)", "pred. error (mean; median abs)"])]
    for b, t in rows:
        share = "-" if t["cached_share"] is None else f"{t['cached_share']:.0%}"
        tiers = t.get("mean_reused_tokens")
        where = ", ".join(f"{k} {v:.0f}" for k, v in tiers.items()) if tiers else "-"
        cells = [_arm(b), b["load_label"], t["turn"], f"{t['completed']}/{t['requests']}",
                 _fmt(t["mean_prompt_tokens"], 0), _fmt(t["mean_cached_tokens"], 0), share, where,
                 *(_fmt(t[f"{p}_ttft_ms"]) for p in ps), f"{_fmt(t.get('min_ttft_ms'))}-{_fmt(t.get('max_ttft_ms'))}",
                 _fmt(t["mean_queue_ms"]), _fmt(t["mean_prefill_ms"]),
                 _fmt(t.get("mean_reload_ms")), *_predicted_cells(t)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def markdown(run: dict, percentiles=(50.0, 90.0, 99.0)) -> str:
    blocks = run["results"]
    ps = [pct_name(p) for p in percentiles]
    env = run["environment"]
    policy_runs = run.get("policy_runs", "interleaved")
    lines = [
        f"# Load run {env['date']}",
        "",
        (f"- servers: a fresh one per arm, one arm after another (below), model `{run['model']}`"
         if any(arm.get("server") for arm in run.get("arms") or []) else f"- server: {run['base_url']}, model "
         f"`{run['model']}`") + f"; policies: {', '.join(run['policies'] or ['(server default)'])}",
        f"- policy runs: **{policy_runs}**: {run.get('policy_runs_note', '')}",
        *_arm_lines(run),
        f"- workload: {run['workload']}",
        *([f"- prompt text: {run['prompt_text']['note']}"] if run.get("prompt_text") else []),
        f"- machine: {env['machine']['hostname']}, {env['machine']['platform']}, "
        f"GPUs: {env['machine']['gpus'] or 'none seen'}",
        f"- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
        f"- git commit: {env['git_commit'] or 'unknown'}",
        f"- command: `{run['command']}`",
    ]
    if run.get("slos_ms"):
        lines.append("- goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in run["slos_ms"].items())
                     + (f"; a run meets them when >= {run['goodput_target']:.0%} of its requests do"
                        if run.get("goodput_target") else ""))
    lines += verdict_lines(run)
    lines += _capacity_lines(run)
    lines += [
        "",
        "Latencies in ms (client clock). TPOT = (E2E - TTFT) / (output tokens - 1); ITL pooled over all gaps. "
        "req/s and out tok/s over each arm's own duration. Saturated: achieved throughput below "
        f"{THROUGHPUT_RATIO_MIN} of the offered rate, or lateness growing more than {LATENESS_GROWTH_MAX}x from the "
        "first third of the sends to the last (the two numbers in brackets, bench/load/capacity.py). "
        "Cold: the run still carries start-up effects, reported all the same: its arm's first run after a warm-up "
        f"that hit --warmup-max-batches unsteady, or, over >= {COLD_MIN_COMPARED} completed requests of one kind in "
        f"send order, a first quarter whose median TTFT or TPOT is more than {COLD_RATIO:g}x the rest's (the two "
        "ratios in brackets; a closed loop's start, every slot sent at once, can show so too).",
        "",
        *_table_head(["arm", "phase", "load", "done", "failed", "duration (s)", "req/s", "out tok/s",
                      *(f"TTFT {p}" for p in ps), "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2E p50",
                      "E2E p99", "goodput req/s", "SLOs met", "cached share", "saturated (ratio / growth)",
                      "cold (TTFT / TPOT ratio)"]),
    ]
    for b in blocks:
        met = "-" if b.get("goodput_fraction") is None else \
            f"{b['goodput_fraction']:.0%}" + ("" if b.get("meets_goodput_target") in (None, True) else " (below target)")
        row = [_arm(b), b.get("phase", "point"), b["load_label"], b["completed"], b["failed"], _fmt(b["duration"], 1),
               _fmt(b["request_throughput"], 2), _fmt(b["output_throughput"], 0)]
        row += [_fmt(b[f"{p}_ttft_ms"]) for p in ps]
        row += [_fmt(b["median_tpot_ms"], 2), _fmt(b["p99_tpot_ms"], 2), _fmt(b["median_itl_ms"], 2),
                _fmt(b["p99_itl_ms"], 2), _fmt(b["median_e2el_ms"]), _fmt(b["p99_e2el_ms"]),
                _fmt(b["request_goodput"], 2), met, _cached(b), _saturated(b), _cold(b)]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    if any(b["timings_reported"] for b in blocks):
        lines += [
            "",
            "Server phases (pdserve `timings`), mean / p99 in ms over the requests that reported them:",
            "",
            *_table_head(["arm", "phase", "load", "with timings", *SERVER_PHASES]),
        ]
        for b in blocks:
            cells = [f"{_fmt(b[f'mean_{n}_ms'])} / {_fmt(b[f'p99_{n}_ms'])}" for n in SERVER_PHASES]
            lines.append(f"| {_arm(b)} | {b.get('phase', 'point')} | {b['load_label']} | {b['timings_reported']} | "
                         + " | ".join(cells) + " |")
    lines += _per_turn_lines(blocks, ps)
    failed = [(b["load_label"], _arm(b), e) for b in blocks for e in b["errors"] if e]
    if failed:
        lines += ["", f"First errors ({len(failed)} failed requests in all):", ""]
        lines += [f"- {load}, {arm}: {err}" for load, arm, err in failed[:5]]
    if run.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in run["plots"])]
    return "\n".join(lines) + "\n"
