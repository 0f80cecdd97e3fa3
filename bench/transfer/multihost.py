"""`pdserve-bench multihost`: the KV transfer across two "hosts" (network namespaces) over a shaped link.

The seed's prediction (a slower link adds a visible share to TTFT; layer-by-layer sending hides much of
it) checked at the scale of a CPU machine: smollm2-135m prefills 1k-4k tokens on the CPU in seconds,
and its KV (46 KB per token in float32) crosses a veth shaped with tbf at 50 Mb/s - 2 Gb/s, so the
transfer and the prefill are of the same order. As root (namespaces, tc).

    pdserve-bench multihost                                  # nixl, 1k and 4k, 50/200/1000/2000 Mbit/s
    pdserve-bench multihost --rates 100,500 --lengths 1k --transports nixl,zmq --repeats 3
    pdserve-bench multihost --rates 5000,10000,25000 --lengths 4k --transports zmq,nixl --probe-mib 256
                                                             # link speed: a 2-core CPU shapes up to ~10 Gb/s;
                                                             # above, the probe shows what TCP reaches unshaped

Two namespaces on a bridge (tests/netns.py, the tests' own helper), one process each
(bench/transfer/roles.py, as `pdserve-bench transfer` runs them, with the decode side's receivers bound
to its namespace's address; nixl with UCX_TLS=tcp, UCX_NET_DEVICES=eth0: with UCX's defaults the
bytes would go over cma, never the link). Per rate, tbf on both directions of the decode host's link:

    link ceiling   a plain TCP stream of --probe-mib from prefill to decode at that rate, Mbit/s:
                   the limit measured in the same run (tbf's rate less TCP/IP's overhead)
    per length     bench/transfer/table.py's rounds: plain prefill, bulk and layer, shuffled per round; every
                   run its own seeded prompt, the decode blocks poisoned (NaN), the tokens and logits
                   checked bitwise against a colocated run on the decode side
    predicted      transfer = KV bytes x 8 / rate (nominal) and / the measured ceiling; bulk exposes the
                   whole transfer; layer exposes max(one layer's share, transfer - prefill (1 - 1/layers)):
                   it can hide the move only when the move is shorter than the prefill it runs beside
    link check     per transport, rate and length: bulk transfer / (KV bytes x 8 / tbf rate) and / the
                   measured ceiling; within 10% (<= 1.1) is the target

The machine's load average at start and end goes into the JSON: on a shared 2-core machine the prefill
times (and a layer-mode overlap that competes with prefill for the cores) are noisy; medians of
--repeats rounds, with min..max.

Writes bench/results/multihost-cpu-<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from pdserve.bench import provenance
from pdserve.bench.cli import parse_counts
from pdserve.bench.transfer.table import Child, log, measure_length, one_run
from pdserve.bench.transfer.check import run_seed

UCX_TCP = ["UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"]
PROBE_PORT = 7999


def netns_module():
    """tests/netns.py: the namespaces the multi-host tests use (this bench runs from a checkout)."""
    spec = importlib.util.spec_from_file_location("pdserve_netns", provenance.REPO / "tests" / "netns.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1k,4k", help="prompt lengths in tokens (default 1k,4k)")
    parser.add_argument("--rates", default="50,200,1000,2000", help="tbf rates in Mbit/s (default 50,200,1000,2000)")
    parser.add_argument("--transports", default="nixl", help="nixl and/or zmq (default nixl)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per rate and length (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before those, per rate and length")
    parser.add_argument("--tokens", type=int, default=4, help="greedy tokens decoded and checked per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-mib", type=int, default=16, help="size of the link-ceiling TCP probe (MiB)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="per transfer (a slow link takes long)")
    parser.add_argument("--out", default=None, help="output path without suffix (default bench/results/...)")
    parser.add_argument("--report", default=None, nargs="+", metavar="JSON",
                        help="measure nothing: predictions, markdown and plot from these runs' measurements (several: "
                             "merged into --out)")


def role(net, host: str, name: str, args, max_len: int, extra: list[str]) -> Child:
    env = ["env", "CUDA_VISIBLE_DEVICES=", *UCX_TCP]
    argv = [*env, sys.executable, "-m", "pdserve.bench.transfer.roles", name, "--model", args.model, "--device", "cpu",
            "--decode-device", "cpu", "--max-len", str(max_len), "--tokens", str(args.tokens),
            "--transports", args.transports, "--deadline-s", str(args.deadline_s), *extra]
    return Child(name, net.argv(host, argv))


PROBE_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
PROBE_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
"""


