"""The host's CPU around a load run: was the machine short of CPU while the workers launched their steps?

    python -m pdserve.bench.load.host_cpu snapshot FILE LABEL   append a snapshot of the machine's CPU accounting
    python -m pdserve.bench.load.host_cpu summary FILE          what changed between its first and last snapshot

A snapshot is the first line of /proc/stat (the machine's CPU time by kind, steal included: time a virtual
machine's cores were taken by the hypervisor), /proc/loadavg, and the CPU controller of this process's cgroup
where there is one (v2: cpu.stat's nr_throttled, throttled_usec and cpu.max; v1: cpu.stat's nr_throttled,
throttled_time and cpu.cfs_quota_us / cfs_period_us). A cgroup over its CPU quota is stopped, every thread of
it, until the next period: tens of milliseconds in which nothing the worker launches reaches the GPU.

Why: a step trace on an H100 showed prompt steps' launches stalling 45-140 ms under load, in steps of about
22 ms, with the device idle inside them (bench/results/defaults-h100-d2173b7/README.md). Throttling, steal and a
machine with more runnable threads than cores each look like that from inside the process; these counters
tell them apart. bench/run_defaults_gpu.sh snapshots before and after each arm into FOLDER/host-cpu.txt and
summarises it into FOLDER/host-cpu.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_dir() -> tuple[str | None, int]:
    """This process's CPU cgroup folder and its version (2 or 1), or (None, 0)."""
    text = _read("/proc/self/cgroup") or ""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and os.path.exists(f"/sys/fs/cgroup{path}/cpu.stat"):
            return f"/sys/fs/cgroup{path}", 2
        if "cpu" in controllers.split(","):
            for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
                if os.path.exists(f"{root}{path}/cpu.stat"):
                    return f"{root}{path}", 1
    return None, 0


def snapshot() -> dict:
    out: dict = {"unix_time": time.time(), "cores": os.cpu_count()}
    stat = (_read("/proc/stat") or "").splitlines()
    if stat and stat[0].startswith("cpu "):
        ticks = [int(x) for x in stat[0].split()[1:1 + len(STAT_FIELDS)]]
        out["stat_ticks"] = dict(zip(STAT_FIELDS, ticks))
    load = _read("/proc/loadavg")
    if load:
        out["loadavg"] = load.split()[:4]
    folder, version = _cgroup_dir()
    if folder:
        values = {}
        for line in (_read(f"{folder}/cpu.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                values[key] = int(value)
        quota = None
        if version == 2:
            quota = (_read(f"{folder}/cpu.max") or "").strip() or None
        else:
            q, p = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
            if q and p:
                quota = f"{q.strip()} {p.strip()}"
        out["cgroup"] = {"version": version, "path": folder, "quota": quota,
                         "nr_periods": values.get("nr_periods"), "nr_throttled": values.get("nr_throttled"),
                         "throttled_us": values.get("throttled_usec",
                                                    values["throttled_time"] // 1000 if "throttled_time" in values
                                                    else None)}
    return out


def summarize(snaps: list[dict]) -> dict:
    """Between the first and the last snapshot: the machine's CPU by kind as shares of all cores' time, the
    cgroup's throttled periods and time (where it has a quota), the load averages at the end."""
    if len(snaps) < 2:
        raise ValueError("a summary needs a snapshot before and one after")
    a, b = snaps[0], snaps[-1]
    out: dict = {"seconds": b["unix_time"] - a["unix_time"], "cores": b.get("cores"), "loadavg_end": b.get("loadavg")}
    if "stat_ticks" in a and "stat_ticks" in b:
        delta = {k: b["stat_ticks"][k] - a["stat_ticks"][k] for k in STAT_FIELDS}
        total = sum(delta.values()) or 1
        out["shares"] = {k: v / total for k, v in delta.items()}
    ca, cb = a.get("cgroup"), b.get("cgroup")
    if ca and cb:
        def diff(key):
            return None if ca.get(key) is None or cb.get(key) is None else cb[key] - ca[key]
        out["cgroup"] = {"quota": cb.get("quota"), "periods": diff("nr_periods"), "throttled_periods":
                         diff("nr_throttled"), "throttled_s": None if diff("throttled_us") is None
                         else diff("throttled_us") / 1e6}
    return out


def describe_quota(quota: str | None) -> str:
    """cpu.max ("max 100000", "800000 100000") or v1's "quota period" ("-1 100000") in words."""
    parts = (quota or "").split()
    if len(parts) != 2 or parts[0] in ("max", "-1"):
        return "none"
    q, p = int(parts[0]), int(parts[1])
    return f"{q} us per {p} us ({q / p:.1f} cores)"


def render(s: dict) -> str:
    lines = [f"Host CPU over {s['seconds']:.0f} s ({s.get('cores')} cores; load average at the end "
             f"{' '.join((s.get('loadavg_end') or ['-'])[:3])}):"]
    sh = s.get("shares")
    if sh:
        busy = 1 - sh["idle"] - sh["iowait"]
        lines.append(f"- all cores: {busy:.0%} busy (user {sh['user']:.0%}, system {sh['system']:.0%}, "
                     f"softirq {sh['softirq']:.0%}), steal {sh['steal']:.1%} (time the hypervisor took the cores)")
    cg = s.get("cgroup")
    if cg:
        quota = describe_quota(cg.get("quota"))
        if cg.get("throttled_periods") is None:
            lines.append(f"- cgroup CPU quota {quota}: throttling not counted here")
        else:
            lines.append(f"- cgroup CPU quota {quota}: throttled in {cg['throttled_periods']} of {cg['periods']} "
                         f"periods, {cg['throttled_s']:.2f} s in all (every thread stopped until the next period)")
    else:
        lines.append("- no CPU cgroup to read (no quota known)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "snapshot":
        with open(argv[1], "a") as f:
            f.write(json.dumps({"label": argv[2], **snapshot()}) + "\n")
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        snaps = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
        try:
            print(render(summarize(snaps)))
        except ValueError as e:
            print(f"host_cpu: {argv[1]}: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m pdserve.bench.load.host_cpu snapshot FILE LABEL | summary FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
