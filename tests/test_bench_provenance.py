"""bench/provenance.py: the commit and versions a bench JSON records, and nvidia-smi's readings
parsed from a fake nvidia-smi (this machine has no GPU)."""

from __future__ import annotations

import os
import stat
import subprocess

from pdserve.bench import provenance

FAKE_SMI = """#!/bin/sh
case "$*" in
  *clocks.sm*) echo "00000000:19:00.0, 1980, 2619, 123.45, 700.00, 41" ;;
  *driver_version*) echo "00000000:19:00.0, NVIDIA H200, 580.159.04, 143771 MiB" ;;
esac
"""


def test_collect_on_cpu_records_the_commit_and_versions(monkeypatch):
    monkeypatch.delenv("PDSERVE_COMMIT", raising=False)
    record = provenance.collect(["cpu"], argv=["pdserve-bench", "engine", "--device", "cpu"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance.REPO, capture_output=True, text=True)
    assert record["commit"] == head.stdout.strip() and isinstance(record["dirty"], bool)
    assert record["command"] == "pdserve-bench engine --device cpu"
    assert record["versions"]["torch"] and record["versions"]["transformers"]
    assert record["gpus"] is None and record["gpu_start"] is None and record["cpu_count"] >= 1
    provenance.finish(record)
    assert record["gpu_end"] is None and record["date_end"] >= record["date"]
    assert record["commit"][:10] in provenance.describe(record)


def test_gpu_readings_come_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    state = provenance.gpu_state(["00000000:19:00.0"])
    assert state == [{"bus_id": "00000000:19:00.0", "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0,
                      "power_draw_w": 123.45, "power_limit_w": 700.0, "temperature_c": 41.0}]
    gpus = provenance._gpus([{"bus_id": "00000000:19:00.0", "name": "NVIDIA H200"}])
    assert gpus == [{"bus_id": "00000000:19:00.0", "name": "NVIDIA H200", "driver": "580.159.04",
                     "memory": "143771 MiB"}]


def test_no_nvidia_smi_means_none(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi, no git either
    assert provenance.gpu_state(["00000000:19:00.0"]) is None
    assert provenance.gpu_state([]) is None


def test_a_copied_tree_takes_its_commit_from_the_launcher(monkeypatch):
    monkeypatch.setenv("PDSERVE_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("PDSERVE_DIRTY", "1")
    state = provenance.git_state()
    assert state == {"commit": "0123456789abcdef", "dirty": True, "commit_from": "PDSERVE_COMMIT"}
