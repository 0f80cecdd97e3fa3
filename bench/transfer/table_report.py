"""`pdserve-bench transfer`'s rows, targets and markdown, from the runs bench/transfer/table.py collects.

    aggregate(transport, mode, runs, plain, bulk)   one method and mode at one length: medians, spreads,
                                                    extra prefill against plain (and layer against bulk),
                                                    paired round by round (bench/ab.py), exact or not
    targets(result)     the issue's targets at the longest length measured (None: not measured), and
                        ipc_pattern(result): ipc bulk against its own copy pattern inside one pool
    markdown(result)    the table per length, then each target met or not with its figures (paged_line: the
                        copy patterns inside one pool; the profiled transfer where --profile-transfer ran one)
"""

from __future__ import annotations

import math
import statistics

from pdserve.bench import ab, provenance
from pdserve.bench.transfer.profile import describe

# targets (issues 27 and 35): ipc bulk at the longest length vs the d2d copy, layer-wise cost, nixl vs ipc,
# zmq bulk's rate plain and through CURVE, a fragmented pool against a contiguous one
IPC_BW_FRACTION = 0.9
LAYER_EXTRA_FRACTION = 0.005
NIXL_VS_IPC = 1.1
ZMQ_GBPS = {"zmq": 5.0, "zmq-curve": 3.0}
FRAGMENTED_VS_CONTIGUOUS = 1.2
EXPOSED_ZERO_MS = 0.0005  # "0.000 ms" as printed


def _paired_ms(base: list[float], runs: list[dict]) -> dict | None:
    """runs' prefill against base round by round, over the rounds where the run did not fail."""
    pairs = [(b, r["prefill_ms"]) for b, r in zip(base, runs) if not r.get("error")]
    return ab.paired([b for b, _ in pairs], [r for _, r in pairs]) if pairs else None


def aggregate(transport: str, mode: str, runs: list[dict], plain: list[float], bulk: list[dict] | None) -> dict:
    ok = [r for r in runs if not r.get("error")]
    errors = sorted({r["error"] for r in runs if r.get("error")})
    out = {"transport": transport, "mode": mode, "runs": len(runs), "failed": len(runs) - len(ok),
           "errors": errors, "exact": bool(ok) and len(ok) == len(runs) and all(r["exact"] for r in ok),
           "exact_runs": sum(1 for r in ok if r["exact"]),
           "mismatch": next((r["mismatch"] for r in ok if r.get("mismatch")), None),
           "prompt_seeds": [r["seed"] for r in runs]}
    if not ok:
        return out
    med = {k: statistics.median([r[k] for r in ok if r[k] is not None] or [math.nan])
           for k in ("transfer_ms", "first_step_ms", "colocated_first_step_ms")}
    extra = _paired_ms(plain, runs)
    out.update({
        "transfer_ms": ab.summary([r["transfer_ms"] for r in ok]),
        "prefill_ms": ab.summary([r["prefill_ms"] for r in ok]),
        # this mode's prefill minus the plain prefill of the same round (bench/ab.py)
        "extra_vs_plain": extra,
        "layer_extra_ms": extra["diff"]["median"],
        "exposed_ms": ab.summary([r["exposed_ms"] for r in ok]),
        # ipc on CUDA: last copy complete minus prefill end on the GPU's own clock (events)
        "exposed_gpu_ms": (ab.summary([r["exposed_gpu_ms"] for r in ok])
                           if all(r.get("exposed_gpu_ms") is not None for r in ok) else None),
        # ipc bulk on CUDA: the copies alone, from the side stream's start (the KV ready) to its last copy
        "copy_gpu_ms": (ab.summary([r["copy_gpu_ms"] for r in ok])
                        if mode == "bulk" and all(r.get("copy_gpu_ms") is not None for r in ok) else None),
        "first_step_ms": med["first_step_ms"],
        "colocated_first_step_ms": med["colocated_first_step_ms"],
        "copies": ok[0]["copies"],
        "runs_per_request": statistics.median([r["runs"] for r in ok]) if all("runs" in r for r in ok) else None,
        "kv_bytes": ok[0]["kv_bytes"],
        "gbps": ok[0]["kv_bytes"] / (med["transfer_ms"] / 1e3) / 1e9 if med["transfer_ms"] > 0 else None,
    })
    if mode == "layer" and bulk is not None:
        pairs = [(b, r) for b, r in zip(bulk, runs) if not b.get("error") and not r.get("error")]
        out["extra_vs_bulk"] = _paired_ms([b["prefill_ms"] for b, _ in pairs], [r for _, r in pairs])
    return out