def link_ceiling(net, mib: int) -> dict:
    """A plain TCP stream prefill -> decode: Mbit/s as the receiver counts it (first byte to last)."""
    dst = net["decode"].ip
    sink = net.popen("decode", [sys.executable, "-c", PROBE_SINK, dst, str(PROBE_PORT)], stdout=subprocess.PIPE,
                     text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        src = net.run("prefill", [sys.executable, "-c", PROBE_SOURCE, dst, str(PROBE_PORT), str(mib)])
        if src.returncode != 0:
            raise RuntimeError(f"the link probe failed: {src.stderr}")
        n, seconds = sink.stdout.readline().split()
        sink.wait(30)
    finally:
        if sink.poll() is None:
            sink.kill()
    return {"bytes": int(n), "seconds": float(seconds), "mbit_s": int(n) * 8 / float(seconds) / 1e6}


def lane_probe(n: int, args, prefill: Child, decode: Child, transport: str) -> dict | None:
    """One untimed bulk transfer: the UCX lane the prefill side's NIXL reported for it."""
    got = one_run(f"lane-{transport}-{n}-{time.monotonic_ns()}", n, run_seed(args.seed, "lane", n), transport,
                  "bulk", prefill, decode)
    return got.get("ucx_lane")


def report(paths: list[Path], out: Path | None = None) -> int:
    """Predictions, markdown and plot again from runs' JSON (their measurements as they are). Several
    runs of one model merge into one report (`out`), each rate block keeping its run's provenance."""
    parts = [json.loads(p.read_text()) for p in paths]
    result = parts[0]
    if len(parts) > 1:
        if len({r["config"]["model"] for r in parts}) != 1:
            raise SystemExit("pdserve-bench multihost --report: the runs serve different models")
        for path, r in zip(paths, parts):
            for block in r["rates"]:
                block["run"] = {"file": path.name, "commit": r["provenance"].get("commit"),
                                "date": r["provenance"].get("date"), "repeats": r["config"]["repeats"],
                                "load_average_start": r["provenance"].get("load_average_start"),
                                "load_average_end": r["provenance"].get("load_average_end")}
        result = {**parts[0], "merged_from": [p.name for p in paths],
                  "rates": sorted((b for r in parts for b in r["rates"]), key=lambda b: b["rate_mbit"])}
        result["config"] = {**parts[0]["config"],
                            "lengths": sorted({n for r in parts for n in r["config"]["lengths"]})}
        result["provenance"] = {**parts[0]["provenance"],
                                "load_average_end": parts[-1]["provenance"].get("load_average_end")}
    layers = result["config"]["num_layers"]
    for block in result["rates"]:
        for row in block["lengths"]:
            row["predicted"] = predict(row, block["rate_mbit"], block["ceiling"]["mbit_s"], layers)
    result["link_check"] = link_check(result)
    path = out.with_suffix(".json") if out else paths[0]
    path.write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    path.with_suffix(".md").write_text(text + "\n")
    plot(result, path.with_suffix(".png"))
    print(text)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.report:
        return report([Path(p) for p in args.report], Path(args.out) if args.out else None)
    netns = netns_module()
    # SIGTERM (a timeout, Ctrl-C's cousin) unwinds like an exception: the namespaces come down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("pdserve-bench multihost: terminated"))
    why = netns.why_unavailable()
    if why:
        raise SystemExit(f"pdserve-bench multihost: {why}")
    lengths = parse_counts(args.lengths)
    rates = [float(r) for r in args.rates.split(",") if r]
    transports = [t for t in args.transports.split(",") if t]
    if any(t not in ("nixl", "zmq") for t in transports):
        raise SystemExit("between hosts: --transports nixl and/or zmq (ipc is one host only)")
    prov = provenance.collect(["cpu"])
    prov["load_average_start"] = os.getloadavg()
    out = Path(args.out) if args.out else provenance.RESULTS_DIR / f"multihost-cpu-{datetime.date.today().isoformat()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    t_args = SimpleNamespace(no_seed_method=True, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    result = {"benchmark": "multihost", "complete": False, "provenance": prov,
              "config": {"model": args.model, "lengths": lengths, "rates_mbit": rates, "transports": transports,
                         "repeats": args.repeats, "warmup": args.warmup, "tokens_compared": args.tokens,
                         "probe_mib": args.probe_mib, "link": "veth pair on a bridge, tbf on both directions of "
                                                              "the decode host's link", "ucx_env": UCX_TCP},
              "rates": []}
    with netns.Hosts(("prefill", "decode")) as net:
        log(f"namespaces up: prefill {net['prefill'].ip}, decode {net['decode'].ip}; loading {args.model} twice")
        decode = role(net, "decode", "decode", args, max(lengths), ["--kv-host", net["decode"].ip])
        prefill = role(net, "prefill", "prefill", args, max(lengths), [])
        try:
            addresses = decode.read(1800)["addresses"]
            model = prefill.read(1800)
            result["config"].update(layout=model["layout"], kv_bytes_per_token=model["bytes_per_token"],
                                    num_layers=model["num_layers"], dtype=model["dtype"])
            for rate in rates:
                net.shape("decode", rate)
                ceiling = link_ceiling(net, args.probe_mib)
                log(f"{rate:g} Mbit/s: a TCP stream reaches {ceiling['mbit_s']:.0f} Mbit/s")
                lanes = {t: lane_probe(min(lengths), args, prefill, decode, t) for t in transports if t == "nixl"}
                block = {"rate_mbit": rate, "ceiling": ceiling, "ucx_lane": lanes, "lengths": [],
                         "load_average": os.getloadavg()}
                result["rates"].append(block)
                for n in lengths:
                    log(f"{rate:g} Mbit/s, {n} tokens")
                    row = measure_length(n, t_args, prefill, decode, addresses, transports, ["bulk", "layer"])
                    row["predicted"] = predict(row, rate, ceiling["mbit_s"], model["num_layers"])
                    block["lengths"].append(row)
                    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        finally:
            prefill.close()
            decode.close()
    result["complete"] = True
    result["link_check"] = link_check(result)
    prov["load_average_end"] = os.getloadavg()
    provenance.finish(prov)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text + "\n")
    plot(result, out.with_suffix(".png"))
    log(f"wrote {out.with_suffix('.json')}, .md and .png")
    print(text)
    return 0


