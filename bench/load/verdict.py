"""The verdict of a load run with several arms, in words, for the top of summary.md:

    capacity_line(run)     which arm met the SLOs at the higher rate (capacity search), and by how much
    point_lines(run)       per load point: which arms met the SLOs (or whose TTFT was lower), by how much,
                           and each arm's dominant TTFT phase (the largest part of its mean TTFT split)
    shared_host_lines(run) warnings where arms (or one arm's workers) shared a host's CPU or GPU, so the
                           comparison measures contention as much as the design
"""

from __future__ import annotations

from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _arm(block: dict) -> str:
    return block.get("arm") or block.get("policy") or "default"


def _ms(value: float) -> str:
    return f"{value / 1e3:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def dominant_phase(block: dict) -> str | None:
    """'prefill (61% of TTFT)': the largest part of the mean TTFT split (server phases and the client's part)."""
    split = block.get("ttft_split_ms") or {}
    ttft = split.get("ttft")
    parts = {k: v for k, v in split.items() if k not in ("ttft", "server_ttft", "first_step") and v}
    if not ttft or not parts:
        return None
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} ({value / ttft:.0%} of TTFT)"


def capacity_line(run: dict) -> list[str]:
    caps = {a["label"]: a["capacity"]["capacity_rate"] for a in run.get("arms") or [] if a.get("capacity")}
    caps = {k: v for k, v in caps.items() if v is not None}
    if len(caps) < 2:
        return []
    (best, high), *rest = sorted(caps.items(), key=lambda kv: -kv[1])
    others = ", ".join(f"{a} {r:.3g}/s" for a, r in rest)
    if all(r == high for _, r in rest):
        return [f"- capacity: every arm met the SLOs up to the same rate, {high:.3g}/s"]
    low = rest[0][1]
    ratio = f"{high / low:.2f}x" if low > 0 else "where the other met them at no probed rate"
    return [f"- capacity: **{best}** met the SLOs at the higher rate, {high:.3g}/s against {others}: "
            f"{ratio}, +{high - low:.3g} req/s"]


def point_lines(run: dict) -> list[str]:
    points: dict[str, list[dict]] = {}
    for b in run["results"]:
        if b.get("completed"):
            points.setdefault(b["load_label"] + (f" ({b['phase']})" if b.get("phase") not in (None, "point") else ""),
                              []).append(b)
    lines = []
    for point, blocks in points.items():
        if len({_arm(b) for b in blocks}) < 2:
            continue
        lines.append(f"- {point}: {_compare(blocks)}; dominant TTFT phase: "
                     + ", ".join(f"{_arm(b)} {dominant_phase(b) or '- (no timings)'}" for b in blocks))
    return lines


def _compare(blocks: list[dict]) -> str:
    ttft = {_arm(b): b.get("median_ttft_ms") for b in blocks}
    if all(b.get("goodput_fraction") is not None for b in blocks):
        met = [b for b in blocks if b.get("meets_goodput_target")]
        shares = ", ".join(f"{_arm(b)} {b['goodput_fraction']:.0%}" for b in blocks)
        if met and len(met) < len(blocks):
            return (f"**{', '.join(_arm(b) for b in met)}** met the SLOs and "
                    f"{', '.join(_arm(b) for b in blocks if b not in met)} did not (requests within them: {shares})")
        head = "every arm met the SLOs" if met else "no arm met the SLOs"
        return f"{head} ({shares}); {_ttft_words(ttft)}"
    return _ttft_words(ttft)


def _ttft_words(ttft: dict[str, float | None]) -> str:
    known = sorted(((v, a) for a, v in ttft.items() if v is not None))
    if len(known) < 2:
        return "TTFT not compared (too few answers)"
    (low, best), (high, _) = known[0], known[-1]
    return f"**{best}**'s TTFT p50 is {high / low:.2f}x lower ({_ms(low)} against {_ms(high)})" if low > 0 \
        else f"**{best}**'s TTFT p50 is the lowest"


def shared_host_lines(run: dict) -> list[str]:
    arms = run.get("arms") or []
    machine = run["environment"]["machine"]
    gpus = [g for g in (machine.get("gpus") or "").splitlines() if g.strip()]
    own_servers = [a for a in arms if a.get("server")]
    lines = []
    if run.get("policy_runs") == "interleaved" and len(run.get("policies") or []) > 1:
        lines.append("- **shared at once**: the policies' requests ran interleaved on one server, so each arm's "
                     "latency includes the other arms' load on the same host")
    elif len(arms) > 1 and not own_servers:
        lines.append("- **one server for every arm**: the arms ran one after another on the same server, whose "
                     "workers for the other policies stayed up beside them on the same host (CPU, memory, GPU)")
    local = bool(own_servers) or urlparse(run.get("base_url") or "").hostname in LOOPBACK
    if local and not gpus:
        lines.append(f"- **one CPU for everything**: no GPU seen; the workers and this load generator share this "
                     f"host's {machine.get('cpu_count') or '?'} CPU cores, so the arms compete for cores: a "
                     "CPU run compares contention, not the designs as they would run on GPUs")
    elif local and len(gpus) == 1:
        lines.append("- **one GPU**: every worker of an arm ran on this host's one GPU (a disaggregated arm's "
                     "prefill and decode workers time-slice it)")
    return lines


def verdict_lines(run: dict) -> list[str]:
    body = capacity_line(run) + point_lines(run) + shared_host_lines(run)
    return ["", "**Verdict** (from the tables below):", "", *body] if body else []
