"""`pdserve-bench transfer --profile-transfer DIR`: one ipc bulk transfer's finish() under torch.profiler.

After the table, one more bulk transfer at the longest length (checked exact like every run) runs its
finish() (the copies, the wait for them, the done notice and its ack) under the profiler:

    profiled(fn, out_dir, device) -> (fn(), summary | None)   out_dir None: fn() alone, no profiler
    summarize(trace) -> dict         from the Chrome trace torch.profiler writes:
        gpu        every copy and kernel on the GPU in order: its name, bytes, start, duration and the gap
                   before it (us, the GPU's clock); their count, bytes, busy time, span and gaps
        cuda       the CUDA runtime calls by name (cudaMemcpyAsync, cudaStreamWaitEvent, cudaEventRecord,
                   cudaEventQuery: the host's polls, ...) and the synchronisations among them
        cpu_copies the aten copy ops (copy_, index_select, index_copy_) with their shapes and dtypes: what
                   the transport asked of torch (the same on the CPU, where there is no GPU clock)
        latency_us the host around the copies: its first CUDA call (the ready event) -> its first copy call
                   -> the GPU running that copy; the last GPU op done -> the first event poll after it
        before_first_issue  the Python functions that ran wholly between that first CUDA call and the first
                   copy call (the profile records Python stacks), longest first: where the host's time went
    describe(summary) -> str         one paragraph for the markdown

DIR gets the trace (transfer-trace.json.gz, open in Perfetto) and the summary (transfer-profile.json).
"""

from __future__ import annotations

import collections
import gzip
import json
import shutil
from pathlib import Path

import torch

GPU_CATS = ("gpu_memcpy", "kernel", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
COPY_OPS = ("aten::copy_", "aten::index_select", "aten::index_copy_")
ISSUES = ("cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
          "cuLaunchKernelEx")
LISTED = 64  # ops listed one by one (the counts cover all)
BEFORE = 8  # Python functions listed from before the first copy call


def profiled(fn, out_dir: str | None, device: torch.device):
    """fn() under torch.profiler (CPU, and CUDA on a GPU), its trace and summary written to out_dir."""
    if not out_dir:
        return fn(), None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        result = fn()
    raw = out / "transfer-trace.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with raw.open("rb") as src, gzip.open(out / "transfer-trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    summary = {"trace": str(out / "transfer-trace.json.gz"), **summarize(trace)}
    (out / "transfer-profile.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result, summary


def summarize(trace: dict) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") in RUNTIME_CATS), key=lambda e: e["ts"])
    ops, prev_end = [], None
    for e in gpu:
        ops.append({"name": e["name"], "kind": e["cat"], "bytes": e.get("args", {}).get("bytes"),
                    "start_us": e["ts"] - gpu[0]["ts"], "dur_us": e["dur"],
                    "gap_us": None if prev_end is None else e["ts"] - prev_end})
        prev_end = e["ts"] + e["dur"] if prev_end is None else max(prev_end, e["ts"] + e["dur"])
    busy = sum(e["dur"] for e in gpu)
    span = (prev_end - gpu[0]["ts"]) if gpu else 0.0
    calls = collections.Counter(e["name"] for e in runtime)
    copies = [e for e in events if e.get("cat") == "cpu_op" and e["name"] in COPY_OPS]
    issued = [e for e in runtime if e["name"] in ISSUES]
    queries = [e for e in runtime if e["name"] == "cudaEventQuery"]
    before = []
    if issued and runtime:
        a, b = runtime[0]["ts"], issued[0]["ts"]
        inside = [e for e in events if e.get("cat") == "python_function" and e["ts"] >= a and e["ts"] + e["dur"] <= b]
        before = [{"name": e["name"], "us": e["dur"]} for e in sorted(inside, key=lambda e: -e["dur"])[:BEFORE]]
    return {
        "gpu": {"ops": len(gpu), "memcpys": sum(e["cat"] == "gpu_memcpy" for e in gpu),
                "kernels": sum(e["cat"] == "kernel" for e in gpu),
                "bytes": sum(op["bytes"] or 0 for op in ops), "busy_us": busy, "span_us": span,
                "gaps_us": span - busy if gpu else 0.0,
                "largest_gap_us": max((op["gap_us"] for op in ops[1:]), default=0.0),
                "listed": ops[:LISTED]},
        "cuda": {"calls": dict(calls.most_common()),
                 "synchronizations": {k: n for k, n in calls.items() if "ynchronize" in k}},
        "cpu_copies": {"counts": dict(collections.Counter(e["name"] for e in copies)),
                       "listed": [{"name": e["name"], "dims": e.get("args", {}).get("Input Dims"),
                                   "types": e.get("args", {}).get("Input type")} for e in copies[:LISTED]]},
        "latency_us": {
            "first_call_to_first_issue": (issued[0]["ts"] - runtime[0]["ts"]) if issued else None,
            "first_issue_to_gpu": (gpu[0]["ts"] - issued[0]["ts"]) if gpu and issued else None,
            "gpu_end_to_poll": (next((q["ts"] - prev_end for q in queries if q["ts"] >= prev_end), None)
                                if gpu else None),
        },
        "before_first_issue": before,
    }


def describe(summary: dict) -> str:
    g, c = summary["gpu"], summary["cuda"]
    syncs = ", ".join(f"{k} x{n}" for k, n in c["synchronizations"].items()) or "none"
    cpu = ", ".join(f"{k} x{n}" for k, n in summary["cpu_copies"]["counts"].items()) or "none"
    first = summary["cpu_copies"]["listed"][:1]
    if first:
        cpu += f" (the first {first[0]['name']} of {first[0]['dims']} {first[0]['types']})"
    text = f"finish() under torch.profiler ({summary['trace']}): torch copy ops {cpu}"
    if g["ops"]:
        lat = summary["latency_us"]
        sizes = collections.Counter(op["bytes"] for op in g["listed"] if op["bytes"])
        text += (f"; on the GPU {g['ops']} ops ({g['memcpys']} memcpy, {g['kernels']} kernels) moving "
                 f"{g['bytes'] / 2**20:.1f} MiB ("
                 + ", ".join(f"{n} x {b / 2**20:.1f} MiB" for b, n in sizes.most_common(3))
                 + f"), busy {g['busy_us']:.0f} us over a span of {g['span_us']:.0f} us (gaps {g['gaps_us']:.0f} us, "
                 f"largest {g['largest_gap_us']:.1f} us); host: first CUDA call to first copy call "
                 f"{_us(lat['first_call_to_first_issue'])}, to the GPU running it {_us(lat['first_issue_to_gpu'])}, "
                 f"last GPU op done to the next event poll {_us(lat['gpu_end_to_poll'])}; CUDA calls "
                 + ", ".join(f"{k} x{n}" for k, n in list(c["calls"].items())[:8]))
    before = summary.get("before_first_issue") or []
    if before:
        text += ("; before the first copy call, the longest Python functions: "
                 + ", ".join(f"{b['name']} {b['us']:.0f} us" for b in before[:4]))
    return text + f"; synchronisations: {syncs}"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} us"
