"""`pdserve-bench trace`: the steps a server's workers ran (their `--step-trace` files), grouped by make,
each group's host and device time, and beside each step what the planner's profile says a step of that
make costs.

    pdserve-bench trace DIR [DIR|FILE ...] [--profile ENGINE_JSON] [--results RESULTS.json] [--out summary.json]

DIR: a `--step-trace` directory (every steps-*.jsonl in it, and below it, or .jsonl.gz); FILE: one trace. For each
worker it reports:

  - its span (first step's start to last step's end), the steps, and over the span the share of time its
    steps kept the device busy (device_ms summed) and the device's gaps between steps (gap_ms summed: the
    device waiting for the host to launch, or other work between steps);
  - a row per make of step: decode-only steps by batch (1, 2-8, 9-32, 33+), steps with prompt tokens by
    those tokens (<= 1024, 1025-2048, 2049-4096, 4097-8192, more), with or without decode rows beside
    them, and the forward path each took. Each row: steps, those that compiled or captured something
    while they launched (`startup_work`), the medians of tokens, schedule_ms, launch_ms,
    device_ms, gap_ms, wait_ms, and with --profile the medians of the predicted ms (plan_sim's
    Profile.step_ms, the same rule the simulation prices by) and of measured / predicted, per step;
  - with --results (a `pdserve-bench load` results.json of the same server), a line per run of it (a probe,
    a point) over the steps that began during it, on the wall clock: its steps, the device's busy share, the
    steps that waited for start-up work, measured / predicted: a cold first probe beside the warm ones;
  - where two traces come from workers on one device (1P:1D sharing a GPU), each step's share of its wall
    time (t to done_t) during which the other worker had a step in flight, and the measured / predicted
    ratio of the steps run alone (share < 10%) beside those run shared (> 90%).

Measured is device_ms where the trace has it (CUDA), else schedule + launch + wait (the CPU, where a
forward is done when launched). What the ratios say: near 1 alone, the profile prices the served step;
far above 1 alone with small gaps, the served forward itself is slower than the profile's (another path,
a recompile); a large gap share, a host-bound worker; near 1 alone and high shared, the device's sharing.
Torch-free.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from pdserve.bench.load.plan_sim import Profile
from pdserve.bench.load.report import read_results

DECODE_BATCHES = [(1, 1), (2, 8), (9, 32), (33, None)]
PROMPT_TOKENS = [(1, 1024), (1025, 2048), (2049, 4096), (4097, 8192), (8193, None)]
ALONE, SHARED = 0.1, 0.9  # a step's share of wall time beside the other worker's steps
FIELDS = ("tokens", "schedule_ms", "launch_ms", "device_ms", "gap_ms", "wait_ms")
# where a launch's host time went (traces from 2026-12-07 on; older lines lack them): p50 and p90 each
HOST_FIELDS = ("launch_ms", "launch_cpu_ms", "launch_gc_ms", "launch_sync_ms")


def read(path: Path) -> list[tuple[dict, list[dict]]]:
    """A trace file -> its segments, (header, steps) each: a worker restarted under the same id appended a
    header of its own. A line cut short by a worker's death is left out. A file ending in .gz is read gzipped
    (large traces are committed so, as large load results are)."""
    segments: list[tuple[dict, list[dict]]] = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("trace") == "pdserve steps":
                segments.append((row, []))
            elif "i" in row and segments:
                segments[-1][1].append(row)
    if not segments:
        raise ValueError(f"{path}: not a pdserve step trace (no header line)")
    return segments


def trace_files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            plain = set(p.rglob("steps-*.jsonl"))  # a worker's trace once: plain preferred, as results_file does
            out += sorted(plain | {g for g in p.rglob("steps-*.jsonl.gz") if g.with_suffix("") not in plain})
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    if not out:
        raise ValueError(f"no step traces (steps-*.jsonl) in {', '.join(paths)}")
    return out


def _range_label(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")


def make(step: dict) -> str:
    """The group a step falls in: "decode b<batch range>" or "prompt <token range>[ + decodes]"."""
    prompt = sum(b - a for a, b in step["chunks"])
    if not prompt:
        lo, hi = next((lo, hi) for lo, hi in DECODE_BATCHES if hi is None or step["decode"] <= hi)
        return f"decode b{_range_label(lo, hi)}"
    lo, hi = next((lo, hi) for lo, hi in PROMPT_TOKENS if hi is None or prompt <= hi)
    return f"prompt {_range_label(lo, hi)}" + (" + decodes" if step["decode"] else "")


def measured_ms(step: dict) -> float:
    """The step's time: on the device where traced (CUDA), else the host's whole handling of it."""
    if step.get("device_ms") is not None:
        return step["device_ms"]
    return step["schedule_ms"] + step["launch_ms"] + step["wait_ms"]


def predicted_ms(step: dict, header: dict, profile: Profile) -> float:
    """What the profile says this step costs: Profile.step_ms over its rows and chunks; a colocated
    worker's chunked step pays chunk_step_ms too."""
    chunked = header.get("role") == "colocated" and bool(header.get("chunked_prefill")) and step["kind"] == "step"
    return profile.step_ms(step["decode"], step["decode_ctx"], [tuple(c) for c in step["chunks"]], chunked)


