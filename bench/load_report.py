"""Writing a load run down: results.json (vllm-bench-serve field names, one block per policy and
load point, plus where and when it ran) and summary.md (the tables a reader wants first)."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path

from bench.metrics import SERVER_PHASES, pct_name

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
    repo = Path(__file__).resolve().parent.parent
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
        "git_commit": _command_output(["git", "-C", str(repo), "rev-parse", "HEAD"]),
    }


def write_json(path: Path, run: dict) -> None:
    # allow_nan=False: an inf or nan that slipped through is a bug to see, not invalid JSON to ship
    path.write_text(json.dumps(run, indent=1, allow_nan=False))


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(run: dict, percentiles=(50.0, 90.0, 99.0)) -> str:
    blocks = run["results"]
    ps = [pct_name(p) for p in percentiles]
    env = run["environment"]
    lines = [
        f"# Load run {env['date']}",
        "",
        f"- server: {run['base_url']}, model `{run['model']}`; policies: {', '.join(run['policies'] or ['(server default)'])}",
        f"- workload: {run['workload']}",
        f"- machine: {env['machine']['hostname']}, {env['machine']['platform']}, "
        f"GPUs: {env['machine']['gpus'] or 'none seen'}",
        f"- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
        f"- git commit: {env['git_commit'] or 'unknown'}",
        f"- command: `{run['command']}`",
    ]
    if run.get("slos_ms"):
        lines.append("- goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in run["slos_ms"].items()))
    lines += [
        "",
        "Latencies in ms (client clock). TPOT = (E2E - TTFT) / (output tokens - 1); ITL pooled over all gaps.",
        "",
        "| load | policy | done | failed | req/s | out tok/s | " + " | ".join(
            f"TTFT {p}" for p in ps) + " | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | goodput req/s |",
        "|" + "---|" * (12 + len(ps)),
    ]
    for b in blocks:
        row = [b["load_label"], b.get("policy") or "default", b["completed"], b["failed"],
               _fmt(b["request_throughput"], 2), _fmt(b["output_throughput"], 0)]
        row += [_fmt(b[f"{p}_ttft_ms"]) for p in ps]
        row += [_fmt(b["median_tpot_ms"], 2), _fmt(b["p99_tpot_ms"], 2), _fmt(b["median_itl_ms"], 2),
                _fmt(b["p99_itl_ms"], 2), _fmt(b["median_e2el_ms"]), _fmt(b["p99_e2el_ms"]),
                _fmt(b["request_goodput"], 2)]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    if any(b["timings_reported"] for b in blocks):
        lines += [
            "",
            "Server phases (pdserve `timings`), mean / p99 in ms over the requests that reported them:",
            "",
            "| load | policy | with timings | " + " | ".join(SERVER_PHASES) + " |",
            "|" + "---|" * (3 + len(SERVER_PHASES)),
        ]
        for b in blocks:
            cells = [f"{_fmt(b[f'mean_{n}_ms'])} / {_fmt(b[f'p99_{n}_ms'])}" for n in SERVER_PHASES]
            lines.append(f"| {b['load_label']} | {b.get('policy') or 'default'} | {b['timings_reported']} | "
                         + " | ".join(cells) + " |")
    failed = [(b["load_label"], b.get("policy"), e) for b in blocks for e in b["errors"] if e]
    if failed:
        lines += ["", f"First errors ({len(failed)} failed requests in all):", ""]
        lines += [f"- {load}, {policy or 'default'}: {err}" for load, policy, err in failed[:5]]
    if run.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in run["plots"])]
    return "\n".join(lines) + "\n"
