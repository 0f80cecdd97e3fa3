"""`pdserve-bench defaults` over arms measured in several folders (a search, then more probes of it), each
topology judged against its own default, the committed sweep judged as it was; and bench/run_defaults_gpu.sh's
colocated, disaggregated (pd-*) and MORE probes, the script run with a stub PYTHON whose `load` writes a folder
without a server (every other command goes to the real interpreter, `defaults` included)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.load import defaults
from pdserve.bench.load.report import read_results, results_file

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)

GPU = "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"
WORKLOAD = "synthetic, input uniform:8192:32000, output 64 over /v1/completions, each search run >= 60 s"
FLAGS = {"default": "", "unchunked": "--worker-arg=--no-chunked-prefill"}


def write_run(folder: Path, label: str, probes: list[tuple[float, bool]], *, date: str = "2026-12-05T18:00:00+00:00",
              flags: str | None = None, gpus: str = GPU, server: str | None = None) -> Path:
    """A `load --capacity-search` folder of one arm whose probes (rate, passed) ran in this order; its server:
    one colocated worker with `flags` (default: the label's), or pdserve with the flags `server` gives."""
    passes = [r for r, ok in probes if ok]
    fails = [r for r, ok in probes if not ok]
    low, high = (max(passes) if passes else None), (min(fails) if fails else None)
    flags = FLAGS.get(label, f"--worker-arg=--chunk-tokens={label.removeprefix('chunk')}") if flags is None else flags
    if server is None:
        server = ("--model qwen2.5-7b --devices cuda:0 --transport ipc --mode bulk --kv-memory-gb 40 "
                  f"--prefill-workers 0 --decode-workers 0 --colocated-workers 1 {flags}")  # the script's, long
    run = {
        "environment": {"date_utc": date, "machine": {"gpus": gpus}, "git_commit": "6ff38c7abc", "git_dirty": False},
        "workload": WORKLOAD, "slos_ms": {"ttft": 4000.0, "tpot": 100.0}, "goodput_target": 0.9,
        "arms": [{"label": label, "server": {
            "command": f"/v/bin/python3 -m pdserve.server.cli --port 0 --parent-pid {len(str(folder))} "
                       f"{server}".strip(), "startup_s": 31.0},
            "capacity": {"capacity_rate": low, "first_failing_rate": high, "precision": 0.1,
                         "converged": low is not None and high is not None and high / low - 1 <= 0.1 + 1e-9,
                         "rests_on_cold": []}}],
        "results": [{"arm": label, "phase": "probe", "request_rate": r, "probe_passed": ok,
                     "goodput_fraction": 0.95 if ok else 0.88, "stopped_early": None if ok else {"reason": "x"},
                     "duration": 66.0 if ok else 35.0, "median_ttft_ms": 900.0, "p99_tpot_ms": 60.0}
                    for r, ok in probes],
    }
    folder.mkdir(parents=True, exist_ok=True)  # the script snapshots the host CPU into it first
    (folder / "results.json").write_text(json.dumps(run))
    return folder


def long_today(root: Path) -> Path:
    """The long workload as the first GPU session left it: the default's bracket [0.95, 1.0), unchunked 0.95
    passed (one probe), chunk16384 1.0545 passed (one probe)."""
    write_run(root / "default", "default",
              [(0.8, True), (1.6, False), (1.2, False), (1.0, False), (0.9, True), (0.95, True)])
    write_run(root / "unchunked", "unchunked", [(0.95, True)], date="2026-12-05T18:54:22+00:00")
    write_run(root / "chunk16384", "chunk16384", [(1.0545, True)], date="2026-12-05T18:56:56+00:00")
    return root


def judged(root: Path, reference: str | None = "unchunked") -> tuple[dict, str]:
    out = root / "judged"
    args = argparse.Namespace(from_dirs=sorted(str(d) for d in root.iterdir() if (d / "results.json").is_file()),
                              default="default", reference=reference, within=0.10, title="t", out=str(out),
                              name="defaults")
    assert defaults.run(args) == 0
    return json.loads((out / "defaults.json").read_text()), (out / "defaults.md").read_text()


def test_an_arm_probed_again_in_another_folder_narrows_its_bracket(tmp_path):
    root = long_today(tmp_path)
    # the next session: unchunked fails 1.05, chunk16384 fails 1.15 and passes 1.1 (two folders of it)
    write_run(root / "unchunked.more-1.05", "unchunked", [(1.05, False)], date="2026-12-06T10:00:00+00:00")
    write_run(root / "chunk16384.more-1.15", "chunk16384", [(1.15, False)], date="2026-12-06T10:03:00+00:00")
    write_run(root / "chunk16384.more-1.1", "chunk16384", [(1.1, True)], date="2026-12-06T10:06:00+00:00")
    doc, md = judged(root)
    un, ch = doc["arms"]["unchunked"], doc["arms"]["chunk16384"]
    assert (un["low"], un["high"], un["converged"], un["disagree"]) == (0.95, 1.05, False, None)
    assert (ch["low"], ch["high"], ch["converged"]) == (1.1, 1.15, True)
    # the search's folder heads the arm (the earliest), whatever order the folders were given in
    assert un["folder"].endswith("/unchunked") and [Path(f).name for f in ch["folders"]] == [
        "chunk16384", "chunk16384.more-1.15", "chunk16384.more-1.1"]
    assert [(p["rate"], p["passed"], Path(p["folder"]).name) for p in un["probes"]] == [
        (0.95, True, "unchunked"), (1.05, False, "unchunked.more-1.05")]
    v = doc["verdict"]
    # 0.95 >= 0.9 x 1.05: within 10% of unchunked now; chunk16384's fail at 1.15 leaves 0.9 x 1.15 = 1.035 open
    assert v["default_within_margin_of"] == {"unchunked": True, "chunk16384": None}
    assert v["undecided"] == ["chunk16384"] and v["probes_disagree"] == {} and v["best_measured"] == "chunk16384"
    assert v["default_at_least_reference"] is None and v["reference_probes_disagree"] is None
    assert ("| unchunked | 0.95 | 1.05 | no | unchunked: 0.95: pass; unchunked.more-1.05: 1.05: FAIL (stopped) "
            "| yes |") in md
    assert "- arm unchunked (unchunked.more-1.05): commit 6ff38c7" in md
    assert "not decided: the brackets do not decide it against chunk16384 (probe more)" in md
    # a folder of one arm alone reads as before: no folder names in its row
    assert "| default | 0.95 | 1 | yes | 0.8: pass, 1.6: FAIL (stopped)," in md


def test_a_pass_above_a_fail_across_folders_is_named_and_decides_nothing(tmp_path):
    root = long_today(tmp_path)
    # noise: unchunked passes 1.05 in one run after failing 1.0 in another
    write_run(root / "unchunked.more-1.0", "unchunked", [(1.0, False)], date="2026-12-06T10:00:00+00:00")
    write_run(root / "unchunked.more-1.05", "unchunked", [(1.05, True)], date="2026-12-06T10:03:00+00:00")
    doc, md = judged(root)
    un = doc["arms"]["unchunked"]
    assert (un["low"], un["high"], un["converged"]) == (1.05, 1.0, False)
    assert un["disagree"]["passed"]["rate"] == 1.05 and un["disagree"]["passed"]["folder"].endswith("more-1.05")
    assert un["disagree"]["failed"]["rate"] == 1.0 and un["disagree"]["failed"]["folder"].endswith("more-1.0")
    v = doc["verdict"]
    reason = "probes disagree: unchunked passed 1.05 in unchunked.more-1.05, failed 1 in unchunked.more-1.0"
    # the brackets alone would say the default (failed 1.0) is below unchunked (passed 1.05): no verdict is
    # drawn from probes that disagree
    assert v["default_within_margin_of"]["unchunked"] is None and v["probes_disagree"] == {"unchunked": reason}
    assert v["default_at_least_reference"] is None and v["reference_probes_disagree"] == reason
    assert "unchunked" in v["undecided"] and v["refuted_by"] == []
    assert f"not decided ({reason}) against unchunked" in md
    assert f"the default at least the reference (unchunked): not decided ({reason})" in md
    assert "| unchunked | 1.05 | 1 | no (probes disagree) |" in md
    # the default's own probes disagreeing leaves every verdict against it open
    write_run(root / "default.more-0.9", "default", [(0.9, False)], date="2026-12-06T10:06:00+00:00")
    v = judged(root)[0]["verdict"]
    assert v["default_within_margin_of"] == {"unchunked": None, "chunk16384": None}
    assert "default passed 0.95 in default, failed 0.9 in default.more-0.9" in v["probes_disagree"]["chunk16384"]


def test_folders_of_one_label_must_be_one_configuration(tmp_path, capsys):
    root = long_today(tmp_path)
    write_run(root / "unchunked.more-1.05", "unchunked", [(1.05, False)], flags="--worker-arg=--chunk-tokens=8192",
              date="2026-12-06T10:00:00+00:00")
    write_run(root / "default.more-1.0", "default", [(1.0, False)], gpus="NVIDIA H200, 143771 MiB")
    args = argparse.Namespace(from_dirs=[str(root / n) for n in ("default", "unchunked", "unchunked.more-1.05")],
                              default="default", reference=None, within=0.1, title=None, out=str(root / "o"),
                              name="defaults")
    assert defaults.run(args) == 2
    assert "differ in server flags" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"arm unchunked: .*/unchunked and .*more-1.05 differ in server flags"):
        defaults.arms_from(args.from_dirs)
    with pytest.raises(ValueError, match=r"arm default: .*differ in GPUs"):
        defaults.arms_from([str(root / "default"), str(root / "default.more-1.0")])


