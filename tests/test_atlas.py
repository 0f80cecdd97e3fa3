"""The crossover atlas (bench/load/atlas.py) end to end on fake servers whose trade is known: arm "colo" prefills
fast (10 ms + 0.01 ms a word: ~95 req/s at 50-word prompts, ~50 at 1000) but decodes at 20 ms a token, arm
"disagg" prefills at less than half the speed (25 ms + 0.025: ~38 and ~20 req/s) and decodes at 2 ms. A tight
TPOT (12 ms) only disagg meets; under a loose one (80 ms) colo's faster prefill serves the higher rate.
Near-periodic arrivals (burstiness 50): a seeded Poisson draw of 15 requests can come ~30% slower than its rate.
Each grid's top rate is about half colo's capacity and 1.2-1.3x disagg's (short 48/s, long 24/s), each run a second
of arrivals: with 0.5-s runs at 60 and 30/s (60-63% of colo's capacity) a stall of the 2-core machine in three of
five clean-clone runs left colo's top run queued (ITL p99 115-243 ms, its lateness growing) and a loose cell a
tie; a stall of that length is a fifth of a run here, and colo drains its queue at half its capacity."""

import json
import os
import sys
from pathlib import Path

import pytest

from pdserve.bench import cli
from pdserve.bench.load.atlas import parse_rates
from pdserve.bench.load.atlas_cells import capacity_on_grid, why_no_winner, winner

FAKE = f"{sys.executable} -m pdserve.bench.load.fake_server --port 0"


