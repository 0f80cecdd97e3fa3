"""`pdserve-bench plan --measure MODEL`: the planner's profile measured here, by `pdserve-bench engine` on a grid
suited to the device, within a memory limit said up front.

    GRIDS[device type]             the engine bench's flags for what the planner reads (prefill by length, decode by
                                   batch x context) and nothing else: no transformers decode comparison, no
                                   chunked or mixed-step scenario (so the profile's chunk_step_ms is 0: a
                                   chunked step costs its decodes and tokens only), no mixed-context point;
                                   a few rounds each
    engine_argv(model, device, extra)   the engine bench's command line: the grid, then --measure-args (later wins)
    needs(argv)                    what that run holds at its peak, in GiB, from the model's shapes (no weights
                                   loaded): weights, KV pool, the roofline copy's buffers, the longest prefill's
                                   activations and the process itself
    measure_profile(model, device, extra, memory_gb)   refuses when needs() is over memory_gb (saying what
                                   to give instead), else runs the engine bench and reads its JSON into a Profile

Measured on the shared 2-core CPU (load average 3-5), `plan --measure smollm2-135m --device cpu` with the CPU
grid: 0:34 to 2:16 wall, 1.8 GiB max RSS (needs() says 2.5 GiB); the engine bench's own defaults (32k prompts,
64 x 16k contexts) need ~130 GiB there, which is what killed the command before this grid.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

from pdserve.bench.load.plan_sim import Profile

_ONLY_PROFILE = ["--mixed-batch", "0", "--hf-decode-context", "0", "--chunk-decodes", "0", "--mixed-step", ""]
GRIDS = {
    # prefill beyond 512 tokens is extrapolated along the last segment (plan_sim.Profile); on a shared 2-core CPU
    # a 1k prefill alone took ~19 s a round (transformers' and ours each round)
    "cpu": ["--lengths", "128,512", "--pairs", "2", "--batches", "1,8", "--contexts", "256,1k",
            "--repeats", "3", "--warmup", "1", *_ONLY_PROFILE],
    "cuda": ["--lengths", "1k,4k,16k", "--pairs", "3", "--batches", "1,8,32,64", "--contexts", "1k,4k,16k",
             "--repeats", "5", "--warmup", "2", *_ONLY_PROFILE],
}
PROCESS_GIB = 1.0  # python, torch and transformers imported, the tokenizer: the engine bench's RSS before the model
BLOCK_SLACK = 1.1  # the pool's block rounding and the extra steps each decode point runs


def engine_argv(model: str, device: str, extra: str = "") -> list[str]:
    kind = device.split(":")[0]
    if kind not in GRIDS:
        raise ValueError(f"--device {device!r}: the planner measures on cpu or cuda[:N]")
    return ["engine", "--model", model, "--device", device, *GRIDS[kind], *shlex.split(extra)]


def _meta_model(name: str, dtype):
    """The model's shapes on the meta device (no memory): a synthetic one by name, else its config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.settings import models as names
    from pdserve.workers.engine.models import build_meta

    if name in ("tiny", "qwen2.5-7b"):
        return build_meta(name, dtype)
    path = names.smollm2_cache_dir() if name == "smollm2-135m" else Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"cannot size {name!r} before loading it: no config.json in {path} (run pdserve once with "
                         "it, or give a checkpoint directory)")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def needs(argv: list[str]) -> dict:
    """GiB the engine bench run `argv` holds at its peak, by part, from the model's shapes and the grid."""
    import argparse

    from pdserve.bench.cli import parse_counts
    from pdserve.bench.engine import steps
    from pdserve.workers.engine.models import kv_bytes_per_token, resolve_dtype

    parser = argparse.ArgumentParser()
    steps.add_arguments(parser)
    a = parser.parse_args(argv[1:])
    dtype = resolve_dtype(a.dtype, a.device, a.model)
    model = _meta_model(a.model, dtype)
    cfg = model.config
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    per_token = kv_bytes_per_token(cfg, dtype)
    lengths, batches, contexts = parse_counts(a.lengths), parse_counts(a.batches), parse_counts(a.contexts)
    biggest = max(batches) * max(contexts)  # the largest decode point's context tokens
    pool = max(biggest, max(lengths)) * per_token * BLOCK_SLACK
    roofline = weights + biggest * per_token  # the copy's two halves: the largest point's bytes
    longest = max(lengths)
    # transformers' prefill of the longest prompt: hidden states and MLP intermediates (a few live at once) and
    # one layer's attention scores (the CPU's SDPA materialises them)
    activations = longest * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * dtype.itemsize \
        + cfg.num_attention_heads * longest * longest * 4
    parts = {"weights": weights, "kv_pool": pool, "roofline_copy": roofline, "prefill_activations": activations}
    gib = {k: v / 2**30 for k, v in parts.items()}
    gib["process"] = PROCESS_GIB
    gib["total"] = sum(gib.values())
    return gib


def measure_profile(model: str, device: str, extra: str = "", memory_gb: float | None = None) -> Profile:
    argv = engine_argv(model, device, extra)
    if memory_gb is not None and device.startswith("cpu"):
        need = needs(argv)
        if need["total"] > memory_gb:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in need.items() if k != "total")
            raise ValueError(f"measuring {model}'s profile on {device} with this grid needs about {need['total']:.1f} "
                             f"GiB ({parts}), over --measure-memory-gb {memory_gb:g}: give a smaller grid "
                             "(--measure-args '--batches 1,4 --contexts 256 --lengths 128'), a smaller model, "
                             "or a higher limit")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        argv += ["--out", str(out)]
        print("measuring the profile: pdserve-bench " + shlex.join(argv), file=sys.stderr)
        from pdserve.bench import cli

        with contextlib.redirect_stdout(sys.stderr):  # the engine's tables: the plan's stdout stays the plan
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # a flag the engine bench refused
                rc = e.code
        if rc != 0:
            raise ValueError(f"measuring the profile failed (pdserve-bench engine exited {rc})")
        return Profile.from_engine_json(json.loads(out.read_text()), source=f"measured: {model} on {device}")