def predict(row: dict, rate_mbit: float, ceiling_mbit: float, layers: int) -> dict:
    """What a link of this rate should cost: transfer T = bytes / rate; bulk exposes all of it. Layer
    mode sends layer i once prefill has computed it (at P (i+1) / L): a link faster than the layers
    come (T < P) is done one layer's share after prefill, T / L; a slower one is busy from the first
    layer on and ends at P / L + T, exposing T - P (1 - 1/L)."""
    kv = row["kv_bytes"]
    # the layer runs' own prefill: on the CPU, sending beside it slows it (the plain prefill would flatter)
    lay = next((r for r in row["results"] if r["mode"] == "layer" and "prefill_ms" in r), None)
    prefill = (lay or row)["prefill_ms"]["median"]
    nominal = kv * 8 / (rate_mbit * 1e6) * 1e3
    at_ceiling = kv * 8 / (ceiling_mbit * 1e6) * 1e3
    return {"transfer_ms_nominal": nominal, "transfer_ms_at_ceiling": at_ceiling, "layer_prefill_ms": prefill,
            "bulk_exposed_ms": at_ceiling,
            "layer_exposed_ms": layer_exposed(at_ceiling, prefill, layers)}


LINK_TOLERANCE = 1.1  # bulk transfer within 10% of bytes / rate