STUB = '''#!PYTHON_EXE
"""PYTHON for bench/run_defaults_gpu.sh: logs each call; `load` writes its folder (one probe per search, at
the start rate, passing at or below STUB_LIMITS[arm]) with no server; the rest runs for real."""
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(argv) + chr(10))
if argv[:3] == ["-m", "pdserve.bench.cli", "load"]:
    val = lambda flag: argv[argv.index(flag) + 1]
    label, spec = val("--arm").split("=", 1)
    rate = float(val("--search-start-rate"))
    sys.path.insert(0, os.environ["STUB_TESTS"])
    from test_defaults import write_run
    write_run(__import__("pathlib").Path(val("--out")), label,
              [(rate, rate <= json.loads(os.environ["STUB_LIMITS"]).get(label, 0.0))],
              date=f"2026-12-06T10:{len(open(os.environ['STUB_LOG']).readlines()):02d}:00+00:00",
              server=val("--server-args") + " " + spec.split(":", 1)[1])  # as load starts it: common, then arm
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *argv])
'''


def run_script(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    stub = tmp_path / "python"
    if not stub.exists():
        stub.write_text(STUB.replace("PYTHON_EXE", sys.executable))
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    log.write_text("")
    full = {**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), "STUB_TESTS": str(ROOT / "tests"),
            "STUB_LIMITS": json.dumps({"default": 0.97, "unchunked": 1.1, "chunk16384": 1.1}),
            "WORKLOAD": "long", "RESULTS": str(tmp_path / "results"), "OUT": "", **env}
    done = subprocess.run([str(ROOT / "bench/run_defaults_gpu.sh")], env=full, capture_output=True, text=True,
                          timeout=90)
    return done, [json.loads(line) for line in log.read_text().splitlines()]


