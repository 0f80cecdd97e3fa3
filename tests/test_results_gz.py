"""A load run's results.json may be committed gzipped (results.json.gz: bench/results/ holds every one over 1 MB
so): every reader takes either form, a path X/results.json reads X/results.json.gz where only that is there, and
the plain file wins where both are. The judge (`pdserve-bench defaults`, and bench/run_defaults_gpu.sh around it),
the atlas's --from and the planner's --measured read a gzipped folder as they read the plain one."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

import pytest

from pdserve.bench.load import atlas, defaults, planner
from pdserve.bench.load.report import read_results, results_file, results_files
from test_defaults import loads, long_today, run_script

pytestmark = pytest.mark.timeout(120)


def gzip_results(root: Path) -> list[Path]:
    """Each FOLDER/results.json under ROOT replaced by FOLDER/results.json.gz (as `gzip -9` leaves it)."""
    done = []
    for plain in sorted(root.rglob("results.json")):
        packed = plain.with_name("results.json.gz")
        packed.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=9))
        plain.unlink()
        done.append(packed)
    return done


def test_read_results_takes_either_form_and_prefers_the_plain_file(tmp_path):
    run = {"arms": [{"label": "a"}], "results": [{"arm": "a", "request_rate": 1.5}], "note": "\u00e9"}
    for name in ("plain", "packed", "both"):
        (tmp_path / name).mkdir()
    (tmp_path / "plain" / "results.json").write_text(json.dumps(run), encoding="utf-8")
    (tmp_path / "packed" / "results.json.gz").write_bytes(gzip.compress(json.dumps(run).encode()))
    (tmp_path / "both" / "results.json").write_text(json.dumps({**run, "note": "plain"}))
    (tmp_path / "both" / "results.json.gz").write_bytes(gzip.compress(json.dumps({**run, "note": "gz"}).encode()))
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "summary.md").write_text("x")
    assert read_results(tmp_path / "plain" / "results.json") == run
    # the plain name of a folder that holds only the gzipped file, and the gzipped name itself
    assert read_results(tmp_path / "packed" / "results.json") == run
    assert read_results(str(tmp_path / "packed" / "results.json.gz")) == run
    assert read_results(tmp_path / "both" / "results.json")["note"] == "plain"
    assert read_results(tmp_path / "both" / "results.json.gz")["note"] == "gz"  # named, it is read
    with pytest.raises(FileNotFoundError, match=r"neither/results\.json"):
        read_results(tmp_path / "neither" / "results.json")
    # one file a folder, the plain one where both are; a folder with neither is left out
    assert results_file(tmp_path / "both") == tmp_path / "both" / "results.json"
    assert results_file(tmp_path / "packed") == tmp_path / "packed" / "results.json.gz"
    assert results_file(tmp_path / "neither") is None
    assert results_files(tmp_path) == [tmp_path / "both" / "results.json", tmp_path / "packed" / "results.json.gz",
                                       tmp_path / "plain" / "results.json"]
    assert results_files(tmp_path, "p*") == [tmp_path / "packed" / "results.json.gz",
                                             tmp_path / "plain" / "results.json"]


def _judge(root: Path, out: Path) -> tuple[dict, str]:
    args = argparse.Namespace(from_dirs=[str(root / n) for n in ("default", "unchunked", "chunk16384")],
                              default="default", reference="unchunked", within=0.10, title="t", out=str(out),
                              name="defaults")
    assert defaults.run(args) == 0
    return json.loads((out / "defaults.json").read_text()), (out / "defaults.md").read_text()


def test_the_defaults_judge_reads_gzipped_folders_as_the_plain_ones(tmp_path):
    plain = long_today(tmp_path / "plain")
    packed = tmp_path / "packed"
    shutil.copytree(plain, packed)
    assert len(gzip_results(packed)) == 3 and not list(packed.rglob("results.json"))
    then, then_md = _judge(plain, tmp_path / "judged-plain")
    now, now_md = _judge(packed, tmp_path / "judged-packed")
    # the same brackets, probes and verdict; only the folders' names differ
    assert now["verdict"] == then["verdict"] and now["verdict"]["best_measured"] == "chunk16384"
    assert json.loads(json.dumps(now["arms"]).replace(str(packed), str(plain))) == then["arms"]
    assert (now["arms"]["default"]["low"], now["arms"]["default"]["high"]) == (0.95, 1.0)
    assert [p["rate"] for p in now["arms"]["default"]["probes"]] == [0.8, 1.6, 1.2, 1.0, 0.9, 0.95]
    assert now_md.replace(str(packed), str(plain)) == then_md


def test_the_defaults_script_keeps_and_judges_gzipped_arms(tmp_path):
    """bench/run_defaults_gpu.sh over arms committed gzipped: each is measured already (kept, not rerun), the
    next arm starts from the default's capacity read from its results.json.gz, and the judge is given every
    gzipped folder."""
    long_today(tmp_path / "results" / "long")
    gzip_results(tmp_path / "results")
    done, calls = run_script(tmp_path, {"ARMS": "default,unchunked,chunk16384,chunk2048"})
    assert done.returncode == 0, done.stdout + done.stderr
    for arm in ("default", "unchunked", "chunk16384"):
        assert f"arm {arm}: measured already" in done.stdout
    [ran] = loads(calls)  # chunk2048 alone, just under the default's 0.95 / (1 - 0.10)
    assert ran[ran.index("--arm") + 1].startswith("chunk2048=")
    assert float(ran[ran.index("--search-start-rate") + 1]) == pytest.approx(0.95 / 0.9 * 0.999)
    [judge] = [c for c in calls if c[:3] == ["-m", "pdserve.bench.cli", "defaults"]]
    assert judge.count("--from") == 4 and "--reference" in judge
    doc = json.loads((tmp_path / "results/long/defaults.json").read_text())
    assert set(doc["arms"]) == {"default", "unchunked", "chunk16384", "chunk2048"}
    assert (doc["arms"]["default"]["low"], doc["arms"]["unchunked"]["low"]) == (0.95, 0.95)


def _profile_run(label: str, rate: float, capacity: float) -> dict:
    return {"workload": "w", "args": {"seed": 1}, "command": f"pdserve-bench load --arm {label}",
            "arms": [{"label": label, "capacity": {"capacity_rate": capacity, "bracket": [capacity, 2 * capacity],
                                                   "probe_seconds": 60.0}}],
            "results": [{"arm": label, "phase": "point", "request_rate": rate, "requests": []}]}


def test_the_atlas_and_the_planner_read_a_gzipped_results_json(tmp_path):
    for root in (tmp_path / "plain", tmp_path / "packed"):
        for profile, label, rate in (("short", "colo", 24.0), ("long", "disagg", 12.0)):
            (root / profile).mkdir(parents=True)
            (root / profile / "results.json").write_text(json.dumps(_profile_run(label, rate, rate / 2)))
    gzip_results(tmp_path / "packed" / "long")  # one profile of the atlas folder gzipped, the other plain
    assert atlas.merge_runs([str(tmp_path / "packed")]) == atlas.merge_runs([str(tmp_path / "plain")])
    assert set(atlas.merge_runs([str(tmp_path / "packed")])) == {"short", "long"}
    gzip_results(tmp_path / "packed")
    with pytest.raises(ValueError, match="no <profile>/results.json"):
        atlas.merge_runs([str(tmp_path / "packed" / "long")])  # a profile's folder, not the atlas's
    assert atlas.merge_runs([str(tmp_path / "packed")])["long"]["arms"][0]["label"] == "disagg"
    # --measured SPLIT=X/results.json:ARM where only X/results.json.gz is there
    planned = [{"split": "s", "predicted_capacity_rate": 9.0}]
    slos = {"ttft": 2000.0}
    then = planner.compare(planned, [f"s={tmp_path / 'plain' / 'long' / 'results.json'}:disagg"], slos, 0.9)
    now = planner.compare(planned, [f"s={tmp_path / 'packed' / 'long' / 'results.json'}:disagg"], slos, 0.9)
    assert [{**c, "results": None} for c in now] == [{**c, "results": None} for c in then]
    assert now[0]["measured_capacity_rate"] == 6.0 and now[0]["error"] == pytest.approx(0.5)


def test_the_gpu_scripts_compress_what_is_large_and_a_gzipped_step_trace_reads_the_same(tmp_path):
    """bench/run_gpu_common.sh's compress_big: a folder's results.json and steps-*.jsonl over 1 MB are gzipped in
    place, smaller files and other names left alone; `pdserve-bench trace` reads the gzipped trace as the plain one."""
    import os
    import subprocess

    from pdserve.bench.load import trace as tr
    from test_step_trace import _write

    folder = tmp_path / "arm"
    (folder / "steps").mkdir(parents=True)
    big = {"results": [{"request_rate": 1.0, "requests": [{"i": i, "ttft_ms": i * 0.5} for i in range(40000)]}]}
    (folder / "results.json").write_text(json.dumps(big))
    (folder / "summary.md").write_text("x" * 2_000_000)  # large, but not one of the two kinds
    steps = [{"t": i * 0.01, "done_t": i * 0.01 + 0.005, "decode": 1 + i % 48, "decode_ctx": 100 * (1 + i % 48)}
             for i in range(9000)]
    _write(folder / "steps" / "steps-colocated-0.jsonl", {"worker": "colocated-0", "role": "colocated"}, steps)
    _write(folder / "steps" / "steps-small-0.jsonl", {"worker": "small-0", "role": "decode", "device": "cuda:1"},
           steps[:3])
    assert (folder / "results.json").stat().st_size > 2**20
    assert (folder / "steps" / "steps-colocated-0.jsonl").stat().st_size > 2**20
    plain = tr.report([str(folder / "steps")], None)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", "-c", f'source bench/run_gpu_common.sh && compress_big "{folder}"'], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "PYTHON": "python3"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "results.json.gz", "steps/steps-colocated-0.jsonl.gz", "steps/steps-small-0.jsonl", "summary.md"]
    assert read_results(folder / "results.json") == big
    packed = tr.report([str(folder / "steps")], None)
    assert [w.pop("file") for w in packed["workers"]] == [str(folder / "steps" / n) for n in (
        "steps-colocated-0.jsonl.gz", "steps-small-0.jsonl")]
    for w in plain["workers"]:
        w.pop("file")
    assert packed == plain  # every figure the same
    # a trace there in both forms is read once, the plain file
    (folder / "steps" / "steps-small-0.jsonl.gz").write_bytes(gzip.compress(
        (folder / "steps" / "steps-small-0.jsonl").read_bytes()))
    assert [w["file"] for w in tr.report([str(folder / "steps")], None)["workers"]] == [
        str(folder / "steps" / n) for n in ("steps-colocated-0.jsonl.gz", "steps-small-0.jsonl")]
    assert len(plain["workers"]) == 2
