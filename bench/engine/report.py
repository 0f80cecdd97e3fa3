"""`pdserve-bench engine`'s targets and markdown, from the result JSON alone.

    targets(result) -> {name: {"target": text, "measured": figure(s), "met": True | False | None}}
                       None: the points that target needs were not measured in this run
    markdown(result) -> str   the tables, then every target as met / MISSED with its figures
"""

from __future__ import annotations

from pdserve.bench import provenance

ROOFLINE_LIMIT = 1.5  # ours / roofline, every decode point
B1_1K_MS = 4.7
B32_16K_MS = 25.0
PREFILL_LIMIT = 1.03  # ours / transformers, median of paired ratios
GAP_LIMIT = 3.0  # max gap while a long prompt prefills / steady gap, with chunking
TTFT_LIMIT = 1.15  # that prompt's TTFT chunked / unchunked
MIXED_LIMIT = 1.25  # a mixed step's wall time / its GPU-busy time


def _point(rows: list[dict], batch: int, context: int) -> dict | None:
    return next((r for r in rows if r["kind"] == "uniform" and r["batch"] == batch and r["context"] == context), None)


def _ms_target(rows: list[dict], batch: int, context: int, limit: float) -> dict:
    p = _point(rows, batch, context)
    ms = None if p is None else p["ours_ms"]["median"]
    return {"target": f"decode batch {batch} at {context} context <= {limit} ms", "measured": ms,
            "met": None if ms is None else ms <= limit}


def targets(result: dict) -> dict:
    rows, prefill = result["decode"], result["prefill"]
    worst = max(rows, key=lambda r: r["ratio"], default=None)
    on, off = result["chunked"].get("on"), result["chunked"].get("off")
    mixed = result.get("mixed_step")
    return {
        "decode_within_roofline_limit": {
            "target": f"every decode point <= {ROOFLINE_LIMIT}x its roofline",
            "measured": None if worst is None else {"worst_ratio": worst["ratio"], "batch": worst["batch"],
                                                    "context": worst["context"] or "mixed",
                                                    "missed": sum(r["ratio"] > ROOFLINE_LIMIT for r in rows)},
            "met": None if worst is None else worst["ratio"] <= ROOFLINE_LIMIT,
        },
        "decode_b1_1k": _ms_target(rows, 1, 1024, B1_1K_MS),
        "decode_b32_16k": _ms_target(rows, 32, 16384, B32_16K_MS),
        "prefill_within_3pct": {
            "target": f"prefill ours/transformers <= {PREFILL_LIMIT} at every length (median of paired ratios)",
            "measured": {str(r["tokens"]): r["ratio"] for r in prefill},
            "met": all(r["ratio"] <= PREFILL_LIMIT for r in prefill) if prefill else None,
        },
        "chunked_ttft_within_1_15x_unchunked": {
            "target": f"with chunked prefill, the prompt's TTFT <= {TTFT_LIMIT}x its TTFT unchunked",
            "measured": None if not (on and off) else on["ttft_ms"] / off["ttft_ms"],
            "met": None if not (on and off) else on["ttft_ms"] / off["ttft_ms"] <= TTFT_LIMIT,
        },
        "mixed_step_within_1_25x_gpu_busy": {
            "target": f"a mixed step's wall time <= {MIXED_LIMIT}x its GPU-busy time",
            "measured": None if not mixed or not mixed["wall_over_busy"] else mixed["wall_over_busy"],
            "met": None if not mixed or not mixed["wall_over_busy"] else mixed["wall_over_busy"] <= MIXED_LIMIT,
        },
        "chunked_max_gap_within_3x_steady": {
            "target": f"with chunked prefill, the decodes' max gap while the prompt prefills <= {GAP_LIMIT}x "
                      "their steady gap",
            "measured": None if on is None else on["max_gap_over_steady"],
            "met": None if on is None else on["max_gap_over_steady"] <= GAP_LIMIT,
        },
    }


