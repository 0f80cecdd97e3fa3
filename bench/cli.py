"""`pdserve-bench`: one command, one subcommand per benchmark.

    pdserve-bench load      colocated vs disaggregated under load (bench/load/generator.py)
    pdserve-bench transfer  the KV transfer table (bench/transfer/table.py)
    pdserve-bench engine    prefill and decode step times against transformers (bench/engine/steps.py)
    pdserve-bench cpu       the engine's decode on the CPU against transformers' generate(), interleaved (bench/engine/cpu.py)
    pdserve-bench offline   an offline workload beside its floor and transformers' batching (bench/engine/offline.py)
    pdserve-bench attention paged decode attention alone, against the bandwidth floor (bench/engine/paged_attention.py)
    pdserve-bench start     where a worker's start goes: model load, KV pool, each graph's capture, compiles (bench/engine/start.py)
    pdserve-bench paths     the fast paths (graphs, compile, overlap, chunks) against the plain one, per request (bench/engine/paths.py)
    pdserve-bench variants  the paged-attention kernels' Triton variants a CUDA worker compiles, keyed on the CPU (bench/engine/kernel_variants.py)
    pdserve-bench multihost the KV transfer across network namespaces over a shaped link (bench/transfer/multihost.py)
    pdserve-bench atlas     prompt profiles x SLO pairs x rates, which arm wins each cell (bench/load/atlas.py)
    pdserve-bench defaults  is the default configuration within a margin of the best measured one (bench/load/defaults.py)
    pdserve-bench plan      colocated or xP:yD for N GPUs, predicted from an engine profile (bench/load/planner.py)
    pdserve-bench offload   recompute vs reload per KV tier, every reload checked (bench/transfer/offload.py)
    pdserve-bench ceilings  what the host moves before any transport code: copies, ZeroMQ loopback (bench/transfer/ceilings.py)

Each module exposes `add_arguments(parser)` and `run(args) -> int`; parse_counts reads the token counts
their flags share (`--lengths 1k,4k,16384`: 1k = 1024).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "load": ("pdserve.bench.load.generator", "load generator: colocated vs disaggregated latency under the same load"),
    "transfer": ("pdserve.bench.transfer.table", "KV transfer table: prefill, transfer and first decode step per length"),
    "engine": ("pdserve.bench.engine.steps", "engine prefill and decode step times against transformers"),
    "cpu": ("pdserve.bench.engine.cpu", "the engine's decode on the CPU against transformers' generate(), side by side"),
    "offline": ("pdserve.bench.engine.offline", "an offline workload through the engine beside its floor and transformers' batching"),
    "attention": ("pdserve.bench.engine.paged_attention", "one layer's paged decode attention, kernel alone, against the bandwidth floor"),
    "start": ("pdserve.bench.engine.start", "where a worker's start goes: load, KV pool, each graph's capture, "
              "compiles, a profile of one capture"),
    "paths": ("pdserve.bench.engine.paths", "the engine's fast paths against its plain path on this device: "
              "greedy tokens and logits, seeded samples"),
    "variants": ("pdserve.bench.engine.kernel_variants", "the paged-attention kernels' Triton variants a CUDA worker "
                 "compiles, keyed on the CPU as Triton keys them; their sm_90 compile time"),
    "multihost": ("pdserve.bench.transfer.multihost", "KV transfer between network namespaces over a tbf-shaped link, bulk vs layer (root)"),
    "atlas": ("pdserve.bench.load.atlas", "where disaggregation wins and loses: prompt profiles x SLO pairs x rates, per arm"),
    "defaults": ("pdserve.bench.load.defaults", "is a default configuration within a margin of the best one, from "
                 "capacity searches"),
    "plan": ("pdserve.bench.load.planner", "how to split N GPUs (colocated or xP:yD) for a workload and SLOs, from a measured profile"),
    "trace": ("pdserve.bench.load.trace", "the steps a server's workers ran (--step-trace), by make, beside what the "
              "planner's profile predicts for each"),
    "spy": ("pdserve.bench.load.spy", "what a worker's threads were doing, from py-spy's sampled stacks (speedscope "
            "JSON): per thread, and inside the engine's step launches"),
    "ceilings": ("pdserve.bench.transfer.ceilings", "what this host moves before any transport code runs: host<->device "
                 "copies per thread, ZeroMQ loopback plain and CURVE over N streams, the receiver's writes"),
    "offload": ("pdserve.bench.transfer.offload", "KV offload table: recompute vs reload from GPU, pinned and pageable host, disk, checked"),
}


def parse_counts(text: str) -> list[int]:
    """"1k, 4k,16384" -> [1024, 4096, 16384]; every count positive, at least one."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if value <= 0:
            raise ValueError(f"counts must be positive, got {part!r}")
        out.append(value)
    if not out:
        raise ValueError(f"no counts in {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if argv and argv[0] == name:  # import only the chosen benchmark (and its heavy deps)
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
