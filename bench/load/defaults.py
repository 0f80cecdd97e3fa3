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

Only the default needs a converged bracket: another arm needs one decisive probe, at the default's
capacity / (1 - within) (bench/run_defaults_gpu.sh starts each other arm's search there): failing it shows
the default within the margin of that arm, however far below the arm's capacity lies.

Writes defaults.json (every arm's bracket, probes, server command, the verdicts, provenance) and
defaults.md (the same as a table, with the command that made it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from pdserve.bench import provenance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_dirs", action="append", required=True, metavar="DIR",
                   help="a `pdserve-bench load --capacity-search` output folder (results.json); repeat per arm")
    p.add_argument("--default", required=True, help="the label of the arm that runs the default configuration")
    p.add_argument("--reference", default=None, help="an arm the default must not fall below (e.g. unchunked)")
    p.add_argument("--within", type=float, default=0.10, help="the margin to the best arm (default 0.10)")
    p.add_argument("--title", default=None, help="what the sweep compares, for the report's heading")
    p.add_argument("--out", required=True, help="folder for defaults.json and defaults.md")


def arms_from(dirs: list[str]) -> dict[str, dict]:
    """label -> {capacity bracket, probes, server command, folder} over every arm of every folder."""
    out: dict[str, dict] = {}
    for d in dirs:
        run = json.loads((Path(d) / "results.json").read_text())
        for arm in run["arms"]:
            cap = arm.get("capacity")
            if cap is None:
                raise ValueError(f"{d}: arm {arm['label']} has no capacity search (run load --capacity-search)")
            if arm["label"] in out:
                raise ValueError(f"arm {arm['label']} appears twice ({out[arm['label']]['folder']} and {d})")
            probes = [b for b in run["results"] if b.get("arm") == arm["label"] and b.get("phase") == "probe"]
            out[arm["label"]] = {
                "folder": str(d), "command": (arm.get("server") or {}).get("command"),
                "startup_s": (arm.get("server") or {}).get("startup_s"),
                "low": cap["capacity_rate"], "high": cap["first_failing_rate"], "converged": cap["converged"],
                "rests_on_cold": cap.get("rests_on_cold") or [],
                "probes": [{"rate": b["request_rate"], "passed": b.get("probe_passed"),
                            "goodput_fraction": b.get("goodput_fraction"),
                            "stopped_early": bool(b.get("stopped_early")), "duration_s": b.get("duration"),
                            "ttft_p50_ms": b.get("median_ttft_ms"), "tpot_p99_ms": b.get("p99_tpot_ms")}
                           for b in probes],
                "environment": run.get("environment", {}),
            }
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


def judge(arms: dict[str, dict], default: str, reference: str | None, within: float) -> dict:
    if default not in arms:
        raise ValueError(f"no arm labelled {default!r} (have {', '.join(arms)})")
    if reference is not None and reference not in arms:
        raise ValueError(f"no arm labelled {reference!r} (have {', '.join(arms)})")
    d = arms[default]
    vs = {label: at_least(d, a, 1 - within) for label, a in arms.items() if label != default}
    best = max(arms, key=lambda k: (arms[k]["low"] or 0.0, -(arms[k]["high"] or math.inf)))
    out = {
        "default": default, "within": within, "best_measured": best,
        "default_within_margin_of": vs,
        "default_within_margin_of_all": all(v is True for v in vs.values()) if vs else None,
        "undecided": sorted(k for k, v in vs.items() if v is None),
        "refuted_by": sorted(k for k, v in vs.items() if v is False),
    }
    if reference is not None:
        out["reference"] = reference
        out["default_at_least_reference"] = at_least(d, arms[reference], 1.0)
    return out


def _rate(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def render(arms: dict[str, dict], verdict: dict, title: str | None, command: str) -> str:
    d = verdict["default"]
    lines = [f"# Defaults check{': ' + title if title else ''}", "", f"- command: `{command}`"]
    for label, a in arms.items():
        env = a["environment"]
        lines.append(f"- arm {label}: commit {str(env.get('git_commit'))[:7]}{' (dirty)' if env.get('git_dirty') else ''}"
                     f", {(env.get('machine') or {}).get('gpus') or (env.get('machine') or {}).get('processor')}"
                     f", {env.get('date_utc')}, server ready in {a['startup_s'] or 0:.0f} s")
    lines += ["", "| arm | capacity (req/s): highest pass | lowest fail | converged | probes (rate: pass/fail, "
              "stopped early) | default >= {:.0%} of it | server |".format(1 - verdict["within"]),
              "|---|---|---|---|---|---|---|"]
    for label, a in arms.items():
        probes = ", ".join(f"{p['rate']:.3g}: {'pass' if p['passed'] else 'FAIL'}{' (stopped)' if p['stopped_early'] else ''}"
                           for p in a["probes"])
        mark = "(the default)" if label == d else {True: "yes", False: "**NO**", None: "undecided"}[
            verdict["default_within_margin_of"][label]]
        flags = re.sub(r"--(port|parent-pid) \S+ ", "", (a["command"] or "").split("pdserve.server.cli", 1)[-1]).strip()
        lines.append(f"| {label} | {_rate(a['low'])} | {_rate(a['high'])} | {'yes' if a['converged'] else 'no'} | "
                     f"{probes} | {mark} | `{flags}` |")
    lines += ["", "**Verdict**:", ""]
    if verdict["refuted_by"]:
        said = f"**no**: below {verdict['within']:.0%} of {', '.join(verdict['refuted_by'])}"
    elif verdict["undecided"]:
        said = f"not decided: the brackets do not decide it against {', '.join(verdict['undecided'])} (probe more)"
    else:
        said = "**yes**"
    lines.append(f"- the default ({d}) within {verdict['within']:.0%} of every arm's capacity: {said}")
    if "reference" in verdict:
        lines.append(f"- the default at least the reference ({verdict['reference']}): "
                     + {True: "**yes**", False: "**no**", None: "not decided by the brackets"}[
                         verdict["default_at_least_reference"]])
    lines.append(f"- the best measured (highest passing rate): {verdict['best_measured']}")
    cold = [f"{k}: {c['run']} probe at {c['rate']:.3g}" for k, a in arms.items() for c in a["rests_on_cold"]]
    if cold:
        lines.append(f"- brackets resting on cold probes: {'; '.join(cold)}")
    lines += ["", "An arm's capacity lies between its highest passing and lowest failing probe (a probe passes with "
              ">= 90% of its requests within every SLO and no growing queue; each lasts --probe-seconds of "
              "arrivals). A probe marked stopped ended once that share could no longer be met "
              "(bench/load/early_stop.py).", ""]
    return "\n".join(lines)


def run(args) -> int:
    try:
        arms = arms_from(args.from_dirs)
        verdict = judge(arms, args.default, args.reference, args.within)
    except (ValueError, OSError, KeyError) as e:
        print(f"pdserve-bench defaults: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "pdserve-bench defaults " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "pdserve-bench defaults"
    doc = {"title": args.title, "arms": arms, "verdict": verdict, "command": command,
           "provenance": provenance.collect([])}
    (out / "defaults.json").write_text(json.dumps(doc, indent=2))
    text = render(arms, verdict, args.title, command)
    (out / "defaults.md").write_text(text)
    print(text)
    return 0
