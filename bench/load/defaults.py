"""`pdserve-bench defaults`: is a default configuration the best one measured, within a margin?

    pdserve-bench defaults --from OUT/mixed/default --from OUT/mixed/chunk2048 ... --default default \\
        --reference unchunked --within 0.10 --out OUT/mixed

Reads each `pdserve-bench load --capacity-search` folder (results.json: each arm's capacity bracket, its
probes), and judges the default arm against every other on the brackets alone (MEASURING.md rule 12):

    an arm's capacity lies in [its highest passing rate, its lowest failing rate)
    "default >= (1 - within) x X" is shown when the default's passing rate >= (1 - within) x X's failing
        rate (X's capacity is below its failing rate); refuted when the default's failing rate is
        below (1 - within) x X's passing rate; else the brackets do not decide it (say so, and probe more)
    "default >= reference" (the unchunked worker) likewise, with no margin

An arm may come from several folders (its search, then more probes at chosen rates: bench/run_defaults_gpu.sh
MORE): one label is one configuration (the folders must share server flags, workload, SLOs and GPUs), its
bracket [highest pass, lowest fail) is taken over every folder's probes, and where a pass lies at or above a
fail (noise between runs) the arm's probes disagree: its bracket is not converged, both probes are named,
and no verdict against it is drawn ("not decided (probes disagree: ...)").

One topology per judgement: every arm must run the default's workers (server flags --prefill-workers,
--decode-workers, --colocated-workers, --no-colocated, with pdserve's defaults where not given) on the same
--devices; an arm of another topology is refused, with its folder named. A colocated worker's default is
judged against colocated arms, a prefill and decode worker pair's against pairs (bench/run_defaults_gpu.sh
judges its colocated arms into defaults.md and its pd-* arms into defaults-pd.md, `--name`).

Only the default needs a converged bracket: another arm needs one decisive probe, at the default's
capacity / (1 - within) (bench/run_defaults_gpu.sh starts each other arm's search there): failing it shows
the default within the margin of that arm, however far below the arm's capacity lies.

A verdict the brackets decide may still rest on a probe that passed or failed by about one request in a
binomial spread of its line (bench/load/probe_noise.py): such probes are marked in their rows, and the verdict
says when it rests on one (verdict.rests_on_noise, reference_rests_on_noise).

Writes NAME.json (every arm's bracket, probes, folders, server command, topology, the verdicts, provenance)
and NAME.md (the same as a table, with the command that made it); NAME is `--name`, defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from pathlib import Path

from pdserve.bench import provenance
from pdserve.bench.load import probe_noise
from pdserve.bench.load.report import read_results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_dirs", action="append", required=True, metavar="DIR",
                   help="a `pdserve-bench load --capacity-search` output folder (results.json or results.json.gz); "
                        "repeat per arm")
    p.add_argument("--default", required=True, help="the label of the arm that runs the default configuration")
    p.add_argument("--reference", default=None, help="an arm the default must not fall below (e.g. unchunked)")
    p.add_argument("--within", type=float, default=0.10, help="the margin to the best arm (default 0.10)")
    p.add_argument("--title", default=None, help="what the sweep compares, for the report's heading")
    p.add_argument("--out", required=True, help="folder for NAME.json and NAME.md")
    p.add_argument("--name", default="defaults", help="the verdict's file name, without .json or .md (default: "
                                                     "defaults)")


# What every folder of one arm must share for its probes to be one arm's (anything else is another configuration)
SAME = ("server flags", "workload", "SLOs", "goodput target", "GPUs")


def _server_flags(command: str | None) -> str:
    """The server's flags of a command line, less the interpreter, the port, the parent pid and the step trace's
    folder (where a run writes, not how it serves: each folder of an arm traces into its own)."""
    return re.sub(r"--(port|parent-pid|step-trace)[= ]\S+ ?", "",
                  (command or "").split("pdserve.server.cli", 1)[-1]).strip()


# pdserve's worker counts where its command gives none (server/cli.py, add_worker_arguments)
WORKER_COUNTS = {"--prefill-workers": 1, "--decode-workers": 1, "--colocated-workers": 1}


def topology(command: str | None) -> str:
    """The workers a server command starts and where, e.g. "1 prefill + 1 decode worker on cuda:0"; the last
    of a repeated flag counts, as in argparse."""
    if not command:
        return "unknown (no server command)"
    counts, devices = dict(WORKER_COUNTS), "(pdserve's default devices)"
    words = shlex.split(_server_flags(command))
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if not eq and i + 1 < len(words):
            value = words[i + 1]
        if name in counts:
            counts[name] = int(value)
        elif name == "--no-colocated":
            counts["--colocated-workers"] = 0
        elif name in ("--devices", "--device"):
            devices = value
    parts = [f"{n} {flag.removeprefix('--').removesuffix('-workers')}" for flag, n in counts.items() if n]
    return f"{' + '.join(parts) or 'no'} worker{'s' if sum(counts.values()) != 1 else ''} on {devices}"


def _folder_runs(d: str) -> list[dict]:
    """One record per arm of a `load --capacity-search` folder: its bracket, probes (each naming the folder)."""
    run = read_results(Path(d) / "results.json")  # or results.json.gz
    env = run.get("environment", {})
    out = []
    for arm in run["arms"]:
        cap = arm.get("capacity")
        if cap is None:
            raise ValueError(f"{d}: arm {arm['label']} has no capacity search (run load --capacity-search)")
        blocks = [b for b in run["results"] if b.get("arm") == arm["label"] and b.get("phase") == "probe"]
        server = arm.get("server") or {}
        out.append({
            "label": arm["label"], "folder": str(d), "command": server.get("command"),
            "startup_s": server.get("startup_s"), "environment": env, "topology": topology(server.get("command")),
            "low": cap["capacity_rate"], "high": cap["first_failing_rate"], "converged": cap["converged"],
            "precision": cap.get("precision", 0.1),
            "rests_on_cold": [{**c, "folder": str(d)} for c in cap.get("rests_on_cold") or []],
            "same": (_server_flags(server.get("command")), run.get("workload"), run.get("slos_ms"),
                     run.get("goodput_target"), (env.get("machine") or {}).get("gpus")),
            "probes": [{"rate": b["request_rate"], "passed": b.get("probe_passed"),
                        "goodput_fraction": b.get("goodput_fraction"), **probe_noise.counts(b),
                        "target": run.get("goodput_target"),
                        "queue_growing": bool((b.get("saturation") or {}).get("queue_growing")),
                        "stopped_early": bool(b.get("stopped_early")), "duration_s": b.get("duration"),
                        "repeated_warm": bool(b.get("repeated_warm")),
                        "ttft_p50_ms": b.get("median_ttft_ms"), "tpot_p99_ms": b.get("p99_tpot_ms"),
                        "folder": str(d)} for b in blocks],
        })
    return out


def merge(label: str, runs: list[dict]) -> dict:
    """One arm from every folder that measured it: its capacity lies in [the highest pass over all of them,
    the lowest fail over all of them). A pass at or above a fail is not hidden: `disagree` names both probes
    and the bracket is not converged."""
    first = runs[0]
    for r in runs[1:]:
        diff = [what for what, a, b in zip(SAME, first["same"], r["same"]) if a != b]
        if diff:
            raise ValueError(f"arm {label}: {first['folder']} and {r['folder']} differ in {', '.join(diff)}; "
                             f"one label is one configuration (give the other its own arm label)")
    passes = [r for r in runs if r["low"] is not None]
    fails = [r for r in runs if r["high"] is not None]
    top = max(passes, key=lambda r: r["low"]) if passes else None
    bottom = min(fails, key=lambda r: r["high"]) if fails else None
    low, high = (top or {}).get("low"), (bottom or {}).get("high")
    disagree = None
    if low is not None and high is not None and low >= high:
        disagree = {"passed": {"rate": low, "folder": top["folder"]},
                    "failed": {"rate": high, "folder": bottom["folder"]},
                    "reason": f"{label} passed {low:.4g} in {Path(top['folder']).name}, failed {high:.4g} in "
                              f"{Path(bottom['folder']).name}"}
    precision = max(r["precision"] for r in runs)
    converged = disagree is None and low is not None and high is not None and high / low - 1 <= precision + 1e-9
    cold = [c for r in runs for c in r["rests_on_cold"]
            if (c.get("run") == "capacity" and c.get("rate") == low)
            or (c.get("run") == "first failing" and c.get("rate") == high)]
    return {
        "label": label, "folder": first["folder"], "folders": [r["folder"] for r in runs],
        "command": first["command"], "startup_s": first["startup_s"], "topology": first["topology"],
        "low": low, "high": high, "converged": converged if len(runs) > 1 else first["converged"],
        "disagree": disagree, "rests_on_cold": cold if len(runs) > 1 else first["rests_on_cold"],
        "probes": [p for r in runs for p in r["probes"]],
        "environment": first["environment"],
        "runs": [{"folder": r["folder"], "low": r["low"], "high": r["high"], "converged": r["converged"],
                  "startup_s": r["startup_s"], "environment": r["environment"]} for r in runs],
    }


def arms_from(dirs: list[str]) -> dict[str, dict]:
    """label -> {capacity bracket, probes, server command, folder(s)} over every arm of every folder; the
    folders of one label (a search, then more probes of it: bench/run_defaults_gpu.sh MORE) are merged."""
    by_label: dict[str, list[dict]] = {}
    for d in dirs:
        for r in _folder_runs(d):
            by_label.setdefault(r["label"], []).append(r)
    out = {}
    for label, runs in by_label.items():
        # the earliest run first (its server and provenance head the arm), whatever order the folders came in
        runs.sort(key=lambda r: str(r["environment"].get("date_utc") or ""))
        out[label] = merge(label, runs)
    return out


def at_least(a: dict, b: dict, share: float) -> bool | None:
    """Is a's capacity >= share x b's? True/False when the brackets decide it, None when they do not."""
    a_low = a["low"] or 0.0
    b_high = b["high"] if b["high"] is not None else math.inf
    if a_low >= share * b_high:
        return True
    a_high = a["high"] if a["high"] is not None else math.inf
    if b["low"] is not None and a_high < share * b["low"]:
        return False
    return None


def _disagree(*arms: dict) -> str | None:
    """Why the brackets of these arms cannot be compared (a pass at or above a fail), or None."""
    why = [a["disagree"]["reason"] for a in arms if a.get("disagree")]
    return f"probes disagree: {'; '.join(why)}" if why else None


def judge(arms: dict[str, dict], default: str, reference: str | None, within: float) -> dict:
    if default not in arms:
        raise ValueError(f"no arm labelled {default!r} (have {', '.join(arms)})")
    if reference is not None and reference not in arms:
        raise ValueError(f"no arm labelled {reference!r} (have {', '.join(arms)})")
    d = arms[default]
    other: dict[str, list[str]] = {}  # topology -> the labels of the arms that run it, where not the default's
    for label, a in arms.items():
        if a["topology"] != d["topology"]:
            other.setdefault(a["topology"], []).append(label)
    if other:
        raise ValueError(
            f"the default ({default}) runs {d['topology']}, but " + "; ".join(
                f"{', '.join(sorted(labels))} {'runs' if len(labels) == 1 else 'run'} {where}"
                for where, labels in other.items())
            + ": a default is judged against arms of its own topology only; give each topology its own judgement "
              "(--from only its folders, --default its own default arm)")
    why = {label: _disagree(d, a) for label, a in arms.items() if label != default}
    why = {label: w for label, w in why.items() if w}
    vs = {label: None if label in why else at_least(d, a, 1 - within)
          for label, a in arms.items() if label != default}
    # the highest passing rate; among arms that share it, the highest first fail (none: higher still). No arm
    # passed a probe: none is best (the first arm in order was named so, whatever its fail)
    passed = [k for k in arms if arms[k]["low"]]
    best = max(passed, key=lambda k: (arms[k]["low"], arms[k]["high"] or math.inf), default=None)
    tied = sorted(k for k in passed if k != best and arms[k]["low"] == arms[best]["low"]) if best else []
    out = {
        "default": default, "topology": d["topology"], "within": within, "best_measured": best,
        "best_measured_ties": tied,
        "default_within_margin_of": vs,
        "default_within_margin_of_all": all(v is True for v in vs.values()) if vs else None,
        "undecided": sorted(k for k, v in vs.items() if v is None),
        "refuted_by": sorted(k for k, v in vs.items() if v is False),
        "probes_disagree": why,  # label -> why its verdict is undecided whatever the brackets say
        # label -> the probes its decided verdict rests on that lie within one binomial sd of their line
        "rests_on_noise": {k: near for k, v in vs.items() if (near := probe_noise.rests_on_noise(d, arms[k], v))},
    }
    if reference is not None:
        out["reference"] = reference
        out["reference_probes_disagree"] = _disagree(d, arms[reference])
        out["default_at_least_reference"] = None if out["reference_probes_disagree"] else \
            at_least(d, arms[reference], 1.0)
        out["reference_rests_on_noise"] = probe_noise.rests_on_noise(d, arms[reference],
                                                                     out["default_at_least_reference"])
    return out


def _floor2(x: float) -> float:
    return math.floor(x * 100) / 100


def _ceil2(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def next_probes(arms: dict[str, dict], verdict: dict) -> list[dict]:
    """The probes that could decide each comparison the brackets leave open (rates to 0.01 req/s, rounded the
    way that keeps them deciding), each inside its arm's open bracket (elsewhere it would decide nothing, or
    disagree with a probe already run) and not probed already, per comparison in this order:
      another arm X at the default's passing rate / share: a fail there shows the default within the margin;
      the default at share x X's failing rate: a pass there shows the same;
      the default just under share x X's passing rate: a fail there shows it more than the margin below;
      X just over the default's failing rate / share: a pass there shows the same;
      the default at X's passing rate, where the default has not failed yet (its bracket open above).
    Comparisons whose probes disagree are left out: a probe more adds a vote, and the brackets take none.
    bench/run_defaults_gpu.sh MORE=auto runs them."""
    d_label = verdict["default"]
    d = arms[d_label]
    asks = [(x, 1 - verdict["within"]) for x in verdict["undecided"] if x not in verdict["probes_disagree"]]
    if verdict.get("reference") and verdict.get("default_at_least_reference") is None \
            and not verdict.get("reference_probes_disagree"):
        asks.append((verdict["reference"], 1.0))
    out: list[dict] = []
    for x, share in asks:
        a = arms[x]
        a_low, a_high = a["low"] or 0.0, a["high"] if a["high"] is not None else math.inf
        d_low, d_high = d["low"] or 0.0, d["high"] if d["high"] is not None else math.inf

        def name(arm, rate, decides, low, high):  # a rate inside the arm's open bracket only: else it says nothing
            if low < rate < high:
                out.append({"arm": arm, "rate": rate, "decides": decides})

        if d["low"] is not None:
            name(x, _floor2(d_low / share), f"{d_label} >= {share:.0%} of {x} if it fails", a_low, a_high)
        if a["high"] is not None:
            name(d_label, _ceil2(share * a_high), f"{d_label} >= {share:.0%} of {x} if it passes", d_low, d_high)
        if a["low"] is not None:
            name(d_label, _floor2(share * a_low * 0.999), f"{d_label} below {share:.0%} of {x} if it fails",
                 d_low, d_high)
        if d["high"] is None and a["low"] is not None:
            name(d_label, _ceil2(a_low), f"nothing alone ({d_label}'s bracket is open above): a pass raises it "
                 f"to {x}'s passing rate", d_low, d_high)
        if d["high"] is not None:
            name(x, _ceil2(d_high / share * 1.001), f"{d_label} below {share:.0%} of {x} if it passes", a_low, a_high)
    seen, unique = set(), []
    for p in out:
        probed = any(abs(q["rate"] - p["rate"]) <= 0.002 * p["rate"] for q in arms[p["arm"]]["probes"])
        if (p["arm"], p["rate"]) not in seen and not probed:  # a rate probed already (to its rounding) says no more
            seen.add((p["arm"], p["rate"]))
            unique.append(p)
    return unique


def more_value(probes: list[dict]) -> str:
    """bench/run_defaults_gpu.sh's MORE for these probes: "arm:rate,rate other:rate"."""
    by: dict[str, list[str]] = {}
    for p in probes:
        by.setdefault(p["arm"], []).append(f"{p['rate']:g}")
    return " ".join(f"{arm}:{','.join(rates)}" for arm, rates in by.items())