def loads(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "load"]]


def test_more_probes_measured_arms_once_per_rate_and_the_judge_merges_them(tmp_path):
    long_today(tmp_path / "results" / "long")
    more = {"MORE": "unchunked:1.05,1.15 chunk16384:1.15 default:1.0"}
    done, calls = run_script(tmp_path, more)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = loads(calls)
    # one load (one fresh server) per rate, in the order given; no arm's search reruns (MORE alone: no ARMS)
    assert [(c[c.index("--arm") + 1].split("=")[0], c[c.index("--search-start-rate") + 1],
             Path(c[c.index("--out") + 1]).name) for c in ran] == [
        ("unchunked", "1.05", "unchunked.more-1.05"), ("unchunked", "1.15", "unchunked.more-1.15"),
        ("chunk16384", "1.15", "chunk16384.more-1.15"), ("default", "1.0", "default.more-1.0")]
    for c in ran:  # exactly one probe, no sweep, the long workload's probe and SLOs, the arm's own flags
        assert c[c.index("--search-max-probes") + 1] == "1" and c[c.index("--sweep-factors") + 1] == ""
        assert c[c.index("--input-len") + 1] == "uniform:8192:32000" and c[c.index("--probe-seconds") + 1] == "60"
        assert c[c.index("--goodput") + 1: c.index("--goodput") + 3] == ["ttft:4000", "tpot:100"]
    assert "--worker-arg=--no-chunked-prefill" in ran[0][ran[0].index("--arm") + 1]
    assert "--worker-arg=--chunk-tokens=16384" in ran[2][ran[2].index("--arm") + 1]
    assert "--worker-arg" not in ran[3][ran[3].index("--arm") + 1]
    judge = [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "defaults"]]
    assert len(judge) == 1 and judge[0].count("--from") == 7 and "--reference" in judge[0]
    doc = json.loads((tmp_path / "results/long/defaults.json").read_text())
    un, ch, de = (doc["arms"][k] for k in ("unchunked", "chunk16384", "default"))
    assert (un["low"], un["high"], len(un["folders"])) == (1.05, 1.15, 3)
    assert (ch["low"], ch["high"], de["low"], de["high"]) == (1.0545, 1.15, 0.95, 1.0)
    # the default failed 1.0, unchunked passed 1.05: the default is below the reference
    assert doc["verdict"]["default_at_least_reference"] is False
    # measured folders are kept: the same MORE again loads nothing
    done, calls = run_script(tmp_path, more)
    assert done.returncode == 0 and loads(calls) == [] and "probed at 1.05 already" in done.stdout


def test_more_is_checked_before_anything_runs_and_honours_call_seconds(tmp_path):
    long_today(tmp_path / "results" / "long")
    for bad, says in (("unchunked", "MORE takes arm:rate"), ("chunky:1", "an arm is default, unchunked, chunkN, attnN, threadsN, pd-default"),
                      ("unchunked:1.05,0", "a rate is a number"), ("default:fast", "a rate is a number")):
        done, calls = run_script(tmp_path, {"MORE": bad})
        assert done.returncode == 2 and says in done.stdout + done.stderr and calls == [], (bad, done.stderr)
    # no probe starts with less than ARM_MIN_SECONDS of the call left
    done, calls = run_script(tmp_path, {"MORE": "unchunked:1.05", "CALL_SECONDS": "100"})
    assert done.returncode == 0 and loads(calls) == [] and "probe at 1.05 not started" in done.stdout