def _find(row: dict, transport: str, mode: str) -> dict | None:
    return next((r for r in row["results"] if r["transport"] == transport and r["mode"] == mode
                 and "transfer_ms" in r), None)


def targets(result: dict) -> dict:
    """The issue's targets at the longest length measured (None: not measured)."""
    row = result["lengths"][-1]
    layers = result["config"]["num_layers"]
    ipc_bulk, ipc_layer = _find(row, "ipc", "bulk"), _find(row, "ipc", "layer")
    nixl_bulk = _find(row, "nixl", "bulk")
    d2d = result["bandwidth"]["d2d_gbps"]
    out = {"tokens": row["tokens"], "all_exact": all(r["exact"] for x in result["lengths"] for r in x["results"])}
    out["ipc_bulk_fraction_of_d2d"] = ipc_bulk["gbps"] / d2d if ipc_bulk else None
    out["ipc_bulk_at_least_0.9_d2d"] = None if ipc_bulk is None else ipc_bulk["gbps"] >= IPC_BW_FRACTION * d2d
    out["ipc_bulk_vs_pattern"] = ipc_pattern(result)
    # the same bytes over the copies' span on the GPU's clock (events): what the host's issuing and polling add
    # is the difference between the two figures
    gpu = ipc_bulk.get("copy_gpu_ms") if ipc_bulk else None
    out["ipc_bulk_gpu_clock_fraction_of_d2d"] = (ipc_bulk["kv_bytes"] / (gpu["median"] / 1e3) / 1e9 / d2d
                                                 if gpu and gpu["median"] > 0 else None)
    out["ipc_bulk_gpu_clock_ms"] = gpu["median"] if gpu else None
    if ipc_layer and ipc_bulk:
        one_layer_ms = ipc_bulk["transfer_ms"]["median"] / layers
        # the median of (layer prefill - plain prefill) over rounds, as a fraction of plain prefill
        diff = ipc_layer["extra_vs_plain"]["diff"]
        out["ipc_layer_extra_fraction"] = diff["median"] / row["prefill_ms"]["median"]
        out["ipc_layer_extra_spread_ms"] = [diff["min"], diff["max"]]
        out["ipc_layer_extra_within_0.5pct"] = out["ipc_layer_extra_fraction"] <= LAYER_EXTRA_FRACTION
        # the GPU's own clock where measured (CUDA events); the host's poll otherwise
        exposed = ipc_layer.get("exposed_gpu_ms") or ipc_layer["exposed_ms"]
        out["ipc_layer_exposed_clock"] = "gpu events" if ipc_layer.get("exposed_gpu_ms") else "host"
        out["ipc_layer_exposed_ms"] = exposed["median"]
        out["ipc_layer_exposed_host_ms"] = ipc_layer["exposed_ms"]["median"]
        out["one_layer_transfer_ms"] = one_layer_ms
        out["ipc_layer_exposed_at_most_one_layer"] = exposed["median"] <= one_layer_ms
        # issue 35: nothing exposed on the GPU's clock (None where there is none: the CPU)
        out["ipc_layer_exposed_zero_gpu"] = (exposed["median"] < EXPOSED_ZERO_MS
                                             if ipc_layer.get("exposed_gpu_ms") else None)
    if nixl_bulk and ipc_bulk:
        out["nixl_over_ipc"] = nixl_bulk["transfer_ms"]["median"] / ipc_bulk["transfer_ms"]["median"]
        out["nixl_within_1.1x_ipc"] = out["nixl_over_ipc"] <= NIXL_VS_IPC
    ipc_frag, nixl_frag = _find(row, "ipc-fragmented", "bulk"), _find(row, "nixl-fragmented", "bulk")
    if ipc_frag:
        out["fragmented_runs"] = ipc_frag["runs_per_request"]
        out["ipc_fragmented_fraction_of_d2d"] = ipc_frag["gbps"] / d2d
    if ipc_frag and nixl_frag:
        out["nixl_fragmented_over_ipc_fragmented"] = (nixl_frag["transfer_ms"]["median"]
                                                      / ipc_frag["transfer_ms"]["median"])
    # a fragmented pool against the contiguous one, per transport measured both ways (bulk transfer time)
    out["fragmented_over_contiguous"] = {}
    for transport in ("ipc", "nixl", "zmq"):
        plain, frag = _find(row, transport, "bulk"), _find(row, f"{transport}-fragmented", "bulk")
        if plain and frag:
            ratio = frag["transfer_ms"]["median"] / plain["transfer_ms"]["median"]
            out["fragmented_over_contiguous"][transport] = {
                "ratio": ratio, "runs": frag["runs_per_request"], "met": ratio <= FRAGMENTED_VS_CONTIGUOUS}
    for method, floor in ZMQ_GBPS.items():
        got = _find(row, method, "bulk")
        if got:
            out[f"{method}_bulk_gbps"] = got["gbps"]
            out[f"{method}_bulk_at_least_{floor:g}_gbps"] = got["gbps"] >= floor
    return out


