"""PNG plots of a load run, drawn from the result blocks alone (so `python -m pdserve.bench.load.plots results.json`
redraws them): CDFs of TTFT and ITL per arm (one panel per load point; with a capacity search, per
sweep factor), p50/p99 TTFT and ITL against the load, SLO attainment and achieved throughput against
the offered rate (capacity and saturated runs marked), the TTFT split into server phases per arm, and
for multi-turn runs TTFT per turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, path: Path, dpi: int = 110) -> Path:
    """Lay the figure out, write it to `path` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def policy_name(block: dict) -> str:
    """The arm a block belongs to (its policy where no arm was named)."""
    return block.get("arm") or block.get("policy") or "default"


def _point(block: dict) -> str:
    return block.get("point") or block["load_label"]


def _points(blocks: list[dict]) -> list[str]:
    return list(dict.fromkeys(_point(b) for b in blocks))


def _measured(blocks: list[dict]) -> list[dict]:
    """The blocks a reader compares arms on: all but the capacity search's probes (when others exist)."""
    rest = [b for b in blocks if b.get("phase") != "probe"]
    return rest or blocks


def _rate_blocks(blocks: list[dict]) -> list[dict]:
    return [b for b in blocks if isinstance(b.get("request_rate"), (int, float))]


def _saturated(block: dict) -> bool:
    return bool((block.get("saturation") or {}).get("saturated"))


def _policies(blocks: list[dict]) -> list[str]:
    return list(dict.fromkeys(policy_name(b) for b in blocks))


def _colors(policies: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {p: cycle[i % len(cycle)] for i, p in enumerate(policies)}


def _once(ax, label: str) -> str | None:
    """`label` the first time it is drawn on `ax`, None after: every kind of mark in the legend once, whichever
    arm or point draws it first."""
    return None if label in ax.get_legend_handles_labels()[1] else label


def _cdf(blocks: list[dict], values_of, xlabel: str, title: str, path: Path) -> None:
    points, policies = _points(blocks), _policies(blocks)
    colors = _colors(policies)
    fig, axes = plt.subplots(1, len(points), figsize=(5 * len(points), 4), squeeze=False)
    for ax, point in zip(axes[0], points):
        for b in blocks:
            if _point(b) != point:
                continue
            values = np.sort(np.asarray(values_of(b), dtype=float))
            where = "" if _point(b) == b["load_label"] else f", {b['load_label']}"
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"{policy_name(b)}{where} (n={values.size})", color=colors[policy_name(b)])
        ax.set_title(point)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if "TTFT" in xlabel else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save(fig, path)


def _ok_requests(b: dict) -> list[dict]:
    return [r for r in b["requests"] if r["success"]]


def plot_cdfs(blocks: list[dict], out_dir: Path) -> list[Path]:
    ttft, itl = out_dir / "cdf_ttft.png", out_dir / "cdf_itl.png"
    _cdf(blocks, lambda b: [r["ttft_s"] * 1e3 for r in _ok_requests(b)], "TTFT (ms)", "CDF of time to first token",
         ttft)
    _cdf(blocks, lambda b: [g * 1e3 for r in _ok_requests(b) for g in r["itls_s"]], "inter-token gap (ms)",
         "CDF of inter-token latency", itl)
    return [ttft, itl]