PD = ("--model qwen2.5-7b --devices cuda:0 --transport ipc --mode bulk --kv-memory-gb 16 --no-colocated "
      "--prefill-workers 1 --decode-workers 1")
COMMITTED = ROOT / "bench/results/defaults-gpu"


@pytest.mark.parametrize("flags,workers", [
    ("--devices cuda:0 --prefill-workers 0 --decode-workers 0 --colocated-workers 1", "1 colocated worker on cuda:0"),
    (PD, "1 prefill + 1 decode workers on cuda:0"),
    ("--model tiny", "1 prefill + 1 decode + 1 colocated workers on (pdserve's default devices)"),
    ("--devices=cuda:0,cuda:1 --prefill-workers=0 --decode-workers 0 --colocated-workers 1 --colocated-workers 2",
     "2 colocated workers on cuda:0,cuda:1"),
])
def test_an_arms_topology_is_read_from_its_server_command(flags, workers):
    assert defaults.topology(f"/v/bin/python -m pdserve.server.cli --port 0 --parent-pid 7 {flags}") == workers


def test_a_default_is_judged_against_arms_of_its_own_topology_only(tmp_path, capsys):
    root = long_today(tmp_path)
    write_run(root / "pd-default", "pd-default", [(0.8, True), (1.6, False), (1.0, False)], server=PD)
    write_run(root / "pd-seqs128", "pd-seqs128", [(2.0, True)], server=PD + " --worker-arg=--max-num-seqs=128")
    everything = sorted(str(d) for d in root.iterdir())
    for default, says in (("default", "the default (default) runs 1 colocated worker on cuda:0, but pd-default, "
                                      "pd-seqs128 run 1 prefill + 1 decode workers on cuda:0: "),
                          ("pd-default", "the default (pd-default) runs 1 prefill + 1 decode workers on cuda:0, but "
                                         "chunk16384, default, unchunked run 1 colocated worker on cuda:0: ")):
        # pd-seqs128 passed 2.0 where the colocated default failed 1.0: compared, it would refute it; it is not
        args = argparse.Namespace(from_dirs=everything, default=default, reference=None, within=0.1, title=None,
                                  out=str(tmp_path / "o"), name="defaults")
        assert defaults.run(args) == 2
        err = capsys.readouterr().err
        assert says in err and "give each topology its own judgement" in err, err
        assert not (tmp_path / "o").exists()
    args = argparse.Namespace(from_dirs=[str(root / "pd-default"), str(root / "pd-seqs128")], default="pd-default",
                              reference=None, within=0.1, title="pairs", out=str(tmp_path / "o"), name="defaults-pd")
    assert defaults.run(args) == 0
    doc = json.loads((tmp_path / "o/defaults-pd.json").read_text())
    assert doc["verdict"]["topology"] == "1 prefill + 1 decode workers on cuda:0"
    assert doc["verdict"]["refuted_by"] == ["pd-seqs128"] and set(doc["arms"]) == {"pd-default", "pd-seqs128"}
    md = (tmp_path / "o/defaults-pd.md").read_text()
    assert "- every arm runs 1 prefill + 1 decode workers on cuda:0" in md and "**no**: more than 10% below pd-seqs128" in md
    assert not (tmp_path / "o/defaults.json").exists()  # --name: the colocated verdict's file is another's


@pytest.mark.parametrize("workload", ["mixed", "long"])
def test_the_committed_sweep_judges_as_it_did(tmp_path, workload):
    """bench/results/defaults-gpu (one H100, 6ff38c7) judged again by this code: the same verdict (every field
    it had then; those added since are new), brackets and arms, one topology."""
    folder = COMMITTED / workload
    then = json.loads((folder / "defaults.json").read_text())
    # results.json, or results.json.gz where a large one was committed gzipped
    args = argparse.Namespace(from_dirs=sorted(str(d) for d in folder.iterdir() if results_file(d)),
                              default="default", reference="unchunked", within=0.10, title=then["title"],
                              out=str(tmp_path), name="defaults")
    assert defaults.run(args) == 0
    now = json.loads((tmp_path / "defaults.json").read_text())
    assert {k: now["verdict"][k] for k in then["verdict"]} == then["verdict"]
    assert {k: (a["low"], a["high"]) for k, a in now["arms"].items()} == {
        k: (a["low"], a["high"]) for k, a in then["arms"].items()}
    assert now["verdict"]["topology"] == "1 colocated worker on cuda:0"
    if workload == "mixed":
        assert then["verdict"]["default_within_margin_of_all"] is True  # what the README quotes