def ipc_pattern(result: dict) -> dict | None:
    """ipc bulk at the longest length against the same copy pattern inside one pool (bench/transfer/pools.py):
    one copy_ per layer from PER_LAYER_COPY_BYTES up, one strided copy of words below; what the two
    processes and the transfer's own steps cost beyond the copies."""
    row, paged = result["lengths"][-1], result["bandwidth"]["paged_run"]
    ipc_bulk = _find(row, "ipc", "bulk")
    if ipc_bulk is None or paged["bytes"] != ipc_bulk["kv_bytes"]:
        return None
    name = "per_layer" if ipc_bulk["copies"] > 1 else "strided_words"
    return {"pattern": name, "pattern_gbps": paged[f"{name}_gbps"],
            "fraction": ipc_bulk["gbps"] / paged[f"{name}_gbps"]}


def _ms(s: dict | None, digits: int = 2) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f}"


def paged_line(paged: dict) -> str:
    """The copy patterns inside one pool (bench/transfer/pools.py), in words."""
    line = (f"the longest request's blocks inside one pool ({paged['bytes'] / 2**20:.1f} MiB): "
            f"{paged['strided_gbps']:.1f} GB/s as one strided copy_ of the pool's dtype"
            + (f", {paged['strided_words_gbps']:.1f} of 8-byte words" if paged.get("strided_words_gbps") else "")
            + f", {paged['per_layer_gbps']:.1f} GB/s as one copy_ per layer"
            + (f", {paged['memcpy2d_gbps']:.1f} GB/s as one 2D memcpy" if paged.get("memcpy2d_gbps") else ""))
    return (line + f"; every other block of them {paged['scattered_gather_gbps']:.1f} GB/s gathered and scattered "
            "by index" + (f" ({paged['scattered_gather_elements_gbps']:.1f} in the pool's dtype)"
                          if paged.get("scattered_gather_elements_gbps") else "")
            + (f", {paged['scattered_kernel_gbps']:.1f} GB/s by the block-copy kernel"
               if paged.get("scattered_kernel_gbps") else ""))