def _s(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _ratio(p: dict) -> str:
    r = p["ratio"]
    deciles = f", p10-p90 {r['p10']:.3f}-{r['p90']:.3f}" if "p10" in r else ""
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}{deciles})"


def markdown(result: dict) -> str:
    c = result["config"]
    w = c["weight_bytes"]
    lines = [
        f"engine bench: {c['model']} {c['dtype']}; {provenance.describe(result['provenance'])}; run {c['run_s']} s",
        "",
        f"Decode step, ms: median (min-max) of {c['repeats']} steps after {c['warmup']}, host clock around "
        f"synchronised calls. Roofline: the weights a step reads ({w['read_per_step'] / 1e9:.2f} GB) plus the "
        f"batch's KV once, timed as {c['roofline_method']}.",
        "",
        "| context | batch | ours ms | roofline ms | copy GB/s | ours / roofline | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["decode"]:
        ctx = str(r["context"]) if r["kind"] == "uniform" else \
            f"mixed {r['range'][0]}-{r['range'][1]} (sum {r['context_sum']})"
        lines.append(f"| {ctx} | {r['batch']} | {_s(r['ours_ms'])} | {r['roofline_ms']['median']:.2f} | "
                     f"{r['copy_gbps']:.0f} | {r['ratio']:.2f} | {r['tokens_per_s']:.0f} |")
    for s in result["skipped"]:
        lines.append(f"| {s['context'] or 'mixed'} | {s['batch']} | skipped: needs {s['kv_gib_needed']:.1f} GiB of "
                     f"KV, {s['kv_gib_available']:.1f} GiB fit | | | | |")
    lines += ["", f"Prefill, ms: {c['pairs']} rounds, transformers and ours once each in a shuffled order; ratio = "
                  "median of the paired ratios ours/transformers (min-max).", "",
              "| tokens | transformers | ours | ours / transformers, paired | within 3% |", "|---:|---:|---:|---:|:---:|"]
    for r in result["prefill"]:
        lines.append(f"| {r['tokens']} | {_s(r['transformers_ms'])} | {_s(r['ours_ms'])} | {_ratio(r['paired'])} | "
                     f"{'yes' if r['ratio'] <= PREFILL_LIMIT else 'NO'} |")
    if result["transformers_decode"]:
        lines += ["", "transformers' decode step (DynamicCache, eager; not a target), paired the same way:", "",
                  "| context | batch | transformers | ours | ours / transformers |", "|---:|---:|---:|---:|---:|"]
        for r in result["transformers_decode"]:
            lines.append(f"| {r['context']} | {r['batch']} | {_s(r['transformers_ms'])} | {_s(r['ours_ms'])} | "
                         f"{_ratio(r['paired'])} |")
    if result["chunked"]:
        any_run = next(iter(result["chunked"].values()))
        chunk_tokens = result["chunked"].get("on", {}).get("chunk_tokens")
        lines += ["", f"A {any_run['prompt']}-token prompt arrives while {any_run['decodes']} requests decode at "
                      f"{any_run['context']} context (chunks of {chunk_tokens} prompt tokens a step when on); gaps "
                      "between a request's tokens, ms, host clock:", "",
                  "| chunked_prefill | steady gap p50 | gap while prefilling p50 / p99 / max | max / steady | "
                  "prefill steps | longest step | prompt TTFT ms |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in result["chunked"].values():
            g = r["gap_during_prefill_ms"]
            lines.append(f"| {r['chunked_prefill']} | {r['steady_gap_ms']['median']:.2f} | {g['p50']:.2f} / "
                         f"{g['p99']:.2f} / {g['max']:.2f} | {r['max_gap_over_steady']:.1f}x | "
                         f"{r['prefill_steps']} | {max(r['prefill_step_ms']):.2f} | {r['ttft_ms']:.1f} |")
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines += ["", "targets:"]
    for t in result["targets"].values():
        lines.append(f"- {t['target']}: {verdict[t['met']]} (measured: {_fmt(t['measured'])})")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)