def test_pd_arms_start_a_prefill_and_a_decode_worker_and_are_judged_apart(tmp_path):
    long_today(tmp_path / "results" / "long")  # the colocated arms, measured
    arms = {"ARMS": "pd-default,pd-seqs128,pd-chunk32768,pd-pbatch1,pd-layer",
            "STUB_LIMITS": json.dumps({"pd-default": 0.9, "pd-chunk32768": 1.2})}  # the rest fail any rate
    done, calls = run_script(tmp_path, arms)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = loads(calls)
    val = lambda c, flag: c[c.index(flag) + 1]  # noqa: E731
    pair = "=disaggregated:--no-colocated --prefill-workers 1 --decode-workers 1 "
    assert [val(c, "--arm") for c in ran] == [
        "pd-default" + pair, "pd-seqs128" + pair + "--worker-arg=--max-num-seqs=128",
        "pd-chunk32768" + pair + "--worker-arg=--chunk-tokens=32768",
        "pd-pbatch1" + pair + "--worker-arg=--max-batched-tokens=1", "pd-layer" + pair]
    # the pairs' own pool (PD_KV 16 GiB a worker, not the long workload's 40) and transfer mode
    # each server traces its steps into its own folder (STEP_TRACE, on by default): not a configuration flag
    traced = [val(c, "--server-args").split(" --step-trace ") for c in ran]
    assert [t[1] for t in traced] == [val(c, "--out") + "/steps" for c in ran]
    assert [t[0] for t in traced] == [
        "--model qwen2.5-7b --devices cuda:0 --transport ipc --mode bulk --kv-memory-gb 16"] * 4 + [
        "--model qwen2.5-7b --devices cuda:0 --transport ipc --mode layer --kv-memory-gb 16"]
    assert defaults._server_flags("python -m pdserve.server.cli --port 0 --step-trace /a/steps --model m") == \
        defaults._server_flags("python -m pdserve.server.cli --model m --step-trace=/b/steps") == "--model m"
    # pd-default's own full search; every other pair one probe at pd-default's capacity (0.8) / 0.9, not the
    # colocated default's (0.95)
    assert (val(ran[0], "--search-start-rate"), val(ran[0], "--search-max-probes")) == ("0.8", "6")
    for c in ran[1:]:
        assert float(val(c, "--search-start-rate")) == pytest.approx(0.8 / 0.9 * 0.999)
        assert val(c, "--search-max-probes") == "1"
    judges = [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "defaults"]]
    assert len(judges) == 1  # a call judges the kinds it measured: the colocated verdict is left as it was
    assert not (tmp_path / "results/long/defaults.json").exists()
    done, calls = run_script(tmp_path, {"JUDGE": "1"})  # JUDGE=1: both, each against its own default
    assert done.returncode == 0, done.stdout + done.stderr
    judges = [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "defaults"]]
    assert len(judges) == 2 and not loads(calls)
    colocated, pairs = judges
    assert sorted(Path(val(colocated[i:], "--from")).name for i, w in enumerate(colocated) if w == "--from") == [
        "chunk16384", "default", "unchunked"]
    assert (val(colocated, "--default"), val(colocated, "--reference"), val(colocated, "--name")) == (
        "default", "unchunked", "defaults")
    assert sorted(Path(val(pairs[i:], "--from")).name for i, w in enumerate(pairs) if w == "--from") == [
        "pd-chunk32768", "pd-default", "pd-layer", "pd-pbatch1", "pd-seqs128"]
    assert (val(pairs, "--default"), val(pairs, "--name")) == ("pd-default", "defaults-pd")
    assert "--reference" not in pairs
    out = tmp_path / "results/long"
    co, pd = (json.loads((out / f"{n}.json").read_text()) for n in ("defaults", "defaults-pd"))
    assert set(co["arms"]) == {"default", "unchunked", "chunk16384"}
    assert co["verdict"]["topology"] == "1 colocated worker on cuda:0"
    assert pd["verdict"]["topology"] == "1 prefill + 1 decode workers on cuda:0"
    # seqs128, pbatch1 and layer failed 0.888: the default within 10% of them; chunk32768 passed it: open
    assert pd["verdict"]["default_within_margin_of"] == {"pd-seqs128": True, "pd-chunk32768": None,
                                                         "pd-pbatch1": True, "pd-layer": True}
    # measured arms are kept: the same call again starts no server
    done, calls = run_script(tmp_path, arms)
    assert done.returncode == 0 and loads(calls) == [] and "arm pd-layer: measured already" in done.stdout
    # MORE probes a pair's arm as a colocated one's: its own pair flags, merged into its bracket
    done, calls = run_script(tmp_path, {"MORE": "pd-chunk32768:1.0", "STUB_LIMITS": arms["STUB_LIMITS"]})
    assert done.returncode == 0, done.stdout + done.stderr
    [more] = loads(calls)
    assert val(more, "--arm") == "pd-chunk32768" + pair + "--worker-arg=--chunk-tokens=32768"
    assert Path(val(more, "--out")).name == "pd-chunk32768.more-1.0"
    chunk = json.loads((out / "defaults-pd.json").read_text())["arms"]["pd-chunk32768"]
    assert (chunk["low"], chunk["high"], len(chunk["folders"])) == (1.0, None, 2)


