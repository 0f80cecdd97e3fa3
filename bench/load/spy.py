"""`pdserve-bench spy FILE...`: what a worker's threads were doing, from py-spy's sampled stacks (speedscope
JSON, `SPY_SECONDS=... bench/run_defaults_gpu.sh` writes them beside a load's results).

For each thread: how many samples, the functions most often on its stack (inclusive) and at its top (where
it was: computing, or waiting, since the samples include idle threads). Then the same for the samples taken
inside the engine's step launch (`Engine._launch` on the stack): a step trace says a launch took 45 ms where
its thread used 5 ms of CPU (step_trace.py); these say in which call it waited.

Nothing here depends on the GPU: the files are read and counted.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from pdserve.bench.load.report import read_results

LAUNCH = "Engine._launch"  # a frame's name as py-spy writes it (Class.method)
TOP = 12


def read(path: Path) -> dict:
    data = read_results(path)  # any JSON file, gzipped where it ends in .gz
    if "profiles" not in data or "shared" not in data:
        raise ValueError(f"{path}: not a speedscope file (py-spy record --format speedscope)")
    return data


def _label(frame: dict) -> str:
    where = Path(frame.get("file") or "?").name
    return f"{frame['name']} ({where}:{frame.get('line')})"


def _counts(stacks: list[list[int]], frames: list[dict]) -> dict:
    inclusive, leaf = Counter(), Counter()
    for stack in stacks:
        for label in {_label(frames[i]) for i in stack}:
            inclusive[label] += 1
        if stack:
            leaf[_label(frames[stack[-1]])] += 1
    n = len(stacks)
    share = lambda c: [{"frame": k, "samples": v, "share": v / n} for k, v in c.most_common(TOP)]  # noqa: E731
    return {"samples": n, "inclusive": share(inclusive), "leaf": share(leaf)}


def summarize(path: Path) -> dict:
    """One speedscope file -> per thread its samples' counts, and those of the samples inside a launch."""
    data = read(path)
    frames = data["shared"]["frames"]
    threads = []
    for prof in data["profiles"]:
        if prof.get("type") != "sampled":
            continue
        stacks = prof["samples"]  # each a list of frame indices, outermost first
        row = {"thread": prof.get("name"), **_counts(stacks, frames)}
        inside = [s for s in stacks if any(frames[i]["name"] == LAUNCH for i in s)]
        row["launch"] = _counts(inside, frames) if inside else None
        threads.append(row)
    return {"file": str(path), "threads": threads}


def render(out: dict) -> str:
    lines = [f"# {out['file']}"]
    for t in out["threads"]:
        if not t["samples"]:
            continue
        lines += ["", f"## {t['thread']}: {t['samples']} samples", "", "| on the stack (inclusive) | share |",
                  "|---|---|"] + [f"| `{r['frame']}` | {r['share']:.0%} |" for r in t["inclusive"]]
        lines += ["", "| at the top of the stack | share |", "|---|---|"] + [
            f"| `{r['frame']}` | {r['share']:.0%} |" for r in t["leaf"]]
        if t["launch"]:
            la = t["launch"]
            lines += ["", f"Inside `{LAUNCH}`: {la['samples']} samples ({la['samples'] / t['samples']:.0%} of the "
                      "thread's)", "", "| at the top of the stack, inside a launch | share of those |", "|---|---|"]
            lines += [f"| `{r['frame']}` | {r['share']:.0%} |" for r in la["leaf"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="py-spy speedscope files (spy-<pid>.json, or .json.gz)")
    p.add_argument("--out", default=None, help="the summary as JSON (with provenance)")


def run(args) -> int:
    try:
        outs = [summarize(Path(f)) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"pdserve-bench spy: {e}")
        return 2
    print("\n\n".join(render(o) for o in outs))
    if args.out:
        from pdserve.bench.provenance import collect

        Path(args.out).write_text(json.dumps({"provenance": collect([]), "files": outs}, indent=1))
    return 0