def link_check(result: dict) -> list[dict]:
    """Bulk transfer time against bytes / rate (the tbf rate, and the ceiling TCP reached), per row."""
    out = []
    for block in result["rates"]:
        for row in block["lengths"]:
            for t in result["config"]["transports"]:
                b = _result(row, t, "bulk")
                if b is None:
                    continue
                ms, pred = b["transfer_ms"]["median"], row["predicted"]
                out.append({"transport": t, "rate_mbit": block["rate_mbit"], "ceiling_mbit": block["ceiling"]["mbit_s"],
                            "tokens": row["tokens"], "bulk_transfer_ms": ms,
                            "over_nominal": ms / pred["transfer_ms_nominal"],
                            "over_ceiling": ms / pred["transfer_ms_at_ceiling"],
                            "within_10pct_of_rate": ms <= LINK_TOLERANCE * pred["transfer_ms_nominal"],
                            "within_10pct_of_ceiling": ms <= LINK_TOLERANCE * pred["transfer_ms_at_ceiling"]})
    return out


def layer_exposed(transfer_ms: float, prefill_ms: float, layers: int) -> float:
    return max(transfer_ms / layers, transfer_ms - prefill_ms * (1 - 1 / layers))


def _result(row: dict, transport: str, mode: str) -> dict | None:
    return next((r for r in row["results"] if r["transport"] == transport and r["mode"] == mode
                 and "transfer_ms" in r), None)