def test_the_scripts_colocated_arms_start_the_committed_sweeps_servers(tmp_path):
    """A colocated arm is the configuration the committed sweep measured (server flags as the judge compares
    them), so a MORE probe of a committed arm merges into its bracket (the judge refuses folders of one label
    whose server flags differ)."""
    arms = ("default", "unchunked", "chunk16384", "chunk2048")
    long_today(tmp_path / "results/long")
    done, calls = run_script(tmp_path, {"MORE": " ".join(f"{a}:1.05" for a in arms)})
    assert done.returncode == 0, done.stdout + done.stderr
    ran = loads(calls)
    assert len(ran) == len(arms)
    for arm, c in zip(arms, ran):
        committed = read_results(COMMITTED / "long" / arm / "results.json")["arms"][0]["server"]["command"]
        spec = c[c.index("--arm") + 1]
        started = f"python -m pdserve.server.cli {c[c.index('--server-args') + 1]} {spec.split(':', 1)[1]}"
        assert spec.startswith(f"{arm}=colocated:")
        assert defaults._server_flags(started) == defaults._server_flags(committed), arm


def test_arms_are_checked_before_any_runs(tmp_path):
    long_today(tmp_path / "results" / "long")
    for bad, says in (("pd-default,pd-unchunked", "pd-unchunked measures nothing: a prefill worker prefills"),
                      ("pd-default,pd-seqs12x", "an arm is default, unchunked, chunkN, attnN, threadsN, pd-default"),
                      ("pd-pbatch", "got 'pd-pbatch'"),
                      ("pd-chunk", "got 'pd-chunk'"), ("chunk64,chunk6a4", "got 'chunk6a4'")):
        done, calls = run_script(tmp_path, {"ARMS": bad})
        assert done.returncode == 2 and says in done.stdout + done.stderr and calls == [], (bad, done.stderr)
    # a pair's arm needs pd-default's capacity, not the colocated default's
    done, calls = run_script(tmp_path, {"ARMS": "pd-seqs32"})
    assert done.returncode == 0 and loads(calls) == []
    assert "arm pd-seqs32: the pd-default arm has no capacity yet" in done.stdout


def test_the_verdict_names_the_probes_that_would_decide_what_is_open(tmp_path):
    """The long workload as the first session left it: the default [0.95, 1.0), unchunked 0.95 and chunk16384
    1.0545 passed (one probe each, no fail). Each probe named lies inside its arm's open bracket and decides a
    comparison one way; the MORE value runs them."""
    root = long_today(tmp_path)
    doc, md = judged(root)
    named = [(p["arm"], p["rate"], p["decides"]) for p in doc["verdict"]["next_probes"]]
    assert named == [
        # 1.0 / 0.9, up: a pass of chunk16384's shows the default (failed 1.0) more than 10% below. Its fail at
        # 0.95 / 0.9 = 1.0556 (down to 1.05) would decide the other way, but it passed 1.0545: not named
        ("chunk16384", 1.12, "default below 90% of chunk16384 if it passes"),
        ("unchunked", 1.05, "default >= 90% of unchunked if it fails"),
        ("unchunked", 1.12, "default below 90% of unchunked if it passes"),
        ("unchunked", 1.01, "default below 100% of unchunked if it passes"),  # the reference, no margin
    ]
    assert '(`MORE="chunk16384:1.12 unchunked:1.05,1.12,1.01"`)' in md
    # two of them run: unchunked fails 1.05, chunk16384 passes 1.12; each decides its comparison
    write_run(root / "unchunked.more-1.05", "unchunked", [(1.05, False)], date="2026-12-06T10:00:00+00:00")
    write_run(root / "chunk16384.more-1.12", "chunk16384", [(1.12, True)], date="2026-12-06T10:03:00+00:00")
    v = judged(root)[0]["verdict"]
    assert v["default_within_margin_of"] == {"unchunked": True, "chunk16384": False} and v["refuted_by"] == ["chunk16384"]
    # the reference ([0.95, 1.0) against [0.95, 1.05)) is still open; one probe could close it
    assert v["default_at_least_reference"] is None
    assert [(p["arm"], p["rate"]) for p in v["next_probes"]] == [("unchunked", 1.01)]


def test_probes_that_disagree_name_no_next_probe(tmp_path):
    root = long_today(tmp_path)
    write_run(root / "default.more-0.9", "default", [(0.9, False)], date="2026-12-06T10:06:00+00:00")
    v = judged(root)[0]["verdict"]
    assert v["undecided"] and v["probes_disagree"] and v["next_probes"] == []