def markdown(result: dict) -> str:
    c, bw = result["config"], result["bandwidth"]
    lines = [
        f"KV transfer bench: {c['model']} {c['dtype']} ({c['layout']}), prefill on {c['device']}, decode on "
        f"{c['decode_device']}; {provenance.describe(result['provenance'])}"
        + (f"; FAULT INJECTED: {c['fault']}" if c.get("fault") else ""),
        f"copy bandwidth ({bw['bytes'] // 2**20} MiB): {bw['d2d_gbps']:.1f} GB/s on the prefill device"
        + (f", {bw['to_decode_gbps']:.1f} GB/s prefill -> decode device" if "to_decode_gbps" in bw else "")
        + f"; {paged_line(bw['paged_run'])}",
        f"{c['repeats']} rounds per transport after {c['warmup']} warm-up, each running plain prefill and "
        f"{' and '.join(c['modes'])} once in a shuffled order; a new seeded prompt per run; medians; extra = that mode's prefill minus "
        f"the plain prefill of the same round, median (min..max) of the paired differences; exact = the reserved "
        f"blocks poisoned with NaN, then {c['tokens_compared']} greedy tokens and their logits bitwise equal to a "
        f"colocated run of the same prompt, in every run",
        "",
    ]
    for row in result["lengths"]:
        p = row["prefill_ms"]
        kv_mib = (row["kv_bytes"] or 0) / 2**20
        lines += [f"### {row['tokens']} tokens, KV {kv_mib:.1f} MiB, prefill {p['median']:.2f} ms "
                  f"({p['min']:.2f}-{p['max']:.2f})", "",
                  "| transport | mode | transfer ms | % of prefill | GB/s | copies (runs) | extra ms vs plain (paired) | "
                  "exposed ms (host) | exposed ms (GPU) | first decode step ms (colocated) | exact |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in row["results"]:
            if "transfer_ms" not in r:
                lines.append(f"| {r['transport']} | {r['mode']} | failed: {'; '.join(r['errors'])[:200]} "
                             "| | | | | | | | NO |")
                continue
            t = r["transfer_ms"]["median"]
            d = r["extra_vs_plain"]["diff"]
            lines.append(
                f"| {r['transport']} | {r['mode']} | {t:.3f} | {100 * t / p['median']:.2f}% | "
                f"{r['gbps'] or 0:.1f} | {r['copies']} ({r.get('runs_per_request') or '-'}) | {d['median']:+.2f} ({d['min']:+.2f}..{d['max']:+.2f}) | "
                f"{_ms(r['exposed_ms'])} | "
                f"{_ms(r.get('exposed_gpu_ms'), 3)} | "
                f"{r['first_step_ms']:.2f} ({r['colocated_first_step_ms']:.2f}) | "
                f"{'yes' if r['exact'] else 'NO'} ({r['exact_runs']}/{r['runs']})"
                f"{' (' + str(r['failed']) + ' failed)' if r['failed'] else ''} |")
        lines.append("")
        for r in row["results"]:
            vs = r.get("extra_vs_bulk")
            if vs:
                d = vs["diff"]
                lines.append(f"- {r['transport']}: layer minus bulk prefill, paired over {vs['pairs']} rounds: "
                             f"{d['median']:+.2f} ms ({d['min']:+.2f}..{d['max']:+.2f})")
        lines.append("")
    t = result["targets"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines.append(f"targets at {t['tokens']} tokens:")
    lines.append(f"- all transfers exact: {verdict[t['all_exact']]}")
    if t["ipc_bulk_fraction_of_d2d"] is not None:
        lines.append(f"- ipc bulk >= 90% of the d2d copy bandwidth: {verdict[t['ipc_bulk_at_least_0.9_d2d']]} "
                     f"({100 * t['ipc_bulk_fraction_of_d2d']:.0f}%, from the first copy's issue to the host "
                     "seeing the last done)")
    if t.get("ipc_bulk_gpu_clock_fraction_of_d2d") is not None:
        lines.append(f"- (figure) ipc bulk's copies alone on the GPU's clock: {t['ipc_bulk_gpu_clock_ms']:.3f} ms, "
                     f"{100 * t['ipc_bulk_gpu_clock_fraction_of_d2d']:.0f}% of the d2d copy (the rest of the "
                     "figure above is the host issuing the copies and seeing them done)")
    if "ipc_layer_extra_fraction" in t:
        lo, hi = t["ipc_layer_extra_spread_ms"]
        lines.append(f"- ipc layer mode adds <= 0.5% to prefill: {verdict[t['ipc_layer_extra_within_0.5pct']]} "
                     f"({100 * t['ipc_layer_extra_fraction']:+.2f}%, median of paired differences; "
                     f"{lo:+.2f}..{hi:+.2f} ms over the rounds)")
        lines.append(f"- ipc layer mode exposes at most one layer's transfer: "
                     f"{verdict[t['ipc_layer_exposed_at_most_one_layer']]} ({t['ipc_layer_exposed_ms']:.3f} ms "
                     f"exposed by {t['ipc_layer_exposed_clock']}, {t['ipc_layer_exposed_host_ms']:.3f} ms as the host "
                     f"saw it; one layer {t['one_layer_transfer_ms']:.3f} ms)")
    if "ipc_layer_exposed_zero_gpu" in t:
        lines.append(f"- ipc layer mode exposes 0.000 ms on the GPU clock: {verdict[t['ipc_layer_exposed_zero_gpu']]} "
                     + (f"({t['ipc_layer_exposed_ms']:.3f} ms, median of the rounds)"
                        if t["ipc_layer_exposed_zero_gpu"] is not None else "(no GPU clock on this device)"))
    if "nixl_over_ipc" in t:
        lines.append(f"- nixl bulk within 1.1x of ipc bulk: {verdict[t['nixl_within_1.1x_ipc']]} "
                     f"({t['nixl_over_ipc']:.2f}x)")
    for transport, f in t.get("fragmented_over_contiguous", {}).items():
        lines.append(f"- {transport}-fragmented bulk within {FRAGMENTED_VS_CONTIGUOUS:g}x of {transport} bulk: "
                     f"{verdict[f['met']]} ({f['ratio']:.2f}x, {f['runs']:g} runs a request)")
    for method, floor in ZMQ_GBPS.items():
        if f"{method}_bulk_gbps" in t:
            lines.append(f"- {method} bulk >= {floor:g} GB/s: "
                         f"{verdict[t[f'{method}_bulk_at_least_{floor:g}_gbps']]} ({t[f'{method}_bulk_gbps']:.2f} GB/s)")
    if "ipc_fragmented_fraction_of_d2d" in t:
        lines.append(f"- (figure) ipc-fragmented bulk at {100 * t['ipc_fragmented_fraction_of_d2d']:.0f}% of the d2d "
                     "copy bandwidth"
                     + (f", nixl-fragmented {t['nixl_fragmented_over_ipc_fragmented']:.2f}x its time"
                        if "nixl_fragmented_over_ipc_fragmented" in t else ""))
    p = t.get("ipc_bulk_vs_pattern")
    if p:
        lines.append(f"- (figure) ipc bulk at {100 * p['fraction']:.0f}% of its copy pattern inside one pool "
                     f"({p['pattern']}, {p['pattern_gbps']:.1f} GB/s): the rest is the second process's memory "
                     "and the transfer's own steps (--profile-transfer shows them)")
    for prof in filter(None, (result.get("profile"), result.get("profile_fragmented"))):
        runs = f" ({prof['runs']} runs)" if prof.get("runs") and prof["method"] != "ipc" else ""
        lines += ["", f"{prof['method']} bulk transfer at {prof['tokens']} tokens{runs}, profiled: "
                  + (f"failed: {prof['error']}" if prof.get("error") else
                     f"{prof['transfer_ms']:.3f} ms under the profiler, {prof['copies']} copies, "
                     f"exact: {'yes' if prof['exact'] else 'NO'}; " + describe(prof["summary"]))]
    return "\n".join(lines)
