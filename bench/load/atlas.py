"""`pdserve-bench atlas`: where disaggregation wins and where it loses, measured on one grid.

    pdserve-bench atlas --devices cuda:0 --server-args '--model qwen2.5-7b --devices cuda:0 --kv-memory-gb 16' \\
        --tokenizer qwen2.5-7b --rates 'short=2,4,8,12,16,24;long=0.5,1,2,3,4;mixed=1,2,4,6,8,12'

The grid: prompt profiles (short, long, mixed) x SLO pairs (tight: TTFT 2 s, TPOT 25 ms; loose: TTFT 2 s,
TPOT 100 ms; quick: TTFT 500 ms, TPOT 100 ms; smooth: TTFT 2 s, no gap between tokens over 100 ms) x offered
rates, for each arm on equal hardware: each arm its own fresh server, one after the
other (`pdserve-bench load --arm`), on the same seeded prompt lengths and arrival schedule. One GPU
(--devices cuda:0): a colocated worker alone vs a prefill and a decode worker sharing the GPU; two
(--devices cuda:0,cuda:1): two colocated workers vs prefill on one, decode on the other. --arm replaces
those (any server: the fake one in the tests).

Each (profile, arm) runs every rate of its grid once, each run >= --run-seconds (60) of Poisson arrivals
(at least --min-requests), judged for a growing queue (bench/load/capacity.py). An SLO pair changes only the
verdict, not the run, so every pair is judged on the same requests: a rate passes when >= --goodput-target
of its requests met both SLOs and its queue did not grow. An arm's capacity in a cell is the highest grid
rate below which every rate passed (its bracket: that rate and the first failing one); the cell's winner
is the arm with the higher capacity, "tie" when equal, "neither" when no arm passed the lowest rate; a cell
without a winner says why (bench/load/atlas_cells.py judges the cells). Where the machine's reach is unknown
(no GPU, or --rates auto) a short calibration run sets the rates first (bench/load/calibrate.py).

Writes atlas.json (the cells, every capacity and bracket, the runs' folders, provenance), atlas.md (the same
as a table) and atlas.png (the map: one square per cell, coloured by its winner, each arm's capacity written
in it) into --out, and each
profile's load run (results.json, summary.md, server logs) into --out/<profile>/.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import textwrap
from pathlib import Path

from pdserve.bench.load.atlas_cells import cells_of
from pdserve.bench.load.metrics import SLO_METRICS

PROFILES = {  # name -> the load bench's workload flags
    "short": ["--input-len", "uniform:128:512"],
    "long": ["--input-len", "uniform:4096:8192"],
    "mixed": ["--input-len", "uniform:256:1024", "--long-fraction", "0.25", "--long-input-len", "uniform:4096:8192"],
}
SLO_PAIRS = {"tight": {"ttft": 2000.0, "tpot": 25.0},  # a steady stream of tokens: decode free of prefill
             "loose": {"ttft": 2000.0, "tpot": 100.0},  # a chat service's limits
             "quick": {"ttft": 500.0, "tpot": 100.0},  # a fast first token: no queue, no transfer to wait for
             "smooth": {"ttft": 2000.0, "itl": 100.0}}  # no gap between two tokens over 100 ms: no stall for a prompt
DEFAULT_RATES = "short=2,4,8,12,16,24,32;long=0.5,1,2,3,4,6;mixed=1,2,4,6,8,12,16"


def _slo(text: str) -> tuple[str, dict[str, float]]:
    name, eq, spec = text.partition("=")
    try:
        pairs = dict(item.split(":") for item in spec.split(","))
        slos = {k.strip(): float(v) for k, v in pairs.items()}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"an SLO pair is NAME=ttft:MS,tpot:MS, got {text!r}") from e
    if not name.strip() or not set(slos) <= set(SLO_METRICS):
        raise argparse.ArgumentTypeError(f"an SLO pair is NAME=METRIC:MS,... with metrics of {', '.join(SLO_METRICS)}, "
                                         f"got {text!r}")
    return name.strip(), slos


def parse_rates(text: str, profiles: list[str]) -> dict[str, list[float]]:
    """'1,2,4' for every profile, or 'short=2,4;long=0.5,1' per profile (each listed profile needs one)."""
    def floats(s: str) -> list[float]:
        values = sorted(float(x) for x in s.split(",") if x.strip())
        if not values or any(v <= 0 for v in values):
            raise ValueError(f"rates must be > 0, got {s!r}")
        return values
    if "=" not in text:
        return {p: floats(text) for p in profiles}
    per = {k.strip(): floats(v) for k, _, v in (part.partition("=") for part in text.split(";") if part.strip())}
    missing = [p for p in profiles if p not in per]
    if missing:
        raise ValueError(f"--rates has no rates for profile(s) {missing}")
    return {p: per[p] for p in profiles}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", default="cuda:0", help="one device (colocated alone vs P and D sharing it) or two "
                                                       "(two colocated vs 1P1D); ignored with --arm")
    p.add_argument("--arm", action="append", default=None, metavar="LABEL=POLICY:FLAGS",
                   help="the arms instead (as pdserve-bench load --arm)")
    p.add_argument("--server-args", default="", help="flags for every arm's server, e.g. '--model qwen2.5-7b ...'")
    p.add_argument("--server-command", default=None, help="what starts a server (default: pdserve)")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--profiles", default="short,long,mixed", help=f"of {', '.join(PROFILES)} (or --profile's)")
    p.add_argument("--profile", action="append", default=None, metavar="NAME=LOAD_FLAGS",
                   help="define or redefine a profile by its load-bench workload flags, e.g. "
                        "\"long=--input-len uniform:1024:2048\" (a small model's context is shorter)")
    p.add_argument("--output-len", default="64")
    p.add_argument("--slo", type=_slo, action="append", default=None, metavar="NAME=ttft:MS,tpot:MS",
                   help="an SLO pair (repeat; default tight=ttft:2000,tpot:25, loose=ttft:2000,tpot:100, "
                        "quick=ttft:500,tpot:100 and smooth=ttft:2000,itl:100, ITL a request's longest gap)")
    p.add_argument("--rates", default=None,
                   help="req/s: '1,2,4', per profile 'short=2,4;long=1,2', or 'auto': a short run of every arm per "
                        "profile first, and rates from LOW x the slowest arm's throughput to HIGH x the fastest's "
                        "(bench/load/calibrate.py; cells no arm can meet are refused with the reason). Default: "
                        f"auto on a machine without a GPU (or --devices cpu), else {DEFAULT_RATES}")
    p.add_argument("--max-minutes", type=float, default=math.inf,
                   help="refuse a grid whose least time (arrivals, queues drained, server starts) is longer")
    p.add_argument("--run-seconds", type=float, default=60.0, help="seconds of arrivals per run, at least")
    p.add_argument("--min-requests", type=int, default=24, help="requests per run, at least")
    p.add_argument("--goodput-target", type=float, default=0.9)
    p.add_argument("--tokenizer", default=None, help="count prompt tokens exactly (the model's name)")
    p.add_argument("--warmup-batch", type=int, default=4)
    p.add_argument("--warmup-max-batches", type=int, default=4)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default bench/results/atlas-<date>/)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from", dest="from_dirs", action="append", default=None, metavar="DIR",
                   help="measure nothing: build the atlas from earlier atlas --out folders (repeat; e.g. one "
                        "per arm, each run on its own; a profile's runs must share their workload and seed)")


def default_arms(devices: str) -> list[str]:
    n = len([d for d in devices.split(",") if d.strip()])
    if n not in (1, 2):
        raise ValueError(f"--devices lists one device or two, got {devices!r}")
    colocated = f"--prefill-workers 0 --decode-workers 0 --colocated-workers {n}"
    return [f"colocated=colocated:{colocated}", "disaggregated=disaggregated:--no-colocated --prefill-workers 1 "
            "--decode-workers 1"]


def profiles_of(args) -> dict[str, list[str]]:
    out = dict(PROFILES)
    for spec in args.profile or []:
        name, eq, flags = spec.partition("=")
        if not eq or not name.strip() or not flags.strip():
            raise ValueError(f"a profile is NAME=LOAD_FLAGS, got {spec!r}")
        out[name.strip()] = shlex.split(flags)
    return out


def common_flags(args) -> list[str]:
    """The load bench's flags every run of the atlas shares: the servers, the output length, the seed."""
    argv = ["--server-args", args.server_args, "--server-timeout", str(args.server_timeout),
            "--request-timeout", str(args.request_timeout), "--output-len", args.output_len, "--seed", str(args.seed)]
    if args.server_command:
        argv += ["--server-command", args.server_command]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    return argv


