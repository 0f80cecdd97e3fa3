"""pdserve-bench ceilings on the CPU: the ZeroMQ loopback rows (plain and CURVE) measured and written; the copy
rows need a GPU and are left out with a line that says so."""

import json

import pytest

from pdserve.bench import cli


def test_zmq_rows_on_cpu(tmp_path, capsys):
    out = tmp_path / "ceil.json"
    assert cli.main(["ceilings", "--device", "cpu", "--streams", "2", "--mib", "16", "--frame-mib", "1",
                     "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["stage"], r["curve"], r["write"]) for r in rows] == [
        ("zmq", False, "none"), ("zmq", False, "memcpy"), ("zmq", True, "none"), ("zmq", True, "memcpy")]
    for r in rows:
        assert r["bytes"] == 16 << 20 and r["streams"] == 2
        assert 0 < r["min"] <= r["GBps"] <= r["max"]
    assert record["commit"] and record["what"] == "host ceilings for the zmq transport"
    md = out.with_suffix(".md").read_text()
    assert "| plain | 2 | none |" in md and "| CURVE | 2 | none |" in md
    assert "copies: no GPU named" in capsys.readouterr().out


def test_bad_stage_refused(tmp_path):
    with pytest.raises(SystemExit, match="--stages"):
        cli.main(["ceilings", "--device", "cpu", "--stages", "zmq,disk", "--out", str(tmp_path / "x.json")])