@pytest.mark.alone  # a fake server's latencies against SLOs: a neighbour's CPU burst reads as load
def test_the_atlas_maps_which_arm_wins_each_cell(tmp_path):
    out = tmp_path / "atlas"
    rc = cli.main(["atlas", "--server-command", FAKE,
                   "--arm", "colo=colocated:--itl-ms 20 --prefill-ms-per-request 10 --prefill-ms-per-token 0.01",
                   "--arm", "disagg=disaggregated:--itl-ms 2 --prefill-ms-per-request 25 --prefill-ms-per-token 0.025 "
                            "--transfer-ms-per-token 0",
                   "--profile", "short=--input-len 50", "--profile", "long=--input-len 1000", "--profiles", "short,long",
                   "--rates", "short=24,48;long=12,24", "--output-len", "3",
                   "--slo", "tight=ttft:500,tpot:12", "--slo", "loose=ttft:500,tpot:80",
                   "--run-seconds", "1", "--min-requests", "12", "--burstiness", "50", "--warmup-batch", "0",
                   "--out", str(out)])
    assert rc == 0
    atlas = json.loads((out / "atlas.json").read_text())
    assert atlas["arms"] == ["colo", "disagg"] and (out / "short" / "results.json").is_file()
    assert (out / "atlas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = {(c["profile"], c["slo"]): c for c in atlas["cells"]}
    assert set(cells) == {("short", "tight"), ("short", "loose"), ("long", "tight"), ("long", "loose")}
    for profile in ("short", "long"):
        tight, loose = cells[(profile, "tight")], cells[(profile, "loose")]
        assert tight["winner"] == "disagg" and tight["capacities"]["colo"]["capacity_rate"] is None
        assert loose["winner"] == "colo", loose
    # every grid rate below capacity passes, the one past it fails on its growing queue
    for profile, low, high in (("short", 24, 48), ("long", 12, 24)):
        caps = cells[(profile, "loose")]["capacities"]
        assert caps["colo"]["capacity_rate"] == high and caps["colo"]["at_least"]
        assert caps["disagg"]["bracket"] == [low, high]
        failing = next(r for r in caps["disagg"]["runs"] if r["rate"] == high)
        assert failing["queue_growing"] and not failing["passed"]
        assert cells[(profile, "tight")]["capacities"]["disagg"]["capacity_rate"] == low
        for run in caps["disagg"]["runs"]:  # every run >= 1 s of arrivals, or 12 requests
            assert run["requests"] == max(12, -(-run["rate"] * 1 // 1))
    assert atlas["profiles"]["long"] == "--input-len 1000 --output-len 3"
    md = (out / "atlas.md").read_text()
    assert "| short | tight: ttft 500 ms, tpot 12 ms | disagg | < 24 [-, 24] | 24 [24, 48] |" in md
    assert atlas["shortest_run_arrivals_s"]["short"] >= 0.9  # 24 requests at 24/s: 23 gaps

    # the same runs judged again under other SLOs, nothing measured: one arm per folder merges the same way
    again = tmp_path / "again"
    assert cli.main(["atlas", "--from", str(out), "--slo", "any=ttft:100000,tpot:100000", "--out", str(again)]) == 0
    merged = json.loads((again / "atlas.json").read_text())
    assert [c["winner"] for c in merged["cells"]] == ["colo", "colo"]  # the faster prefill, once TPOT is free
    assert merged["rates"] == {"short": [24, 48], "long": [12, 24]} and merged["run_seconds"] is None
    assert cli.main(["atlas", "--from", str(out), "--from", str(out), "--out", str(again)]) == 2  # arms twice


def test_grid_capacity_and_winner():
    runs = [{"rate": r, "passed": p} for r, p in ((1, True), (2, True), (4, False), (8, True))]
    cap = capacity_on_grid(runs)
    assert cap["capacity_rate"] == 2 and cap["bracket"] == [2, 4] and not cap["at_least"]
    assert capacity_on_grid([{"rate": 1, "passed": False}])["capacity_rate"] is None
    assert capacity_on_grid([{"rate": 1, "passed": True}])["at_least"]
    assert winner({"a": {"capacity_rate": 2}, "b": {"capacity_rate": 4}}) == "b"
    assert winner({"a": {"capacity_rate": 2}, "b": {"capacity_rate": 2}}) == "tie"
    assert winner({"a": {"capacity_rate": None}, "b": {"capacity_rate": None}}) == "neither"
    # a tie because the grid ran out says so; a tie at a rate both failed above is an answer
    top = capacity_on_grid([{"rate": 1, "passed": True}])
    assert "the grid ran out" in why_no_winner({"a": top, "b": top}, {"ttft": 1.0}, 0.9)
    capped = capacity_on_grid(runs)
    assert why_no_winner({"a": capped, "b": capped}, {"ttft": 1.0}, 0.9) is None
    assert parse_rates("1,4,2", ["short"]) == {"short": [1, 2, 4]}
    assert parse_rates("short=1;long=2,3", ["long"]) == {"long": [2, 3]}
    assert cli.main(["atlas", "--profiles", "huge"]) == 2


# ---- a machine of unknown reach: rates measured first, and no cell left empty without a reason -----------------

COLO = "colo=colocated:--itl-ms 2 --prefill-ms-per-request 10 --prefill-ms-per-token 0.01"
DISAGG = ("disagg=disaggregated:--itl-ms 2 --prefill-ms-per-request 25 --prefill-ms-per-token 0.025 "
          "--transfer-ms-per-token 0")


def atlas_argv(out, *extra) -> list[str]:
    return ["atlas", "--server-command", FAKE, "--arm", COLO, "--arm", DISAGG, "--profile", "short=--input-len 50",
            "--profiles", "short", "--output-len", "3", "--run-seconds", "0.5", "--min-requests", "8",
            "--burstiness", "50", "--warmup-batch", "0", "--out", str(out), *extra]


@pytest.mark.alone  # its winner rests on the fakes' latencies against the SLOs, as above
def test_rates_auto_are_set_from_a_measured_calibration(tmp_path):
    """--rates auto (the default without a GPU): a short closed-loop run per arm first; the grid spans from below
    the slower arm's throughput to past the faster's, so the map has a winner (colo prefills 2.5 times as fast:
    the grid's third rate, ~1.5x disagg's throughput, is well past disagg's capacity and half colo's)."""
    from pdserve.bench.load import calibrate

    out = tmp_path / "atlas"
    assert cli.main(atlas_argv(out, "--rates", "auto", "--slo", "loose=ttft:1000,tpot:80")) == 0
    atlas = json.loads((out / "atlas.json").read_text())
    reach = calibrate.reach(json.loads((out / "calibration" / "short" / "results.json").read_text()))
    thr = {arm: r["throughput"] for arm, r in reach.items()}
    assert thr["colo"] > thr["disagg"] > 0
    rates = atlas["rates"]["short"]
    assert rates == calibrate.grid(reach) and len(rates) == 4
    assert rates[0] <= calibrate.LOW * thr["disagg"] * 1.1 and rates[-1] >= calibrate.HIGH * thr["colo"] * 0.9
    [cell] = atlas["cells"]
    assert cell["winner"] == "colo" and cell["why"] is None
    assert "calibrated on this machine" in (out / "atlas.md").read_text()


def test_slos_no_arm_can_meet_are_refused_before_the_grid(tmp_path, capsys):
    """Every request sent alone takes >= 10 ms to its first token: a 5 ms TTFT SLO cannot be met at any rate, so
    the atlas stops after the calibration, saying so, instead of running the grid into an empty map."""
    out = tmp_path / "atlas"
    assert cli.main(atlas_argv(out, "--rates", "auto", "--slo", "instant=ttft:5,tpot:80")) == 2
    err = capsys.readouterr().err
    assert "refused: no cell of the atlas can be measured on this machine" in err
    assert "instant: no rate can meet these SLOs here" in err and "ttft <= 5 ms: 0%" in err
    assert (out / "calibration" / "short" / "results.json").is_file() and not (out / "short").exists()


def test_a_cell_no_arm_won_says_why(tmp_path):
    """Given rates and an SLO pair no run meets: the cell is 'neither', and the map, the table and the JSON say
    why (every rate failed; each arm's best share and the SLO it missed)."""
    out = tmp_path / "atlas"
    assert cli.main(atlas_argv(tmp_path / "long", "--rates", "8,16", "--max-minutes", "0.01")) == 2  # refused up front
    assert not (tmp_path / "long" / "short").exists()
    assert cli.main(atlas_argv(out, "--rates", "8,16", "--slo", "instant=ttft:5,tpot:80",
                               "--slo", "loose=ttft:1000,tpot:80")) == 0
    atlas = json.loads((out / "atlas.json").read_text())
    cells = {c["slo"]: c for c in atlas["cells"]}
    assert cells["instant"]["winner"] == "neither"
    why = cells["instant"]["why"]
    assert why.startswith("every grid rate failed the SLOs (>= 90% of requests within them, queue steady): ")
    assert "colo at best 0% within them at 8/s (ttft <= 5 ms: 0%)" in why
    assert cells["loose"]["winner"] != "neither"
    assert f"- short x instant: **neither**: {why}" in (out / "atlas.md").read_text()


def test_the_gpu_script_runs_several_pieces_and_tars_them(tmp_path):
    """bench/run_atlas_gpu.sh with PROFILE=short,long ARM=colocated: one piece after the other, each with its own
    profile's grid, OUT tarred into TAR after each; RATES with several profiles is refused (it is per profile).
    PYTHON is a stand-in that writes a piece's folder where --out says and records its --profiles and --rates."""
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parents[1]
    stub = tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do case $1 in --out) out=$2;; --profiles) p=$2;; '
                    '--rates) r=$2;; esac; shift; done\nmkdir -p "$out/$p" && echo "$r" > "$out/$p/rates.txt"\n')
    stub.chmod(0o755)
    out, tar = tmp_path / "atl", tmp_path / "atl.tgz"
    env = {**os.environ, "PYTHON": str(stub), "OUT": str(out), "TAR": str(tar), "PROFILE": "short,long",
           "ARM": "colocated"}
    run = subprocess.run(["bash", str(root / "bench/run_atlas_gpu.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    pieces = out / "pieces" / "colocated"
    assert (pieces / "short" / "rates.txt").read_text().strip() == "16,32,64"
    assert (pieces / "long" / "rates.txt").read_text().strip() == "1.5,3,4.5"
    with tarfile.open(tar) as t:
        assert {"atl/pieces/colocated/short/rates.txt", "atl/pieces/colocated/long/rates.txt"} <= set(t.getnames())
    refused = subprocess.run(["bash", str(root / "bench/run_atlas_gpu.sh")], env={**env, "RATES": "1,2"},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "RATES is per profile" in refused.stdout