def load_argv(args, flags: list[str], rates: list[float], arms: list[str], out: Path) -> list[str]:
    return [*(x for arm in arms for x in ("--arm", arm)), *common_flags(args), *flags,
            "--request-rates", ",".join(f"{r:g}" for r in rates), "--run-seconds", str(args.run_seconds),
            "--num-prompts", str(args.min_requests), "--burstiness", str(args.burstiness),
            "--warmup-batch", str(args.warmup_batch), "--warmup-max-batches", str(args.warmup_max_batches),
            "--out", str(out), "--no-progress", "--no-plots"]


def _cap_text(c: dict) -> str:
    if c["capacity_rate"] is None:
        return f"< {c['runs'][0]['rate']:g}" if c["runs"] else "no runs"
    return ("≥ " if c["at_least"] else "") + f"{c['capacity_rate']:g}"


def markdown(atlas: dict) -> str:
    """The cells as a table: each arm's capacity and bracket, the winner; where the grid ran out, said so."""
    arms = atlas["arms"]
    lines = [f"# Crossover atlas ({atlas['hardware']})", "",
             f"Capacity: the highest grid rate up to which every run met the SLOs (>= {atlas['goodput_target']:.0%} "
             "of requests) with a steady queue; [that rate, the first failing one]. '>=': no grid rate failed; "
             "'<': the lowest failed.", "",
             "| profile | SLOs | winner | " + " | ".join(f"{a} (req/s)" for a in arms) + " |",
             "|---|---|---|" + "---|" * len(arms)]
    notes: list[str] = []
    for c in atlas["cells"]:
        slos = ", ".join(f"{k} {v:g} ms" for k, v in c["slos_ms"].items())
        caps = [c["capacities"].get(a) for a in arms]
        if c.get("why"):
            notes.append(f"- {c['profile']} x {c['slo']}: **{c['winner']}**: {c['why']}")
        cols = ["-" if cap is None else f"{_cap_text(cap)} [" + ", ".join("-" if r is None else f"{r:g}"
                                                                          for r in cap["bracket"]) + "]"
                for cap in caps]
        lines.append(f"| {c['profile']} | {c['slo']}: {slos} | {c['winner']} | " + " | ".join(cols) + " |")
    if notes:
        lines += ["", "Why no arm won:", "", *notes]
    if atlas.get("calibration"):
        lines += ["", f"Rates: {atlas['calibration']['note']}"]
    lines += ["", "Workloads: " + "; ".join(f"{p}: {w}" for p, w in atlas["profiles"].items()),
              f"Command: `{atlas['command']}`"]
    return "\n".join(lines) + "\n"


