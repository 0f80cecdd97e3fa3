"""`pdserve-bench spy` (bench/load/spy.py): py-spy's sampled stacks counted per thread, and inside the
engine's step launches, from a speedscope file written here by hand."""

from __future__ import annotations

import gzip
import json

import pytest

from pdserve.bench.cli import main
from pdserve.bench.load import spy

FRAMES = [{"name": "main", "file": "/x/cli.py", "line": 1}, {"name": "Engine.step", "file": "/x/engine.py", "line": 269},
          {"name": "Engine._launch", "file": "/x/engine.py", "line": 285},
          {"name": "host_wait", "file": "/x/step_trace.py", "line": 97},
          {"name": "MixedGraphs.run", "file": "/x/graphs.py", "line": 350},
          {"name": "Inbox.take", "file": "/x/worker.py", "line": 130}, {"name": "Inbox._read", "file": "/x/worker.py", "line": 151}]


def _file(tmp_path, gz=False):
    main_thread = [[0, 1, 2, 3]] * 6 + [[0, 1, 2, 4]] * 2 + [[0, 5]] * 2  # 8 in a launch: 6 waiting, 2 replaying
    inbox = [[6]] * 4
    data = {"$schema": "https://www.speedscope.app/file-format-schema.json", "shared": {"frames": FRAMES},
            "profiles": [{"type": "sampled", "name": 'Thread 1 "MainThread"', "unit": "seconds", "samples": main_thread,
                          "weights": [0.01] * len(main_thread)},
                         {"type": "sampled", "name": 'Thread 2 "inbox"', "unit": "seconds", "samples": inbox,
                          "weights": [0.01] * len(inbox)}]}
    path = tmp_path / ("spy-1.json.gz" if gz else "spy-1.json")
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        json.dump(data, f)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_the_samples_inside_a_launch_say_where_it_waited(tmp_path, gz):
    out = spy.summarize(_file(tmp_path, gz))
    main_thread, inbox = out["threads"]
    assert main_thread["samples"] == 10 and inbox["samples"] == 4 and inbox["launch"] is None
    leaf = {r["frame"]: r["share"] for r in main_thread["leaf"]}
    assert leaf == {"host_wait (step_trace.py:97)": 0.6, "MixedGraphs.run (graphs.py:350)": 0.2,
                    "Inbox.take (worker.py:130)": 0.2}
    inclusive = {r["frame"]: r["samples"] for r in main_thread["inclusive"]}
    assert inclusive["main (cli.py:1)"] == 10 and inclusive["Engine._launch (engine.py:285)"] == 8
    launch = main_thread["launch"]
    assert launch["samples"] == 8
    assert [(r["frame"], r["share"]) for r in launch["leaf"]] == [("host_wait (step_trace.py:97)", 0.75),
                                                                  ("MixedGraphs.run (graphs.py:350)", 0.25)]
    text = spy.render(out)
    assert "Inside `Engine._launch`: 8 samples (80% of the thread's)" in text and "| `host_wait (step_trace.py:97)` | 75% |" in text


def test_the_command_writes_its_summary_and_refuses_what_is_not_speedscope(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["spy", str(path), "--out", str(tmp_path / "spy.json")]) == 0
    saved = json.loads((tmp_path / "spy.json").read_text())
    assert saved["files"][0]["threads"][0]["launch"]["samples"] == 8 and "provenance" in saved
    assert "## Thread 1 \"MainThread\": 10 samples" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    assert main(["spy", str(tmp_path / "other.json")]) == 2
    assert "not a speedscope file" in capsys.readouterr().out