def plot_latency_vs_load(blocks: list[dict], out_dir: Path) -> Path:
    """Against the offered rate on a numeric axis when every block is an open-loop rate (probes and
    sweep of a capacity search together), else one tick per load point. Saturated runs get a red x."""
    policies = _policies(blocks)
    colors = _colors(policies)
    numeric = len(_rate_blocks(blocks)) == len(blocks)
    points = _points(blocks)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "ITL (ms)")):
        for policy in policies:
            mine = [b for b in blocks if policy_name(b) == policy]
            if numeric:
                mine = sorted(mine, key=lambda b: b["request_rate"])
                x = [b["request_rate"] for b in mine]
            else:
                by_point = {_point(b): b for b in mine}
                mine = [by_point.get(p) for p in points]
                x = list(range(len(points)))
            for stat, style in (("median", "-o"), ("p99", "--s")):
                y = [np.nan if b is None or b.get(f"{stat}_{metric}_ms") is None else b[f"{stat}_{metric}_ms"]
                     for b in mine]
                ax.plot(x, y, style, color=colors[policy], label=f"{policy} {'p50' if stat == 'median' else stat}")
                sat = [(xi, yi) for xi, yi, b in zip(x, y, mine) if b is not None and _saturated(b)]
                if sat:
                    ax.plot(*zip(*sat), "x", color="red", markersize=9, label=_once(ax, "past saturation"))
        if not numeric:
            ax.set_xticks(range(len(points)), points)
        ax.set_xlabel(blocks[0]["load_kind"])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("TTFT p50 / p99 against load")
    axes[1].set_title("ITL p50 / p99 against load")
    return save(fig, out_dir / "latency_vs_load.png")


def capacities(blocks: list[dict]) -> dict[str, float]:
    """Per arm, the highest rate whose capacity-search probe met the goodput target."""
    out: dict[str, float] = {}
    for b in blocks:
        if b.get("phase") == "probe" and b.get("meets_goodput_target"):
            out[policy_name(b)] = max(out.get(policy_name(b), 0.0), b["request_rate"])
    return out


def plot_goodput_vs_rate(blocks: list[dict], out_dir: Path) -> Path | None:
    """Left: share of requests meeting every SLO against the offered rate, the target as a line and each
    arm's capacity dotted. Right: achieved against offered throughput (y = x: keeping up)."""
    runs = [b for b in _rate_blocks(blocks) if b.get("goodput_fraction") is not None]
    if not runs:
        return None
    policies = _policies(runs)
    colors = _colors(policies)
    caps = capacities(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in policies:
        mine = sorted((b for b in runs if policy_name(b) == policy), key=lambda b: b["request_rate"])
        x = [b["request_rate"] for b in mine]
        left.plot(x, [b["goodput_fraction"] for b in mine], "-o", color=colors[policy], label=policy)
        right.plot(x, [b["request_throughput"] or 0.0 for b in mine], "-o", color=colors[policy], label=policy)
        for ax, key in ((left, "goodput_fraction"), (right, "request_throughput")):
            sat = [(b["request_rate"], b[key] or 0.0) for b in mine if _saturated(b)]
            if sat:
                ax.plot(*zip(*sat), "x", color="red", markersize=9, label=_once(ax, "past saturation"))
        if policy in caps:
            left.axvline(caps[policy], color=colors[policy], linestyle=":",
                         label=f"{policy} capacity {caps[policy]:.3g}/s")
    target = next((b.get("goodput_target") for b in runs if b.get("goodput_target")), None)
    if target is None:
        target = 0.9
    left.axhline(target, color="grey", linestyle="--", label=f"target {target:.0%}")
    top = max(b["request_rate"] for b in runs)
    right.plot([0, top], [0, top], color="grey", linestyle="--", label="achieved = offered")
    left.set(xlabel="offered request rate (req/s)", ylabel="share of requests meeting every SLO", ylim=(0, 1.05),
             title="SLO attainment against rate")
    right.set(xlabel="offered request rate (req/s)", ylabel="achieved request rate (req/s)",
              title="Throughput against rate (own duration)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, out_dir / "goodput_vs_rate.png")


def plot_ttft_split(blocks: list[dict], out_dir: Path) -> Path:
    """Per (point, arm): the mean client TTFT stacked as the server's TTFT phases in timeline order
    (protocol/phases.py; the legend says what each is), then `client` (the client's TTFT less the
    server's), then the first decode step (hatched: it makes token 2, after the first token). A part
    below zero is drawn below the axis, not dropped. A grey tick marks the server's own mean TTFT."""
    import textwrap

    from pdserve.protocol.phases import PHASES

    parts = [(p.name, f"{p.name}: {p.meaning}") for p in PHASES]
    parts.append(("client", "client: the client's TTFT less the server's (connect, request in, first event out)"))
    points, policies = _points(blocks), _policies(blocks)
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(7.5, 1.8 * len(points) * len(policies)) + 6, 6))
    part_colors = [*plt.get_cmap("tab20").colors[::2], *plt.get_cmap("tab20").colors[1::2]]
    labels, positions = [], []
    for i, point in enumerate(points):
        for j, policy in enumerate(policies):
            b = next((b for b in blocks if (b.get("point") or b["load_label"]) == point
                      and policy_name(b) == policy), None)
            pos = i + (j - (len(policies) - 1) / 2) * width
            positions.append(pos)
            labels.append(f"{policy}\n{point}")
            split = (b or {}).get("ttft_split_ms") or {}
            if split.get("ttft") is None:
                continue
            up = down = 0.0
            for k, (key, label) in enumerate(parts):
                value = split.get(key) or 0.0  # results written before a phase existed have no such key
                ax.bar(pos, value, width * 0.9, bottom=up if value >= 0 else down, color=part_colors[k],
                       label=_once(ax, textwrap.fill(label, 70, subsequent_indent="  ")))
                up, down = (up + value, down) if value >= 0 else (up, down + value)
            ax.bar(pos, split["first_step"], width * 0.9, bottom=up, color="white", edgecolor="dimgrey",
                   hatch="//", label=_once(ax, "first decode step (token 2, after the first token)"))
            if split.get("server_ttft") is not None:
                ax.hlines(split["server_ttft"], pos - width * 0.45, pos + width * 0.45, colors="dimgrey",
                          linestyles="dashed", linewidth=2, label=_once(ax, "server TTFT (sum of the phases)"))
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("mean time (ms)")
    ax.set_title("Where the time to first token goes")
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, out_dir / "ttft_split.png")


