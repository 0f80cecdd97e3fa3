"""A worker's start, measured: the ready line's parts (workers/engine/start_times.py), the decode graphs'
buckets, and `pdserve-bench start` on the CPU (the GPU run's smoke test).

- start_engine on a tiny CPU worker: its ready line names every part (no graphs on the CPU), the parts
  are the record's and never sum past the total; a prefill worker captures its piecewise graphs and no
  decode graph, --no-warmup runs no request.
- decode_buckets: no block-table bucket wider than the pool (a request never holds more blocks); a
  limit under the first bucket size is a bucket of its own (it looped forever).
- CompileWatch sees a dynamo recompile with its reason and a Triton compile by kernel name.
- decode_rows: each graph's bucket split, the graphs whose forward compiles marked (what the GPU run reports).
- `pdserve-bench start --model tiny --device cpu --profile DIR`: the JSON's parts are the ready line's,
  the profile's tables are there, every figure recomputed from the raw ones.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.bench import cli
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.graphs import decode_buckets
from pdserve.workers.engine.start_times import PARTS
from pdserve.workers.status_log import startup_line
from pdserve.workers.warmup import start_engine

PART_NAMES = ("model load", "KV pool", "KV tiers", "engine set-up", "decode graphs", "piecewise graphs",
              "warm-up request", "other")


def shown(line: str) -> dict[str, float]:
    """The seconds the ready line gives each part, by name."""
    figures = {}
    m = re.search(r"ready ([\d.]+) s after start \(model load ([\d.]+) s, then ([\d.]+) s: (.*)\)$", line)
    assert m, line
    figures["total"], figures["model load"], figures["after load"] = float(m[1]), float(m[2]), float(m[3])
    for part in m[4].split(", "):
        name, s = re.fullmatch(r"(?:\d+ )?(.+) ([\d.]+) s", part).groups()
        figures[name] = float(s)
    return figures


def test_ready_line_names_each_part_and_they_sum_to_at_most_the_total():
    engine = start_engine(EngineConfig(model="tiny", num_blocks=64), "colocated")
    s = engine.start
    line = startup_line("colocated-0", "colocated", engine)
    figures = shown(line)
    assert set(PART_NAMES) <= set(figures), line
    assert "; ready " in line and "0 decode graphs 0.00 s" in line and "0 piecewise graphs 0.00 s" in line  # CPU
    assert s.decode_graphs == s.piecewise_graphs == 0
    parts = s.parts()
    assert set(parts) == {attr for attr, _ in PARTS}
    assert all(v >= 0 for v in parts.values()) and s.load_s > 0 and s.warmup_s > 0 and s.kv_pool_s > 0
    assert sum(parts.values()) <= s.total_s and s.other_s >= 0
    assert s.after_load_s == pytest.approx(s.total_s - s.load_s)
    # the line's figures are the record's, rounded to 10 ms
    for attr, name in PARTS:
        assert figures[name] == pytest.approx(getattr(s, attr), abs=0.006), name
    assert figures["total"] == pytest.approx(s.total_s, abs=0.006)
    assert figures["other"] == pytest.approx(s.other_s, abs=0.006)
    assert engine.requests == {} and engine.blocks.num_free == engine.blocks.num_blocks  # the warm-up left nothing


def test_a_prefill_worker_without_warm_up_runs_no_request_and_captures_no_decode_graphs(monkeypatch):
    """A prefill worker takes its piecewise graphs at start, as the other roles do (its forwards replay
    them: taken lazily, the first prompt of each size paid the capture in its TTFT), and no decode graph."""
    from pdserve.workers.engine.graphs import DecodeGraphs, MixedGraphs

    taken = []
    monkeypatch.setattr(MixedGraphs, "capture", lambda self, buckets=None: taken.append("piecewise") or 0.0)
    monkeypatch.setattr(DecodeGraphs, "capture", lambda self, keys: taken.append("decode") or 0.0)
    engine = start_engine(EngineConfig(model="tiny", num_blocks=64), "prefill", warmup=False)
    assert engine.runner.mixed is not None and taken == ["piecewise"]
    s = engine.start
    assert s.warmup_s == 0 and s.decode_graphs == 0 and s.total_s >= sum(s.parts().values())
    assert "warm-up request 0.00 s" in startup_line("prefill-0", "prefill", engine)
    # the decode graphs, where a worker has them, are taken by the decoding roles only
    engine.runner.graphs = DecodeGraphs.__new__(DecodeGraphs)
    engine.runner.graphs.capture_s, engine.runner.graphs.graphs = {}, {}
    monkeypatch.setattr(DecodeGraphs, "capture_order", lambda self: [(1, 16)])
    taken.clear()
    engine.warmup(decode=False)
    assert taken == ["piecewise"]
    engine.warmup()
    assert taken == ["piecewise", "decode", "piecewise"]


def test_where_graphs_stop_short_of_the_longest_step_a_second_warm_up_runs_one_past_them(monkeypatch):
    """CUDA's piecewise graphs stop at mixed_graph_tokens; longer steps run the segments directly. The warm-up
    then runs a prompt just past the limit too, with the prefix cache off for it: nothing of it stays. On the
    CPU (no graphs) it does not: every step runs the segments directly, as the first warm-up request did.
    Here the CPU engine's piecewise path stands in for CUDA's, its graph limit set to 64 tokens."""
    from pdserve.workers.engine.graphs import MixedGraphs
    from pdserve.workers.warmup import long_warmup_tokens, warm_up

    engine = Engine(EngineConfig(model="tiny", num_blocks=64))
    assert long_warmup_tokens(engine) == 0  # the CPU: no graphs
    monkeypatch.setattr(MixedGraphs, "graph_buckets", property(lambda self: [16, 32, 64]))
    engine.runner.mixed.graph_limit = 64
    assert long_warmup_tokens(engine) == 64 + 16 + 1
    seen, generate = [], engine.generate

    def spy(prompts, params=None):
        seen.append((len(prompts[0]), engine.blocks.enabled))
        return generate(prompts, params)

    monkeypatch.setattr(engine, "generate", spy)
    warm_up(engine)
    assert seen[1] == (81, False) and seen[0][1] is True and len(seen) == 2
    assert engine.blocks.enabled and engine.requests == {} and engine.blocks.num_cached == 0
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.runner.mixed.graph_limit = engine.runner.mixed.max_tokens  # graphs up to the longest step: no second
    assert long_warmup_tokens(engine) == 0


def test_a_line_before_the_start_is_over_says_nothing_of_it():
    from pdserve.workers.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", num_blocks=64))
    assert engine.start.total_s is None and "ready" not in startup_line("w", "colocated", engine)


def test_decode_buckets_stop_at_the_widest_table_the_pool_holds():
    # qwen2.5-7b's 32k context: 2048 blocks, 8 table buckets, when the pool holds that many or more
    batches, blocks = decode_buckets(64, 2048, 40_000)
    assert batches == [1, 2, 4, 8, 16, 32, 48, 64] and blocks == [16, 32, 64, 128, 256, 512, 1024, 2048]
    # a pool of 100 blocks: no request's table is wider than 100, so no graph wider than that is taken
    assert decode_buckets(64, 2048, 100)[1] == [16, 32, 64, 100]
    assert decode_buckets(64, 2048, 10)[1] == [10]
    assert decode_buckets(64, 50, 1000)[1] == [16, 32, 50]


@pytest.mark.timeout(20)
def test_buckets_below_the_first_size_end_at_the_limit():
    # a limit under the first size (a table bucket for --max-model-len 128: 8 blocks) looped forever,
    # stepping from 0, before a CUDA worker with such a context could take its graphs
    from pdserve.workers.engine.graphs import _buckets

    assert _buckets(8, [16], lambda b: b * 2) == [8]
    assert _buckets(2048, [16], lambda b: b * 2) == [16, 32, 64, 128, 256, 512, 1024, 2048]


_COMPILE_WATCH = """
import json, torch, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from pdserve.bench.engine.compile_watch import CompileWatch