def plot_map(atlas: dict, path: Path) -> Path:
    from pdserve.bench.load.plots import save  # first: it puts matplotlib on the Agg backend

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    profiles = list(dict.fromkeys(c["profile"] for c in atlas["cells"]))
    slo_names = list(dict.fromkeys(c["slo"] for c in atlas["cells"]))
    arms = atlas["arms"]
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]
    colors = {arm: palette[i % len(palette)] for i, arm in enumerate(arms)} | {"tie": "#BBBBBB",
                                                                               "neither": "#FFFFFF"}
    fig, ax = plt.subplots(figsize=(2.8 + 2.6 * len(slo_names), 1.2 + 1.5 * len(profiles)))
    for c in atlas["cells"]:
        x, y = slo_names.index(c["slo"]), len(profiles) - 1 - profiles.index(c["profile"])
        ax.add_patch(plt.Rectangle((x, y), 1, 1, facecolor=colors[c["winner"]], edgecolor="black", alpha=0.85))
        lines = [c["winner"]] + [f"{arm}: {_cap_text(c['capacities'][arm])}" for arm in arms
                                 if arm in c["capacities"]]
        if c.get("why"):
            lines.append(textwrap.fill(c["why"], 34, max_lines=4, placeholder=" ... (atlas.md)"))
        ax.text(x + 0.5, y + 0.5, "\n".join(lines), ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(slo_names))
    ax.set_ylim(0, len(profiles))
    ax.set_xticks([i + 0.5 for i in range(len(slo_names))])
    ax.set_xticklabels([f"{n}\n" + ", ".join(f"{k} {v:g} ms" for k, v in atlas["slos"][n].items())
                        for n in slo_names], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(profiles))])
    ax.set_yticklabels(profiles[::-1])
    ax.set_title(f"which arm meets the SLOs (>= {atlas['goodput_target']:.0%}, queue steady) at the higher rate\n"
                 f"capacity in req/s on the rate grid; {atlas.get('hardware') or ''}", fontsize=9)
    ax.legend(handles=[Patch(facecolor=colors[k], edgecolor="black", label=k) for k in [*arms, "tie", "neither"]],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return save(fig, path, dpi=120)


def merge_runs(dirs: list[str]) -> dict[str, dict]:
    """profile -> one results.json-like dict holding every arm found for it under DIR/<profile>/."""
    from pdserve.bench.load.report import read_results, results_files

    merged: dict[str, dict] = {}
    for d in dirs:
        found = results_files(d)
        if not found:
            raise ValueError(f"{d}: no <profile>/results.json (or .json.gz) under it (an atlas --out folder)")
        for path in found:
            run, profile = read_results(path), path.parent.name
            if profile not in merged:
                merged[profile] = {**run, "arms": list(run["arms"]), "results": list(run["results"])}
                continue
            into = merged[profile]
            mine, theirs = (into["workload"], into["args"].get("seed")), (run["workload"], run["args"].get("seed"))
            if mine != theirs:
                raise ValueError(f"{path}: profile {profile} was run with another workload or seed ({theirs} vs "
                                 f"{mine}): its arms are not comparable")
            clash = {a["label"] for a in run["arms"]} & {a["label"] for a in into["arms"]}
            if clash:
                raise ValueError(f"{path}: arm(s) {sorted(clash)} of profile {profile} appear twice")
            into["arms"] += run["arms"]
            into["results"] += run["results"]
    return merged


def run(args) -> int:
    from pdserve.bench.load.report import environment, write_json

    if args.from_dirs:
        try:
            runs = merge_runs(args.from_dirs)
        except (ValueError, OSError, KeyError) as e:
            print(f"pdserve-bench atlas: {e}", file=sys.stderr)
            return 2
        profiles = {p: r["workload"] for p, r in runs.items()}
        rates = {p: sorted({b["request_rate"] for b in r["results"] if b["phase"] == "point"}) for p, r in runs.items()}
        return _write(args, runs, {}, profiles, rates, [a["server"]["command"] if "server" in a else a["label"]
                                                         for r in runs.values() for a in r["arms"]],
                      environment(), write_json)
    return _measure(args)


def _measure(args) -> int:
    from pdserve.bench.load import calibrate, generator
    from pdserve.bench.load.report import environment, read_results, results_file, write_json

    env = environment()
    try:
        defined = profiles_of(args)
        profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
        unknown = [p for p in profiles if p not in defined]
        if unknown or not profiles:
            raise ValueError(f"unknown profile(s) {unknown}; choose from {', '.join(defined)} or define one "
                             "with --profile NAME=LOAD_FLAGS")
        auto = args.rates == "auto" or (args.rates is None and calibrate.on_cpu(args.devices, env["machine"]["gpus"]))
        rates = {} if auto else parse_rates(args.rates or DEFAULT_RATES, profiles)
        arms = args.arm or default_arms(args.devices)
        slos = dict(args.slo) if args.slo else SLO_PAIRS
        if args.run_seconds < 0 or args.min_requests < 1 or not 0 < args.goodput_target <= 1:
            raise ValueError("need --run-seconds >= 0, --min-requests >= 1, 0 < --goodput-target <= 1")
    except ValueError as e:
        print(f"pdserve-bench atlas: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("bench") / "results" / f"atlas-{env['date']}"
    out.mkdir(parents=True, exist_ok=True)
    calibration, reach = None, {}
    if auto:
        try:
            calibration = calibrate.calibrate({p: defined[p] for p in profiles}, arms, slos, common_flags(args),
                                              out / "calibration", generator.main)
        except calibrate.Unreachable as e:
            print(f"pdserve-bench atlas: refused: {e}", file=sys.stderr)
            return 2
        rates = {p: c["rates"] for p, c in calibration["profiles"].items() if c["rates"]}
        reach = {p: c["reach"] for p, c in calibration["profiles"].items()}
    least = sum(calibrate.minutes(rates[p], reach.get(p) or {a: {"throughput": None} for a in arms},
                                  args.run_seconds, args.min_requests) for p in rates)
    print(f"atlas: {sum(map(len, rates.values()))} rates x {len(arms)} arms, at least {least:.0f} minutes",
          file=sys.stderr)
    if least > args.max_minutes:
        print(f"pdserve-bench atlas: refused: the grid needs at least {least:.0f} minutes (--max-minutes "
              f"{args.max_minutes:g}); give fewer --rates or --profiles, or a shorter --run-seconds", file=sys.stderr)
        return 2
    runs, codes = {}, {}
    for profile in rates:
        argv = load_argv(args, defined[profile], rates[profile], arms, out / profile)
        print(f"atlas: {profile}: pdserve-bench load {shlex.join(argv)}", file=sys.stderr)
        codes[profile] = generator.main(argv)
        results = results_file(out / profile)
        if results is not None:
            runs[profile] = read_results(results)
    if not runs:
        print("pdserve-bench atlas: no profile produced results (see the load runs' errors above)", file=sys.stderr)
        return 1
    described = {p: shlex.join(defined[p]) + f" --output-len {args.output_len}" for p in profiles}
    return _write(args, runs, codes, described, rates, arms, env, write_json, calibration)


def hardware(runs: dict[str, dict], env: dict) -> str:
    """The devices the arms' servers were given (--devices in their commands) and the GPUs seen."""
    devices = sorted({m.group(1) for r in runs.values() for a in r["arms"]
                      for m in [re.search(r"--devices (\S+)", (a.get("server") or {}).get("command", ""))] if m})
    gpus = (env.get("machine") or {}).get("gpus")
    gpus = gpus if isinstance(gpus, str) and "not found" not in gpus.lower() else None
    text = f"server devices {', '.join(devices)}" if devices else "devices as the arms' servers chose"
    return text + (f" ({gpus.splitlines()[0].split(',')[0]})" if gpus else "")


def _write(args, runs, codes, profiles, rates, arms, env, write_json, calibration: dict | None = None) -> int:
    out = Path(args.out) if args.out else Path("bench") / "results" / f"atlas-{env['date']}"
    out.mkdir(parents=True, exist_ok=True)
    slos = dict(args.slo) if args.slo else SLO_PAIRS
    labels = list(dict.fromkeys(a["label"] for r in runs.values() for a in r["arms"]))
    # profiles calibrated but not measured: every SLO pair refused, each cell says why
    refused = {p: c["refused"] for p, c in (calibration or {}).get("profiles", {}).items() if p not in runs}
    atlas = {"benchmark": "atlas", "environment": env, "command": shlex.join(["pdserve-bench", "atlas",
                                                                               *sys.argv[2:]]),
             "hardware": hardware(runs, env),
             "arms": labels, "arm_specs": arms, "server_args": args.server_args, "slos": slos,
             "goodput_target": args.goodput_target,
             "run_seconds": None if args.from_dirs else args.run_seconds,
             "min_requests": None if args.from_dirs else args.min_requests, "rates": rates, "profiles": profiles,
             "runs": {p: f"{p}/results.json" for p in runs} if not args.from_dirs else
             {p: "merged from " + ", ".join(args.from_dirs) for p in runs},
             "shortest_run_arrivals_s": {p: min((b.get("arrival_window_s") or 0.0 for b in r["results"]
                                                 if b["phase"] == "point"), default=None) for p, r in runs.items()},
             "load_exit_codes": codes, "calibration": calibration,
             "cells": cells_of(runs, slos, args.goodput_target, refused)}
    if not args.no_plot:
        atlas["plot"] = plot_map(atlas, out / "atlas.png").name
    write_json(out / "atlas.json", atlas)
    (out / "atlas.md").write_text(markdown(atlas))
    for c in atlas["cells"]:
        caps = ", ".join(f"{arm} {_cap_text(cap)}" for arm, cap in c["capacities"].items())
        print(f"{c['profile']:>6} x {c['slo']:<6} winner {c['winner']:<14} ({caps or 'not measured'} req/s)"
              + (f": {c['why']}" if c.get("why") else ""))
    print(f"atlas in {out}/", file=sys.stderr)
    return 0 if all(code == 0 for code in codes.values()) else 1