def test_more_auto_runs_what_the_verdict_names_until_nothing_is_left(tmp_path):
    long_today(tmp_path / "results" / "long")
    done, calls = run_script(tmp_path, {"MORE": "auto", "AUTO_ROUNDS": "3"})
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [(c[c.index("--arm") + 1].split("=")[0], c[c.index("--search-start-rate") + 1]) for c in loads(calls)]
    # round 1, the four named above (the stub passes unchunked and chunk16384 up to 1.1, the default up to 0.97):
    # chunk16384 fails 1.12, unchunked passes 1.05 and 1.01 and fails 1.12. Round 2 finds the default below
    # unchunked (failed 1.0, unchunked passed 1.05) and nothing a probe could decide: it stops
    assert ran == [("chunk16384", "1.12"), ("unchunked", "1.05"), ("unchunked", "1.12"), ("unchunked", "1.01")]
    assert "MORE=auto: no probe left that would decide a verdict" in done.stdout
    v = json.loads((tmp_path / "results/long/defaults.json").read_text())["verdict"]
    assert v["default_at_least_reference"] is False and v["next_probes"] == []
    assert v["undecided"] == ["chunk16384", "unchunked"]  # open, with no probe inside either bracket to run
    judge = [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "defaults"]]
    assert len(judge) == 3  # round 1, round 2, the last


def test_an_attn_arm_sets_how_a_chunk_counts_its_prefix(tmp_path):
    """attnN: --chunk-attention-tokens N on the colocated default's worker (0: a chunk of --chunk-tokens at any
    depth of a prompt), an arm like any other; a malformed one is refused before anything runs."""
    long_today(tmp_path / "results/long")
    done, calls = run_script(tmp_path, {"MORE": "attn0:1.05"})
    assert done.returncode == 0, done.stdout + done.stderr
    [spec] = [c[c.index("--arm") + 1] for c in loads(calls)]
    assert spec.startswith("attn0=colocated:") and spec.endswith("--worker-arg=--chunk-attention-tokens=0")
    done, calls = run_script(tmp_path, {"ARMS": "attn"})
    assert done.returncode == 2 and "got 'attn'" in done.stderr and calls == []


def test_a_threads_arm_sets_the_workers_torch_threads(tmp_path):
    """threadsN: pdserve --threads N on the default's workers (the default shares the machine's cores among
    them): whether a GPU worker's CPU threads shape its capacity is an arm like any other."""
    long_today(tmp_path / "results/long")
    done, calls = run_script(tmp_path, {"MORE": "threads2:1.05 pd-threads4:0.5"})
    assert done.returncode == 0, done.stdout + done.stderr
    specs = [c[c.index("--arm") + 1] for c in loads(calls)]
    assert specs[0].startswith("threads2=colocated:") and specs[0].endswith("--colocated-workers 1 --threads 2")
    assert specs[1].startswith("pd-threads4=disaggregated:") and specs[1].endswith("--threads 4")
    assert defaults.topology("python -m pdserve.server.cli " + specs[0].split(":", 1)[1]) == \
        "1 colocated worker on (pdserve's default devices)"


def test_the_default_alone_is_not_called_within_the_margin(tmp_path):
    """A call that probed only the default (a diagnosis) has nothing to judge it against: the verdict says so
    instead of "yes", and names no best arm."""
    write_run(tmp_path / "default.more-11.56", "default", [(11.56, False)])
    doc, md = judged(tmp_path, reference=None)
    assert doc["verdict"]["default_within_margin_of"] == {}
    assert doc["verdict"]["default_within_margin_of_all"] is None
    assert "nothing to judge: no other arm of its topology was measured" in md
    assert "**yes**" not in md and "the best measured" not in md


def with_counts(folder: Path, counts: dict[float, dict]) -> None:
    """Give the probes of a write_run folder their request counts: rate -> {"sent": n, "within": k} for a probe
    that ran out (num_prompts and its share), {"sent": n, "missed": m} for one stopped early, "queue": True for
    a growing queue."""
    path = folder / "results.json"
    run = json.loads(path.read_text())
    for b in run["results"]:
        c = counts[b["request_rate"]]
        if "missed" in c:
            b["stopped_early"] = {"planned": 60, "sent": c["sent"], "missed": c["missed"], "reason": "x"}
            b["goodput_fraction"] = 1 - (c["missed"] + 1) / 60  # the early stop's "at most", over the planned
        else:
            b["num_prompts"], b["goodput_fraction"] = c["sent"], c["within"] / c["sent"]
            b["stopped_early"] = None  # it ran out
        b["saturation"] = {"queue_growing": bool(c.get("queue"))}
    path.write_text(json.dumps(run))