def host_time(steps: list[dict]) -> dict | None:
    """Where these steps' launches spent their host time: p50 and p90 of HOST_FIELDS, and the launching
    thread's context switches per step, voluntary and involuntary (None: a trace without them)."""
    if not any("launch_cpu_ms" in s for s in steps):
        return None
    out = {}
    for f in HOST_FIELDS:
        xs = [s[f] for s in steps if s.get(f) is not None]
        out[f"{f}_p50"], out[f"{f}_p90"] = (float(np.percentile(xs, 50)), float(np.percentile(xs, 90))) if xs \
            else (None, None)
    csw = [s["launch_csw"] for s in steps if s.get("launch_csw") is not None]
    out["voluntary_per_step"] = sum(c[0] for c in csw) / len(csw) if csw else None
    out["involuntary_per_step"] = sum(c[1] for c in csw) / len(csw) if csw else None
    return out


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def beside(steps: list[dict], other: list[dict]) -> list[float]:
    """Each step's share of its wall time (t .. done_t) during which a step of `other` was in flight: the
    other steps' spans merged into disjoint intervals once, with their running total of time, so each step
    costs two searches (several other workers' overlapping steps count once)."""
    merged: list[list[float]] = []
    for lo, hi in sorted((s["t"], s["done_t"]) for s in other):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    starts, ends = [a for a, _ in merged], [b for _, b in merged]
    total = [0.0]
    for lo, hi in merged:
        total.append(total[-1] + hi - lo)

    def covered_until(x: float) -> float:  # the merged intervals' time before x
        i = bisect.bisect_right(starts, x)  # intervals starting at or before x
        return total[i] - (max(0.0, ends[i - 1] - x) if i else 0.0)

    return [(covered_until(s["done_t"]) - covered_until(s["t"])) / (s["done_t"] - s["t"])
            if s["done_t"] > s["t"] else 0.0 for s in steps]


def summarize(header: dict, steps: list[dict], profile: Profile | None, shares: list[float] | None = None) -> dict:
    """One worker's trace -> its span, busy and gap shares, and a row per make of step."""
    out = {"worker": header.get("worker"), "role": header.get("role"), "device": header.get("device"),
           "model": header.get("model"), "config": {k: header.get(k) for k in (
               "chunked_prefill", "chunk_tokens", "max_batched_tokens", "max_num_seqs", "graph_tokens", "overlap")},
           "steps": len(steps), "span_s": None, "device_busy_share": None, "device_gap_share": None, "makes": []}
    if not steps:
        return out
    span = max(s["done_t"] for s in steps) - min(s["t"] for s in steps)
    out["span_s"] = span
    if span > 0 and steps[0].get("device_ms") is not None:
        out["device_busy_share"] = sum(s["device_ms"] or 0.0 for s in steps) / 1e3 / span
        out["device_gap_share"] = sum(s["gap_ms"] or 0.0 for s in steps) / 1e3 / span
    ratios = [measured_ms(s) / p if profile and (p := predicted_ms(s, header, profile)) > 0 else None for s in steps]
    groups: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(steps):
        groups.setdefault((make(s), s.get("path") or "-"), []).append(i)

    def order(key):
        kind, _ = key
        return (kind.startswith("prompt"), int(kind.split()[1].lstrip("b").split("-")[0].rstrip("+")), key)

    for key in sorted(groups, key=order):
        idx = groups[key]
        row = {"make": key[0], "path": key[1], "steps": len(idx),
               "with_startup_work": sum(bool(steps[i].get("startup_work")) for i in idx),
               **{f"{f}_p50": _median([steps[i].get(f) for i in idx]) for f in FIELDS},
               "measured_ms_p50": _median([measured_ms(steps[i]) for i in idx]),
               "measured_ms_p90": float(np.percentile([measured_ms(steps[i]) for i in idx], 90))}
        if profile is not None:
            row["predicted_ms_p50"] = _median([predicted_ms(steps[i], header, profile) for i in idx])
            row["ratio_p50"] = _median([ratios[i] for i in idx])
        row["host"] = host_time([steps[i] for i in idx])
        out["makes"].append(row)
    if profile is not None:
        out["ratio_p50"] = _median(ratios)
    if shares is not None:
        alone = [r for r, sh in zip(ratios, shares) if sh < ALONE]
        shared = [r for r, sh in zip(ratios, shares) if sh > SHARED]
        out["beside_other"] = {"steps_alone": sum(sh < ALONE for sh in shares),
                               "steps_shared": sum(sh > SHARED for sh in shares),
                               "ratio_alone_p50": _median(alone) if profile else None,
                               "ratio_shared_p50": _median(shared) if profile else None}
    return out