def plot_ttft_per_turn(blocks: list[dict], out_dir: Path) -> Path | None:
    """Multi-turn runs: p50 (solid) and p99 (dashed) TTFT against the turn index, one line per arm and
    load point; reuse shows as later turns staying flat while their prompts grow."""
    runs = [b for b in blocks if b.get("per_turn")]
    if not runs:
        return None
    colors = _colors(_policies(runs))
    multi_point = len(_points(runs)) > 1
    fig, ax = plt.subplots(figsize=(7, 4))
    for b in runs:
        turns = [t["turn"] for t in b["per_turn"]]
        name = policy_name(b) + (f" {_point(b)}" if multi_point else "")
        for stat, style in (("median", "-o"), ("p99", "--s")):
            y = [np.nan if t[f"{stat}_ttft_ms"] is None else t[f"{stat}_ttft_ms"] for t in b["per_turn"]]
            ax.plot(turns, y, style, color=colors[policy_name(b)],
                    label=f"{name} {'p50' if stat == 'median' else stat}")
    ax.set_xlabel("turn (1 = first request of a conversation)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xticks(sorted({t["turn"] for b in runs for t in b["per_turn"]}))
    ax.set_title("TTFT per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, out_dir / "ttft_per_turn.png")


def plot_all(blocks: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    measured = _measured(blocks)
    paths = [*plot_cdfs(measured, out_dir), plot_latency_vs_load(blocks, out_dir),
             plot_goodput_vs_rate(blocks, out_dir), plot_ttft_split(measured, out_dir),
             plot_ttft_per_turn(measured, out_dir)]
    return [p for p in paths if p is not None]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pdserve.bench.load.plots RESULTS_JSON  (redraws the PNGs next to it)", file=sys.stderr)
        return 2
    from pdserve.bench.load.report import read_results

    path = Path(argv[0])
    for p in plot_all(read_results(path)["results"], path.parent):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