def test_a_verdict_resting_on_a_probe_within_noise_says_so(tmp_path):
    """The long workload at c77ebb5: the default failed 1.0 (stopped early: 7 of the 34 requests it had sent
    missed, 27 within, 2 sd under the 90% line) and passed 0.95 (54 of 57); unchunked passed 1.05 with 57 of 63
    (the line is 56.7, its binomial sd 2.4). "The default is below unchunked" rests on that pass: said, and the
    pass is marked in its row; the default's fail is not (well under its line), nor a fail by a growing queue
    with its share above the line, nor a pass with every request within."""
    write_run(tmp_path / "default", "default", [(0.9, True), (1.0, False), (0.95, True), (1.2, False)])
    with_counts(tmp_path / "default", {0.9: {"sent": 54, "within": 54}, 1.0: {"sent": 34, "missed": 7},
                                       0.95: {"sent": 57, "within": 54},
                                       1.2: {"sent": 72, "within": 66, "queue": True}})
    write_run(tmp_path / "unchunked", "unchunked", [(1.05, True)], date="2026-12-05T18:54:22+00:00")
    with_counts(tmp_path / "unchunked", {1.05: {"sent": 63, "within": 57}})
    doc, md = judged(tmp_path)
    v = doc["verdict"]
    assert v["default_at_least_reference"] is False
    assert [(p["arm"], p["rate"], p["passed"], p["within"], p["requests"]) for p in v["reference_rests_on_noise"]] \
        == [("unchunked", 1.05, True, 57, 63)]
    assert v["reference_rests_on_noise"][0]["sd"] == pytest.approx((63 * 0.09) ** 0.5)
    assert v["rests_on_noise"] == {}  # within 10% of unchunked: undecided, so it rests on nothing
    assert "1.05: pass (near the line: 57 of 63)" in md
    assert "- **decided on probes within noise**: unchunked passed 1.05 with 57 of 63 requests within the SLOs " \
           "(line 56.7, binomial sd 2.4)" in md
    row = next(line for line in md.splitlines() if line.startswith("| default |"))
    assert "near the line" not in row  # 27 of 34 (2 sd under), 54 of 57 (1.3 sd over), a growing queue, 54 of 54
    probes = {p["rate"]: p for p in doc["arms"]["default"]["probes"]}
    assert (probes[1.0]["requests"], probes[1.0]["within"]) == (34, 27)  # sent, less those seen to miss


def test_probes_far_from_their_line_add_no_noise_statement(tmp_path):
    """A verdict decided by probes well clear of their lines says nothing of noise: the default passes 15 with
    all 900 within, chunk2048 fails 16.65 with 800 of 1000 within (10 sd under)."""
    write_run(tmp_path / "default", "default", [(15.0, True), (16.25, False)])
    with_counts(tmp_path / "default", {15.0: {"sent": 900, "within": 900}, 16.25: {"sent": 975, "within": 850}})
    write_run(tmp_path / "chunk2048", "chunk2048", [(16.65, False)], date="2026-12-05T18:54:22+00:00")
    with_counts(tmp_path / "chunk2048", {16.65: {"sent": 1000, "within": 800}})
    doc, md = judged(tmp_path, reference=None)
    assert doc["verdict"]["default_within_margin_of"] == {"chunk2048": True}
    assert [(p["requests"], p["within"]) for p in doc["arms"]["chunk2048"]["probes"]] == [(1000, 800)]
    assert doc["verdict"]["rests_on_noise"] == {} and "within noise" not in md and "near the line" not in md
    # the same fail by 3 requests of 1000 (under one sd of 9.5) is named
    with_counts(tmp_path / "chunk2048", {16.65: {"sent": 1000, "within": 897}})
    doc, md = judged(tmp_path, reference=None)
    assert [(p["arm"], p["rate"], p["within"]) for p in doc["verdict"]["rests_on_noise"]["chunk2048"]] == [
        ("chunk2048", 16.65, 897)]
    assert "chunk2048 failed 16.6 with 897 of 1000 requests within the SLOs (line 900.0, binomial sd 9.5)" in md


def test_the_best_measured_is_the_highest_pass_and_none_without_one(tmp_path):
    """Arms that share the highest passing rate are named as sharing it, the higher first fail first (the mixed
    workload at c77ebb5: default [15, 16.2), unchunked [15, 16.27)); where no arm passed a probe (the long one at
    cbdb184: default and attn0 both failed 1.0) none is called the best."""
    write_run(tmp_path / "tie" / "default", "default", [(15.0, True), (16.2, False)])
    write_run(tmp_path / "tie" / "unchunked", "unchunked", [(15.0, True), (16.27, False)])
    write_run(tmp_path / "tie" / "chunk2048", "chunk2048", [(16.65, False)])
    doc, md = judged(tmp_path / "tie")
    assert doc["verdict"]["best_measured"] == "unchunked" and doc["verdict"]["best_measured_ties"] == ["default"]
    assert "unchunked, its passing rate shared by default" in md
    write_run(tmp_path / "none" / "default", "default", [(1.0, False)])
    write_run(tmp_path / "none" / "attn0", "attn0", [(1.0, False)], flags="--worker-arg=--chunk-attention-tokens=0")
    doc, md = judged(tmp_path / "none", reference=None)
    assert doc["verdict"]["best_measured"] is None and "none (no arm passed a probe)" in md
