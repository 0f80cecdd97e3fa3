"""What the device did during a profiled run, from torch.profiler's chrome trace: how many kernels, how long
the device was busy over the span they cover and how long it sat between them, and where the kernel time
went by kind. `pdserve-bench engine --profile-decode DIR` writes it beside the trace (kernels.json and
kernels.txt), so a decode step's distance from its roofline splits into kernels' own time, the gaps between
them, and the many small kernels' share.

    summarize(trace, steps=None) -> dict     trace: the chrome trace's JSON (a dict); steps: how many engine
                                             steps the run made (per-step figures where given)
    render(summary) -> str

Kinds, by kernel name (first match): gemm (cuBLAS/CUTLASS/nvjet matrix products), attention (paged decode,
flash, fmha, our Triton attention kernels), copy (memcpy, memset), fused (Inductor's triton_ kernels: norms,
rotary, activations, residual adds), other. A kernel under SMALL_US microseconds counts as small: in a
decode step of a 7B model most of the non-GEMM kernels are, and each costs its launch and tail whatever it
does. Torch-free.
"""

from __future__ import annotations

import re

KINDS = (("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas", re.I)),
         ("attention", re.compile(r"attention|attn|flash|fmha|paged|_combine|prefix", re.I)),
         ("copy", re.compile(r"memcpy|memset|copy", re.I)),
         ("fused", re.compile(r"^triton_", re.I)))
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SMALL_US = 5.0
TOP = 15


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def summarize(trace: dict, steps: int | None = None) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in DEVICE_CATS and "dur" in e and "ts" in e]
    events.sort(key=lambda e: float(e["ts"]))
    out = {"kernels": len(events), "steps": steps, "span_us": 0.0, "busy_us": 0.0, "gap_us": 0.0, "by_kind": {},
           "small_kernels": 0, "small_us": 0.0, "top": []}
    if not events:
        return out
    start = float(events[0]["ts"])
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    busy, reach = 0.0, start
    for e in events:  # the union of the kernels' intervals (streams may overlap them)
        a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    out.update(span_us=end - start, busy_us=busy, gap_us=end - start - busy)
    names: dict[str, list[float]] = {}
    for e in events:
        d = float(e["dur"])
        row = out["by_kind"].setdefault(kind(e["name"]), {"kernels": 0, "us": 0.0})
        row["kernels"] += 1
        row["us"] += d
        names.setdefault(e["name"], []).append(d)
        if d < SMALL_US:
            out["small_kernels"] += 1
            out["small_us"] += d
    top = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    out["top"] = [{"name": n, "kind": kind(n), "count": len(ds), "us": sum(ds), "mean_us": sum(ds) / len(ds)}
                  for n, ds in top]
    if steps:
        out["per_step"] = {"kernels": len(events) / steps, "busy_us": busy / steps,
                           "gap_us": (end - start - busy) / steps, "small_kernels": out["small_kernels"] / steps}
    return out


def render(s: dict) -> str:
    if not s["kernels"]:
        return "no device kernels in the trace (a CPU run)"
    share = s["busy_us"] / s["span_us"] if s["span_us"] else 1.0
    lines = [f"{s['kernels']} device kernels over {s['span_us'] / 1e3:.2f} ms: busy {s['busy_us'] / 1e3:.2f} ms "
             f"({share:.0%}), between kernels {s['gap_us'] / 1e3:.2f} ms; "
             f"{s['small_kernels']} under {SMALL_US:g} us ({s['small_us'] / 1e3:.2f} ms)"]
    if s.get("per_step"):
        p = s["per_step"]
        lines.append(f"per step ({s['steps']}): {p['kernels']:.0f} kernels, busy {p['busy_us'] / 1e3:.3f} ms, "
                     f"gaps {p['gap_us'] / 1e3:.3f} ms, {p['small_kernels']:.0f} small")
    for k, row in sorted(s["by_kind"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"  {k:<10} {row['kernels']:>7} kernels {row['us'] / 1e3:9.2f} ms")
    lines.append("top kernels by time:")
    for t in s["top"]:
        lines.append(f"  {t['us'] / 1e3:8.2f} ms  {t['count']:>6} x {t['mean_us']:7.1f} us  [{t['kind']}] {t['name'][:90]}")
    return "\n".join(lines)
