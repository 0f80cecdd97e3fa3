"""bench/load/host_cpu.py: the host's CPU accounting around a load run (throttling, steal, busy share), read
from /proc and the CPU cgroup, and the summary between two snapshots."""

from __future__ import annotations

import json

from pdserve.bench.load import host_cpu


def test_a_snapshot_of_this_machine_reads_proc_and_any_cgroup(tmp_path):
    snap = host_cpu.snapshot()
    assert snap["cores"] >= 1 and set(snap["stat_ticks"]) == set(host_cpu.STAT_FIELDS)
    assert len(snap["loadavg"]) == 4
    if "cgroup" in snap:  # where the CPU controller is mounted
        assert snap["cgroup"]["version"] in (1, 2)
    f = tmp_path / "host-cpu.txt"
    assert host_cpu.main(["snapshot", str(f), "before"]) == 0
    x = sum(i * i for i in range(200_000))  # some CPU between the two
    assert x and host_cpu.main(["snapshot", str(f), "after"]) == 0
    labels = [json.loads(line)["label"] for line in f.read_text().splitlines()]
    assert labels == ["before", "after"]
    assert host_cpu.main(["summary", str(f)]) == 0


def _snap(t, ticks, throttled=None):
    out = {"unix_time": t, "cores": 16, "loadavg": ["9.5", "8.0", "4.0", "20/900"],
           "stat_ticks": dict(zip(host_cpu.STAT_FIELDS, ticks))}
    if throttled is not None:
        out["cgroup"] = {"version": 2, "path": "/x", "quota": "1600000 100000", "nr_periods": throttled[0],
                         "nr_throttled": throttled[1], "throttled_us": throttled[2]}
    return out


def test_the_summary_says_how_busy_the_cores_were_and_how_long_the_cgroup_was_throttled():
    before = _snap(100.0, [1000, 0, 200, 5000, 0, 0, 50, 10], (100, 3, 40_000))
    after = _snap(160.0, [5000, 0, 1000, 5500, 100, 0, 250, 150], (700, 63, 2_440_000))
    s = host_cpu.summarize([before, after])
    total = 4000 + 800 + 500 + 100 + 200 + 140
    assert s["seconds"] == 60.0 and abs(s["shares"]["user"] - 4000 / total) < 1e-12
    assert abs(s["shares"]["steal"] - 140 / total) < 1e-12
    assert s["cgroup"] == {"quota": "1600000 100000", "periods": 600, "throttled_periods": 60, "throttled_s": 2.4}
    text = host_cpu.render(s)
    assert "16.0 cores" in text and "throttled in 60 of 600 periods, 2.40 s in all" in text
    assert f"{1 - (500 + 100) / total:.0%} busy" in text and "steal 2.4%" in text


def test_no_quota_and_no_cgroup_are_said_as_such(tmp_path, capsys):
    s = host_cpu.summarize([_snap(0.0, [0] * 8), _snap(1.0, [1, 0, 0, 1, 0, 0, 0, 0])])
    assert "no CPU cgroup to read" in host_cpu.render(s)
    assert host_cpu.describe_quota("max 100000") == "none" and host_cpu.describe_quota("-1 100000") == "none"
    f = tmp_path / "one.txt"
    f.write_text(json.dumps(_snap(0.0, [0] * 8)) + "\n")
    assert host_cpu.main(["summary", str(f)]) == 2
    assert "needs a snapshot before and one after" in capsys.readouterr().err
