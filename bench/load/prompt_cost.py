"""What served prompt steps cost on the device, from a step trace (`pdserve-bench trace DIR --prompt-cost`).

A step trace records each step's device time and the [start, end) positions of its prompt chunks. Over the steps
with prompt tokens this sums device time a prompt token and the keys a token attends over (its position + 1, on
average (start + end) / 2 per chunk), fits each step's device time as

    ms = a x (prompt tokens / 1000) + b x (query-key pairs / 1e6) + c + d x decode rows

over the steps of more than `min_tokens` prompt tokens (least squares: a per-token, b per-pair, c per-step and d
per-decode-row price), and, given a reference (the unchunked prefill of the engine bench's profile: its prefill
points fitted as a' x tokens + b' x pairs, no fixed term), sets each step beside it: the excess a step pays over
the reference, by the deepest prefix its chunks start at. A cost that grows with that prefix and not with the
chunk's size is a cost per prefix key a step (a copy of the prefix, say), which a per-token or per-pair price
does not explain. This is how `bench/results/defaults-h100-cbdb184/README.md` read the long workload's steps.
"""

from __future__ import annotations

import numpy as np

PREFIX_BINS = [(0, 0), (1, 8192), (8193, 16384), (16385, 24576), (24577, None)]


def _tokens(s: dict) -> int:
    return sum(b - a for a, b in s["chunks"])


def prompt_steps(steps: list[dict], min_tokens: int = 1) -> list[dict]:
    """Steps of at least `min_tokens` prompt tokens with a device time (a CUDA worker's trace)."""
    return [s for s in steps if s.get("chunks") and s.get("device_ms") is not None and _tokens(s) >= min_tokens]


def _pairs(s: dict) -> float:
    """Query-key pairs of a step's chunks: a token at position p attends over p + 1 keys."""
    return sum((b - a) * (a + b + 1) / 2 for a, b in s["chunks"])


def _prefix(s: dict) -> int:
    return max(a for a, _ in s["chunks"])


def summary(steps: list[dict]) -> dict | None:
    ps = prompt_steps(steps)
    if not ps:
        return None
    tokens = sum(_tokens(s) for s in ps)
    return {"prompt_steps": len(ps), "prompt_tokens": tokens,
            "device_us_per_token": sum(s["device_ms"] for s in ps) / tokens * 1e3,
            "mean_keys_per_token": sum(_pairs(s) for s in ps) / tokens,
            "decode_rows_per_step": sum(s["decode"] for s in ps) / len(ps)}


def fit(steps: list[dict], min_tokens: int = 1025) -> dict | None:
    """Least squares of device ms on (tokens / 1e3, pairs / 1e6, 1, decode rows) over steps of >= min_tokens."""
    ps = prompt_steps(steps, min_tokens)
    if len(ps) < 8:
        return None
    x = np.array([[_tokens(s) / 1e3, _pairs(s) / 1e6, 1.0, s["decode"]] for s in ps])
    y = np.array([s["device_ms"] for s in ps])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"steps": len(ps), "ms_per_1k_tokens": float(coef[0]), "ms_per_m_pairs": float(coef[1]),
            "ms_per_step": float(coef[2]), "ms_per_decode_row": float(coef[3]),
            "residual_sd_ms": float((y - x @ coef).std())}


def reference(engine: dict) -> dict:
    """The unchunked prefill of an engine JSON's prefill points (ms), fitted as a x tokens + b x pairs."""
    points = [(int(p["tokens"]), float(p["ours_ms"]["median"])) for p in engine["prefill"]]
    if len(points) < 2:
        raise ValueError("the engine JSON has fewer than two prefill points: no reference to fit")
    x = np.array([[n / 1e3, n * (n + 1) / 2 / 1e6] for n, _ in points])
    y = np.array([ms for _, ms in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    worst = float(np.max(np.abs(x @ coef / y - 1)))
    return {"ms_per_1k_tokens": float(coef[0]), "ms_per_m_pairs": float(coef[1]), "points": points,
            "worst_point_error": worst}


def excess_by_prefix(steps: list[dict], ref: dict, decode_row_ms: float, min_tokens: int = 1025) -> list[dict]:
    """Each step of >= min_tokens prompt tokens beside the reference (plus decode_row_ms a decode row), binned by
    the deepest prefix its chunks start at: steps, mean excess ms, mean prompt tokens, mean device ms."""
    rows = []
    ps = prompt_steps(steps, min_tokens)
    for lo, hi in PREFIX_BINS:
        sel = [s for s in ps if lo <= _prefix(s) and (hi is None or _prefix(s) <= hi)]
        if not sel:
            continue
        excess = [s["device_ms"] - ref["ms_per_1k_tokens"] * _tokens(s) / 1e3 - ref["ms_per_m_pairs"] * _pairs(s) / 1e6
                  - decode_row_ms * s["decode"] for s in sel]
        rows.append({"prefix": "none" if hi == 0 else f"{lo}-{hi}" if hi else f"{lo}+", "steps": len(sel),
                     "excess_ms": float(np.mean(excess)), "tokens": float(np.mean([_tokens(s) for s in sel])),
                     "device_ms": float(np.mean([s["device_ms"] for s in sel]))})
    return rows


def report(steps: list[dict], engine: dict | None, min_tokens: int = 1025) -> dict:
    out = {"summary": summary(steps), "fit": fit(steps, min_tokens)}
    if engine is not None and out["fit"] is not None:
        ref = reference(engine)
        out["reference"] = ref
        out["excess_by_prefix"] = excess_by_prefix(steps, ref, out["fit"]["ms_per_decode_row"], min_tokens)
    return out


def render(name: str, out: dict) -> str:
    s, f = out["summary"], out["fit"]
    if s is None:
        return f"{name}: no prompt steps with a device time (a CUDA worker's trace has them)"
    lines = [f"{name}: {s['prompt_steps']} prompt steps, {s['prompt_tokens']} prompt tokens, "
             f"{s['device_us_per_token']:.2f} us of device time a token, {s['mean_keys_per_token']:.0f} keys a "
             f"token on average, {s['decode_rows_per_step']:.1f} decode rows a step"]
    if f is not None:
        lines.append(f"  fit over {f['steps']} steps: {f['ms_per_1k_tokens']:.2f} ms per 1k tokens + "
                     f"{f['ms_per_m_pairs']:.3f} per million query-key pairs + {f['ms_per_step']:.1f} a step + "
                     f"{f['ms_per_decode_row']:.2f} a decode row (residual sd {f['residual_sd_ms']:.1f} ms)")
    if out.get("reference"):
        r = out["reference"]
        lines.append(f"  beside the unchunked prefill ({r['ms_per_1k_tokens']:.2f} ms per 1k tokens + "
                     f"{r['ms_per_m_pairs']:.3f} per million pairs, within {r['worst_point_error']:.0%} of its "
                     f"points) and {f['ms_per_decode_row']:.2f} ms a decode row, by the deepest chunk's prefix:")
        lines.append("  | prefix | steps | excess ms a step | prompt tokens | device ms |")
        lines.append("  |---|---|---|---|---|")
        for row in out["excess_by_prefix"]:
            lines.append(f"  | {row['prefix']} | {row['steps']} | {row['excess_ms']:+.1f} | {row['tokens']:.0f} | "
                         f"{row['device_ms']:.1f} |")
    return "\n".join(lines)