def _ms(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 10 else f"{x:.0f}"


def verdict(prefill_ms: float, transfer_ms: float, bulk_exposed: float, layer_exposed: float) -> str:
    """prefill_ms: the layer runs' own prefill (sending beside it slows a CPU prefill)."""
    hidden = 1 - layer_exposed / bulk_exposed if bulk_exposed > 0 else 0.0
    if transfer_ms <= prefill_ms:
        return f"transfer < its prefill: layer hides {100 * hidden:.0f}% of the move"
    return (f"transfer > its prefill: layer can hide at most the prefill ({100 * prefill_ms / transfer_ms:.0f}% of "
            f"the move); it hid {100 * hidden:.0f}%")


def markdown(result: dict) -> str:
    c, p = result["config"], result["provenance"]
    la0, la1 = p.get("load_average_start"), p.get("load_average_end")
    lines = [
        f"KV transfer between two network namespaces over a tbf-shaped veth: {c['model']} {c.get('dtype')} on the "
        f"CPU ({c.get('kv_bytes_per_token')} B of KV per token); {provenance.describe(p)}",
        f"load average at start {la0[0]:.1f}, at end {la1[0]:.1f} (1 min; {p.get('cpu_count')} CPUs, shared "
        "with other work: prefill times are noisy)" if la0 and la1 else "",
        f"{c['repeats']} rounds after {c['warmup']} warm-up per rate and length, plain / bulk / layer shuffled per "
        "round, medians (min..max); predicted transfer = KV bytes x 8 / the link ceiling a plain TCP stream "
        "reached at that tbf rate (nominal: / the tbf rate); exposed = last byte in minus prefill end, as the "
        f"prefill side sees it; exact = {c['tokens_compared']} greedy tokens and logits bitwise equal to colocated "
        "after NaN-poisoned blocks, every run",
        "",
        "| transport | link Mbit/s (TCP reached) | tokens | KV MiB | prefill ms (plain; layer runs) | predicted transfer ms | bulk transfer ms "
        "(measured / predicted) | bulk exposed ms | layer exposed ms (predicted) | layer extra prefill ms | exact | "
        "what layer-wise does here (against the layer runs' own prefill) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for block in result["rates"]:
        for row in block["lengths"]:
            pred = row["predicted"]
            for t in c["transports"]:
                b, lay = _result(row, t, "bulk"), _result(row, t, "layer")
                if b is None or lay is None:
                    lines.append(f"| {t} | {block['rate_mbit']:g} | {row['tokens']} | | | | failed | | | | NO | |")
                    continue
                bt, be, le = (b["transfer_ms"]["median"], b["exposed_ms"]["median"], lay["exposed_ms"]["median"])
                pr = row["prefill_ms"]
                d = lay["extra_vs_plain"]["diff"]
                lines.append(
                    f"| {t} | {block['rate_mbit']:g} ({block['ceiling']['mbit_s']:.0f}) | {row['tokens']} | "
                    f"{row['kv_bytes'] / 2**20:.1f} | {pr['median']:.0f} ({pr['min']:.0f}..{pr['max']:.0f}); "
                    f"{lay['prefill_ms']['median']:.0f} | "
                    f"{pred['transfer_ms_at_ceiling']:.0f} (nominal {pred['transfer_ms_nominal']:.0f}) | "
                    f"{bt:.0f} ({b['transfer_ms']['min']:.0f}..{b['transfer_ms']['max']:.0f}), "
                    f"{bt / pred['transfer_ms_at_ceiling']:.2f}x | {be:.0f} | "
                    f"{_ms(le)} ({_ms(lay['exposed_ms']['min'])}..{_ms(lay['exposed_ms']['max'])}; "
                    f"{pred['layer_exposed_ms']:.0f}) | {d['median']:+.0f} ({d['min']:+.0f}..{d['max']:+.0f}) | "
                    f"{'yes' if b['exact'] and lay['exact'] else 'NO'} | {verdict(lay['prefill_ms']['median'], bt, be, le)} |")
    lines += ["", "Layer mode run by run, against the prediction from that run's own prefill P and the transfer T of "
              "the bulk runs (median): exposed = max(T / layers, T - P (1 - 1/layers)):", ""]
    for block in result["rates"]:
        for row in block["lengths"]:
            for t in c["transports"]:
                b, lay = _result(row, t, "bulk"), _result(row, t, "layer")
                if b is None or lay is None:
                    continue
                T = b["transfer_ms"]["median"]
                runs = [f"P {p:.0f} -> {_ms(e)} ({_ms(layer_exposed(T, p, c['num_layers']))})"
                        for p, e in zip(lay["prefill_ms"]["runs"], lay["exposed_ms"]["runs"])]
                lines.append(f"- {t}, {block['rate_mbit']:g} Mbit/s, {row['tokens']} tokens, T {T:.0f} ms: "
                             f"{'; '.join(runs)} ms")
    lines += ["", "Link check: bulk transfer against KV bytes / rate (target: within 10%, <= 1.1x):", ""]
    for c_ in result.get("link_check") or link_check(result):
        lines.append(f"- {c_['transport']}, {c_['rate_mbit']:g} Mbit/s (TCP reached {c_['ceiling_mbit']:.0f}), "
                     f"{c_['tokens']} tokens: {c_['bulk_transfer_ms']:.0f} ms = {c_['over_nominal']:.2f}x bytes / tbf "
                     f"rate ({'within' if c_['within_10pct_of_rate'] else 'NOT within'} 10%), "
                     f"{c_['over_ceiling']:.2f}x bytes / the measured ceiling "
                     f"({'within' if c_['within_10pct_of_ceiling'] else 'NOT within'} 10%)")
    lanes = {t: lane for block in result["rates"] for t, lane in block["ucx_lane"].items() if lane}
    for t, lane in lanes.items():
        lines.append(f"\n{t}: UCX lane {'+'.join(lane.get('transports', [])) or lane} "
                     f"({lane.get('scope')}, puts over {', '.join(lane.get('put') or []) or '?'})")
    return "\n".join(line for line in lines if line is not None)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["config"]["lengths"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        rates, series = [], {k: [] for k in ("predicted", "bulk transfer", "bulk exposed", "layer exposed", "prefill")}
        for block in result["rates"]:
            row = next((r for r in block["lengths"] if r["tokens"] == n), None)
            b = row and _result(row, result["config"]["transports"][0], "bulk")
            lay = row and _result(row, result["config"]["transports"][0], "layer")
            if not (b and lay):
                continue
            rates.append(block["rate_mbit"])
            series["predicted"].append(row["predicted"]["transfer_ms_at_ceiling"])
            series["bulk transfer"].append(b["transfer_ms"]["median"])
            series["bulk exposed"].append(b["exposed_ms"]["median"])
            series["layer exposed"].append(lay["exposed_ms"]["median"])
            series["prefill"].append(row["prefill_ms"]["median"])
        styles = {"predicted": "k--", "bulk transfer": "o-", "bulk exposed": "s-", "layer exposed": "^-",
                  "prefill": "g:"}
        for name, ys in series.items():
            ax.plot(rates, ys, styles[name], label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate, Mbit/s (tbf)")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{n} tokens, {result['config']['transports'][0]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"KV between two namespaces over a tbf-shaped link ({result['config']['model']}, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pdserve-bench multihost", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
