"""Where and on what a measurement was taken, written into every bench JSON by the bench itself.

    collect(devices)  -> dict   at the start of a run: commit (and whether the tree had local
                                changes), machine, CPU, GPU names and driver, torch/transformers/
                                triton versions, date, the command line, and the GPUs' clocks,
                                power and temperature now ("gpu_start")
    finish(record)    -> dict   at the end: the same GPU readings again ("gpu_end")
    gpu_state(devices)          the readings alone: SM and memory clock (MHz), power draw and
                                limit (W), temperature (C), one dict per GPU; None without nvidia-smi
    machine_slug(device)        the device's name for result files: "nvidia-h200", "cpu-x86-64"

A GPU at its power limit lowers its clock during long runs; start and end readings show it.
Torch is imported only to name CUDA devices, so `collect([])` works in torch-free processes.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"  # where a bench writes when not given --out
PACKAGES = ("torch", "transformers", "triton")
SMI_FIELDS = {  # nvidia-smi --query-gpu field -> our key (units: MHz, W, C)
    "clocks.sm": "sm_clock_mhz",
    "clocks.mem": "mem_clock_mhz",
    "power.draw": "power_draw_w",
    "power.limit": "power_limit_w",
    "temperature.gpu": "temperature_c",
}


def _run(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state() -> dict:
    """HEAD and whether tracked files differ from it (untracked files are not counted)."""
    if os.environ.get("PDSERVE_COMMIT"):
        # a copied tree (a GPU machine) whose .git, if any, is not the source's: the launcher
        # names the commit it copied and whether it had local changes
        return {"commit": os.environ["PDSERVE_COMMIT"], "dirty": os.environ.get("PDSERVE_DIRTY") == "1",
                "commit_from": "PDSERVE_COMMIT"}
    commit = _run(["git", "rev-parse", "HEAD"], REPO)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cuda_devices(devices: list[str]) -> list[dict]:
    """{bus_id, name} of each CUDA device named, once each. torch's numbering follows
    CUDA_VISIBLE_DEVICES and nvidia-smi's does not, so the PCI bus id is what both agree on."""
    names = sorted({d for d in devices if str(d).startswith("cuda")})
    if not names:
        return []
    import torch

    out = []
    for name in names:
        dev = torch.device(name)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        # an older torch without PCI ids: nvidia-smi's index, right unless CUDA_VISIBLE_DEVICES reorders
        bus_id = str(index) if bus is None else f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0"
        if all(d["bus_id"] != bus_id for d in out):
            out.append({"bus_id": bus_id, "name": props.name})
    return out


def gpu_state(ids: list[str]) -> list[dict] | None:
    """nvidia-smi's readings for each bus id; None when nvidia-smi is missing or fails."""
    if not ids:
        return None
    text = _run(["nvidia-smi", "-i", ",".join(ids), "--query-gpu=pci.bus_id," + ",".join(SMI_FIELDS),
                 "--format=csv,noheader,nounits"])
    if text is None:
        return None
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        row = {"bus_id": cells[0]}
        for key, cell in zip(SMI_FIELDS.values(), cells[1:]):
            try:
                row[key] = float(cell)
            except ValueError:  # "[N/A]"
                row[key] = None
        rows.append(row)
    return rows


def _gpus(cuda: list[dict]) -> list[dict] | None:
    if not cuda:
        return None
    text = _run(["nvidia-smi", "-i", ",".join(d["bus_id"] for d in cuda),
                 "--query-gpu=pci.bus_id,name,driver_version,memory.total", "--format=csv,noheader"])
    if text is None:  # no nvidia-smi: what torch knows
        return [{**d, "driver": None, "memory": None} for d in cuda]
    rows = []
    for line in text.splitlines():
        bus, name, driver, memory = (c.strip() for c in line.split(",", 3))
        rows.append({"bus_id": bus, "name": name, "driver": driver, "memory": memory})
    return rows


def collect(devices: list[str] | None = None, argv: list[str] | None = None) -> dict:
    """Everything above for a run on `devices` (e.g. ["cuda:0"], ["cpu"]); GPU fields None on CPU."""
    cuda = cuda_devices(devices or [])
    ids = [d["bus_id"] for d in cuda]
    return {
        **git_state(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv if argv is None else argv),
        "cwd": os.getcwd(),
        "machine": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "devices": list(devices or []),
        "gpus": _gpus(cuda),
        "versions": {p: _version(p) for p in PACKAGES},
        "gpu_bus_ids": ids,
        "gpu_start": gpu_state(ids),
        "gpu_end": None,
    }


def finish(record: dict) -> dict:
    """Add the GPUs' readings at the end of the run (clocks, power, temperature)."""
    record["gpu_end"] = gpu_state(record.get("gpu_bus_ids") or [])
    record["date_end"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return record


def describe(record: dict) -> str:
    """One line for a markdown header: commit, GPU (or CPU), driver, versions, date."""
    commit = (record.get("commit") or "unknown")[:10] + (" (local changes)" if record.get("dirty") else "")
    gpus = record.get("gpus")
    where = ", ".join(f"{g['name']} (driver {g['driver']})" for g in gpus) if gpus else record.get("cpu")
    v = record.get("versions", {})
    return (f"commit {commit}, {where}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
            f"triton {v.get('triton')}, {record.get('date')}")


def machine_slug(device) -> str:
    """`device` (a torch.device) named for result files."""
    if device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