def _rate(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _probes(a: dict) -> str:
    """Each probe as rate: pass/FAIL; an arm of several folders says which folder each came from."""
    def one(p):
        near = probe_noise.near_line(p)
        return (f"{p['rate']:.3g}: {'pass' if p['passed'] else 'FAIL'}{' (stopped)' if p['stopped_early'] else ''}"
                f"{' (cold, run again)' if p.get('repeated_warm') else ''}"
                + (f" (near the line: {near['within']} of {near['requests']})" if near else ""))
    if len(a.get("folders", [a["folder"]])) == 1:
        return ", ".join(one(p) for p in a["probes"])
    return "; ".join(f"{Path(f).name}: " + ", ".join(one(p) for p in a["probes"] if p.get("folder") == f)
                     for f in a["folders"])


def _provenance(label: str, a: dict) -> list[str]:
    runs = a.get("runs") or [a]
    out = []
    for r in runs:
        env = r["environment"]
        where = f" ({Path(r['folder']).name})" if len(runs) > 1 else ""
        out.append(f"- arm {label}{where}: commit {str(env.get('git_commit'))[:7]}"
                   f"{' (dirty)' if env.get('git_dirty') else ''}"
                   f", {(env.get('machine') or {}).get('gpus') or (env.get('machine') or {}).get('processor')}"
                   f", {env.get('date_utc')}, server ready in {r['startup_s'] or 0:.0f} s")
    return out


def render(arms: dict[str, dict], verdict: dict, title: str | None, command: str) -> str:
    d = verdict["default"]
    why = verdict.get("probes_disagree") or {}
    lines = [f"# Defaults check{': ' + title if title else ''}", "", f"- command: `{command}`",
             f"- every arm runs {verdict['topology']} (a default is judged against its own topology only)"]
    for label, a in arms.items():
        lines += _provenance(label, a)
    lines += ["", "| arm | capacity (req/s): highest pass | lowest fail | converged | probes (rate: pass/fail, "
              "stopped early) | default >= {:.0%} of it | server |".format(1 - verdict["within"]),
              "|---|---|---|---|---|---|---|"]
    for label, a in arms.items():
        mark = "(the default)" if label == d else {True: "yes", False: "**NO**", None: "undecided"}[
            verdict["default_within_margin_of"][label]] + (" (probes disagree)" if label in why else "")
        converged = "yes" if a["converged"] else "no (probes disagree)" if a.get("disagree") else "no"
        lines.append(f"| {label} | {_rate(a['low'])} | {_rate(a['high'])} | {converged} | "
                     f"{_probes(a)} | {mark} | `{_server_flags(a['command'])}` |")
    lines += ["", "**Verdict**:", ""]
    plain = [k for k in verdict["undecided"] if k not in why]
    if not verdict["default_within_margin_of"]:  # the default alone: a probe of it, nothing to compare
        said = "nothing to judge: no other arm of its topology was measured (a probe of the default alone)"
    elif verdict["refuted_by"]:
        said = f"**no**: more than {verdict['within']:.0%} below {', '.join(verdict['refuted_by'])}"
    elif verdict["undecided"]:
        parts = [f"not decided ({why[k]}) against {k}" for k in sorted(why)]
        if plain:
            parts.append(f"not decided: the brackets do not decide it against {', '.join(plain)} (probe more)")
        said = "; ".join(parts)
    else:
        said = "**yes**"
    lines.append(f"- the default ({d}) within {verdict['within']:.0%} of every arm's capacity: {said}")
    if "reference" in verdict:
        ref_why = verdict.get("reference_probes_disagree")
        lines.append(f"- the default at least the reference ({verdict['reference']}): "
                     + (f"not decided ({ref_why})" if ref_why else
                        {True: "**yes**", False: "**no**", None: "not decided by the brackets"}[
                            verdict["default_at_least_reference"]]))
    if verdict["default_within_margin_of"]:
        best, tied = verdict["best_measured"], verdict.get("best_measured_ties") or []
        lines.append("- the best measured (highest passing rate): " + (
            "none (no arm passed a probe)" if best is None else
            f"{best}, its passing rate shared by {', '.join(tied)} (the first fails decide the order)" if tied else
            best))
    if verdict.get("next_probes"):
        lines.append(f"- probes that would decide what is open (`MORE=\"{more_value(verdict['next_probes'])}\"`): "
                     + "; ".join(f"{p['arm']} at {p['rate']:g}: {p['decides']}" for p in verdict["next_probes"]))
    noisy = [p for k in sorted(verdict.get("rests_on_noise") or {}) for p in verdict["rests_on_noise"][k]]
    noisy += [p for p in verdict.get("reference_rests_on_noise") or [] if p not in noisy]
    if noisy:
        lines.append("- **decided on probes within noise**: " + "; ".join(
            f"{p['arm']} {'passed' if p['passed'] else 'failed'} {p['rate']:.3g} with {p['within']} of "
            f"{p['requests']} requests within the SLOs (line {p['line']:.1f}, binomial sd {p['sd']:.1f})"
            for p in noisy) + ": a verdict by less than one sd is a coin's call; probe again with more requests "
            "(bench/run_defaults_gpu.sh PROBE_MIN_REQUESTS, in a fresh RESULTS folder)")
    cold = [f"{k}: {c['run']} probe at {c['rate']:.3g}" for k, a in arms.items() for c in a["rests_on_cold"]]
    if cold:
        lines.append(f"- brackets resting on cold probes: {'; '.join(cold)}")
    lines += ["", "An arm's capacity lies between its highest passing and lowest failing probe (a probe passes with "
              ">= 90% of its requests within every SLO and no growing queue; each lasts --probe-seconds of "
              "arrivals). A probe marked stopped ended once that share could no longer be met "
              "(bench/load/early_stop.py); one marked cold, run again, failed while start-up effects still "
              "showed (bench/load/capacity.py) and the same rate's next run judged it. An arm measured in "
              "several folders (a search, then more probes) takes every folder's probes; where one passed at or above a rate another failed, its probes "
              "disagree (noise) and no verdict rests on it.", ""]
    return "\n".join(lines)


def run(args) -> int:
    try:
        arms = arms_from(args.from_dirs)
        verdict = judge(arms, args.default, args.reference, args.within)
        verdict["next_probes"] = next_probes(arms, verdict)
    except (ValueError, OSError, KeyError) as e:
        print(f"pdserve-bench defaults: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "pdserve-bench defaults " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "pdserve-bench defaults"
    doc = {"title": args.title, "arms": arms, "verdict": verdict, "command": command,
           "provenance": provenance.collect([])}
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    text = render(arms, verdict, args.title, command)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0