def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

add_one = JITFunction(add_one)
real = triton.compiler.compile
watch = CompileWatch().start()
f = torch.compile(lambda x: (x * 2).sum(0), backend="eager", dynamic=True)
for n in (1, 2, 3):  # batch 1 is specialised: the second call recompiles, the third reuses it
    f(torch.ones(n, 3))
src = ASTSource(add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 16})
triton.compiler.compile(src, target=GPUTarget("cuda", 90, 32))  # the sm_90 binary, built without a GPU
got = watch.stop()
got["put_back"] = triton.compiler.compile is real
print(json.dumps(got))
"""


def test_compile_watch_sees_a_recompile_and_a_triton_compile(tmp_path):
    # in a fresh interpreter, without TRITON_INTERPRET: a kernel the interpreter ran in this process (the suite's
    # kernels run so, tests/conftest.py) can leave triton.language's builtins patched for the interpreter, and a
    # real compile after that fails on them
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "watch.py"  # a file: Triton reads a kernel's source from it
    script.write_text(_COMPILE_WATCH)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dynamo_frames_compiled"] == 2 and got["dynamo_recompiles"] == 1, got
    assert "size mismatch" in got["dynamo_recompile_reasons"][0]
    assert got["triton_compiles"] == 1 and got["triton_by_kernel"]["add_one"]["compiles"] == 1
    assert got["triton_compile_s"] == got["triton_by_kernel"]["add_one"]["s"] > 0
    assert got["put_back"]


def test_start_bench_cpu_smoke(tmp_path, capsys):
    out, prof = tmp_path / "start.json", tmp_path / "prof"
    assert cli.main(["start", "--model", "tiny", "--device", "cpu", "--num-blocks", "64", "--profile", str(prof),
                     "--cache-dir", str(tmp_path / "caches"), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    prov, c, s = r["provenance"], r["config"], r["start"]
    assert r["benchmark"] == "start" and prov["commit"] and prov["versions"]["torch"] and prov["command"]
    assert c["model"] == "tiny" and c["device"] == "cpu" and c["kv_blocks"] == 64 and not c["cuda_graphs"]
    # the parts: each there, none negative, their sum at most the total, `other` the rest
    parts = {attr: s[attr] for attr, _ in PARTS}
    assert all(v is not None and v >= 0 for v in parts.values()) and s["load_s"] > 0 and s["warmup_s"] > 0
    assert sum(parts.values()) <= s["total_s"]
    assert s["other_s"] == pytest.approx(s["total_s"] - sum(parts.values()))
    assert s["after_load_s"] == pytest.approx(s["total_s"] - s["load_s"])
    assert shown(r["ready_line"])["total"] == pytest.approx(s["total_s"], abs=0.006)
    # no graphs on the CPU; nothing compiled
    assert r["decode_graphs"] == [] and r["piecewise_graphs"] == [] and r["decode_summary"] == {"graphs": 0, "s": 0}
    assert s["decode_graphs"] == s["piecewise_graphs"] == 0
    k = r["compile"]
    assert k["dynamo_frames_compiled"] == 0 and k["dynamo_recompiles"] == 0 and k["triton_compiles"] == 0
    assert r["caches_at_start"]["triton_dir"] == str(tmp_path / "caches" / "triton")
    # the profile: of the warm-up request here (no decode graph to capture), said so; top 15 rows at most
    p = r["profile"]
    assert "warm-up request" in p["what"] and 0 < p["wall_s"]
    assert 0 < len(p["ops_by_cpu_total"]) <= 15 and 0 < len(p["python_by_cumulative"]) <= 15
    assert any(row["op"] == "aten::mm" for row in p["ops_by_self_cpu"])  # the model's matrix products
    totals = [row["cpu_total_ms"] for row in p["ops_by_cpu_total"]]
    assert totals == sorted(totals, reverse=True)
    assert any("warm_up" in row["function"] for row in p["python_by_cumulative"])
    assert {"by-cpu-total.txt", "by-self-cpu.txt", "python-cumulative.txt", "trace.json.gz"} <= set(p["files"])
    assert all((prof / name).stat().st_size > 0 for name in p["files"])
    t = r["targets"]["ready_within_20_s_of_load"]
    assert t["measured"] == s["after_load_s"] and t["met"] is (s["after_load_s"] <= 20)
    printed = capsys.readouterr().out
    assert r["ready_line"] in printed and f"wrote {out}" in printed


def test_decode_rows_mark_the_graphs_whose_forward_compiles():
    # what the GPU run reports per graph, from a CUDA engine's record (faked: no CUDA here)
    from types import SimpleNamespace

    from pdserve.bench.engine.start import decode_rows, summarise
    from pdserve.workers.engine.paged_kernel import decode_split

    keys = [(64, 2048), (48, 2048), (1, 2048), (64, 1024), (2, 16), (1, 16)]
    seconds = [9.0, 1.5, 4.0, 0.25, 1.0, 0.5]
    graphs = SimpleNamespace(capture_s=dict(zip(keys, seconds)), cut=None)  # transformers' forward
    engine = SimpleNamespace(runner=SimpleNamespace(kernels=True, graphs=graphs), device=torch.device("cpu"),
                             layout=SimpleNamespace(num_kv_heads=4, block_size=16))
    rows = decode_rows(engine, profiled=(48, 2048))
    splits = [list(decode_split(b, 4, k * 16, torch.device("cpu"))) for b, k in keys]
    assert [(r["batch"], r["blocks"], r["s"], r["split"]) for r in rows] == \
        [(*k, s, sp) for k, s, sp in zip(keys, seconds, splits)]
    # the first graph compiles the layers' dynamic code, the first of batch 1 their batch-1 code
    assert [r["compiles"] for r in rows] == [True, False, True, False, False, False]
    assert [r["profiled"] for r in rows] == [False, True, False, False, False, False]
    d = summarise(rows)
    assert d["graphs"] == 6 and d["s"] == sum(seconds) and d["compiling"] == 2
    assert d["compiling_s"] == 13.0 and d["other_s"] == pytest.approx(3.25) and d["other_median_s"] == 1.0
    # graphs that run the cut's segments: batch 1 runs them over 2 rows, so only the first graph compiles
    graphs.cut = object()
    assert [r["compiles"] for r in decode_rows(engine, profiled=None)] == [True] + [False] * 5


def test_the_start_is_frozen_out_of_garbage_collection_and_later_garbage_is_still_collected():
    """freeze_start: the start's own cyclic garbage collected first, every live object frozen (a later full
    collection walks none of them), a cycle made after it still collected; unfreeze_start undoes it."""
    import gc
    import weakref

    from pdserve.workers.warmup import freeze_start, unfreeze_start

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    before = cycle()  # garbage of the start: a cycle nothing refers to
    kept = Node()
    kept.me = kept  # alive at the freeze
    try:
        frozen, took_ms = freeze_start()
        assert before() is None  # collected, not frozen
        assert frozen == gc.get_freeze_count() > 1000 and took_ms >= 0  # this process's modules, at least
        assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it
        after = cycle()
        gc.collect()
        assert after() is None  # a later cycle: collected as ever
    finally:
        unfreeze_start()
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())  # walked again
