"""The suite's `alone` marker (tests/conftest.py): under `-n 2`, a test marked `alone` runs with no other
test beside it, and the ordinary tests still run two at a time. Checked on a small suite of its own in a
subprocess, each test writing when it started and ended."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = '''
import json, os, time
import pytest

LOG = os.environ["ALONE_LOG"]

def spans(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_ordinary(i):
    spans(f"ordinary{i}", 0.4)

@pytest.mark.alone
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    spans(f"alone{i}", 0.4)
'''


def test_an_alone_test_overlaps_no_other_and_ordinary_tests_still_run_side_by_side(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    (suite / "test_spans.py").write_text(TESTS)
    log = tmp_path / "spans.jsonl"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "-o",
                          "addopts=", str(suite)], cwd=suite, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "ALONE_LOG": str(log)})
    assert out.returncode == 0, out.stdout + out.stderr
    spans = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(spans) == 8

    def overlap(a, b):
        return min(a[2], b[2]) - max(a[1], b[1]) > 0

    alone = [s for s in spans if s[0].startswith("alone")]
    ordinary = [s for s in spans if s[0].startswith("ordinary")]
    for a in alone:
        beside = [s[0] for s in spans if s is not a and overlap(a, s)]
        assert not beside, f"{a[0]} ran beside {beside}"
    # the lock serialises only what it must: some ordinary tests ran two at a time
    assert any(overlap(a, b) for i, a in enumerate(ordinary) for b in ordinary[i + 1:]), spans