def runs_of(results: dict) -> list[dict]:
    """The runs of a load results.json with their wall-clock window (`wall_s`, written since the step trace)."""
    out = []
    for b in results.get("results", []):
        if b.get("wall_s"):
            rate = b.get("request_rate")
            label = f"{b.get('arm')} {b.get('phase')} {b.get('load_label') or rate}"
            out.append({"run": label, "wall_s": b["wall_s"], "cold": b.get("cold"),
                        "meets_goodput_target": b.get("meets_goodput_target")})
    return out


def by_run(header: dict, steps: list[dict], runs: list[dict], profile: Profile | None) -> list[dict]:
    """Each run's steps (begun inside its wall-clock window) summed up."""
    base = header.get("unix_time", 0.0)
    out = []
    for run in runs:
        a, b = run["wall_s"]
        mine = [s for s in steps if a <= base + s["t"] < b]
        row = {**run, "steps": len(mine), "with_startup_work": sum(bool(s.get("startup_work")) for s in mine),
               "device_busy_share": None, "ratio_p50": None}
        if mine and mine[0].get("device_ms") is not None and b > a:
            row["device_busy_share"] = sum(s["device_ms"] or 0.0 for s in mine) / 1e3 / (b - a)
        if mine and profile is not None:
            row["ratio_p50"] = _median([measured_ms(s) / p for s in mine if (p := predicted_ms(s, header, profile)) > 0])
        out.append(row)
    return out


def report(paths: list[str], profile: Profile | None, results: list[dict] | None = None,
           segments: dict[Path, list[tuple[dict, list[dict]]]] | None = None) -> dict:
    """segments: each trace file under `paths` read already ({file: read(file)}); else they are read here."""
    if segments is None:
        segments = {f: read(f) for f in trace_files(paths)}
    traces = [(f"{f}#{k}" if k else str(f), header, steps)
              for f, segs in segments.items() for k, (header, steps) in enumerate(segs)]
    workers = []
    for f, header, steps in traces:
        # the other workers on this device in the same run (their clocks' zero within a minute of this one's),
        # their steps' times on this trace's clock
        base = header.get("unix_time", 0.0)
        other = [{"t": s["t"] + h["unix_time"] - base, "done_t": s["done_t"] + h["unix_time"] - base}
                 for g, h, ss in traces if g != f and h.get("device") == header.get("device")
                 and abs(h.get("unix_time", 0.0) - base) < 60 for s in ss]
        shares = beside(steps, other) if other else None
        row = summarize(header, steps, profile, shares)
        if results:
            row["runs"] = by_run(header, steps, [r for res in results for r in runs_of(res)], profile)
        row["file"] = str(f)
        workers.append(row)
    return {"profile": profile.to_dict() if profile else None, "workers": workers}


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(out: dict) -> str:
    lines = []
    for w in out["workers"]:
        busy = "" if w["device_busy_share"] is None else (
            f"; device busy {w['device_busy_share']:.0%}, gaps {w['device_gap_share']:.0%} of the span")
        lines.append(f"{w['worker']} ({w['role']}, {w['device']}): {w['steps']} steps over "
                     f"{_fmt(w['span_s'])} s{busy}")
        if w.get("ratio_p50") is not None:
            lines.append(f"  measured / predicted, median over its steps: {w['ratio_p50']:.2f}x")
        b = w.get("beside_other")
        if b:
            lines.append(f"  beside the other worker on {w['device']}: {b['steps_alone']} steps alone "
                         f"({_fmt(b['ratio_alone_p50'], 2)}x predicted), {b['steps_shared']} shared "
                         f"({_fmt(b['ratio_shared_p50'], 2)}x)")
        for r in w.get("runs") or []:
            busy = "" if r["device_busy_share"] is None else f", device busy {r['device_busy_share']:.0%}"
            ratio = "" if r["ratio_p50"] is None else f", {r['ratio_p50']:.2f}x predicted"
            lines.append(f"  run {r['run']}{' (cold)' if r['cold'] else ''}: {r['steps']} steps{busy}{ratio}, "
                         f"{r['with_startup_work']} waited for start-up work")
        head = ("make", "path", "steps", "compiling", "tokens", "sched ms", "launch ms", "device ms", "gap ms", "wait ms",
                "measured p50", "p90", "predicted", "ratio")
        lines.append("  | " + " | ".join(head) + " |")
        lines.append("  |" + "---|" * len(head))
        for r in w["makes"]:
            cells = [r["make"], r["path"], str(r["steps"]), str(r["with_startup_work"]), _fmt(r["tokens_p50"], 0), _fmt(r["schedule_ms_p50"], 2),
                     _fmt(r["launch_ms_p50"], 2), _fmt(r["device_ms_p50"], 2), _fmt(r["gap_ms_p50"], 2),
                     _fmt(r["wait_ms_p50"], 2), _fmt(r["measured_ms_p50"], 2), _fmt(r["measured_ms_p90"], 2),
                     _fmt(r.get("predicted_ms_p50"), 2), _fmt(r.get("ratio_p50"), 2)]
            lines.append("  | " + " | ".join(cells) + " |")
        hosts = [r for r in w["makes"] if r.get("host")]
        if hosts:
            lines.append("  where the launches' host time went (p50 / p90 ms; a launch well above its thread's CPU "
                         "time waited or was preempted):")
            head = ("make", "path", "launch", "thread CPU", "garbage collection", "device waits",
                    "switches per step (vol. / invol.)")
            lines.append("  | " + " | ".join(head) + " |")
            lines.append("  |" + "---|" * len(head))
            for r in hosts:
                h = r["host"]
                cells = [r["make"], r["path"]] + [f"{_fmt(h[f + '_p50'], 2)} / {_fmt(h[f + '_p90'], 2)}"
                                                  for f in HOST_FIELDS]
                cells.append(f"{_fmt(h['voluntary_per_step'], 1)} / {_fmt(h['involuntary_per_step'], 1)}")
                lines.append("  | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", help="--step-trace directories or steps-*.jsonl files")
    p.add_argument("--profile", default=None, help="a `pdserve-bench engine` JSON of the same model, device and code: "
                                                   "each step beside what it predicts")
    p.add_argument("--results", action="append", default=[], metavar="RESULTS_JSON",
                   help="a `pdserve-bench load` results.json (or .json.gz) of the same server: a line per run "
                        "(repeatable)")
    p.add_argument("--prompt-cost", action="store_true",
                   help="also each trace's prompt steps: device time a token, a fit of a step's device time "
                        "(per token, per query-key pair, per step, per decode row) and, with --profile, each "
                        "step's excess over the profile's unchunked prefill by its chunk's prefix "
                        "(bench/load/prompt_cost.py)")
    p.add_argument("--out", default=None, help="the summary as JSON (with provenance)")


def run(args) -> int:
    try:
        engine = json.loads(Path(args.profile).read_text()) if args.profile else None
        profile = None if engine is None else Profile.from_engine_json(engine, source=args.profile)
        results = [read_results(r) for r in args.results]
        segments = {f: read(f) for f in trace_files(args.traces)}  # each file read once, for both reports
        out = report(args.traces, profile, results, segments)
        if args.prompt_cost:
            from pdserve.bench.load import prompt_cost

            def under(path: str) -> list[dict]:  # the steps of the traces given as `path` (a file, or a folder)
                top = Path(path)
                return [s for f, segs in segments.items() if f == top or top in f.parents for _, ss in segs for s in ss]

            out["prompt_cost"] = {path: prompt_cost.report(under(path), engine) for path in args.traces}
    except (OSError, ValueError) as e:
        print(f"pdserve-bench trace: {e}", file=sys.stderr)
        return 2
    print(render(out))
    for path, cost in (out.get("prompt_cost") or {}).items():
        print(prompt_cost.render(path, cost))
    if args.out:
        from pdserve.bench.provenance import collect

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"provenance": collect([]), "traces": args.traces, **out}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-bench trace", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
