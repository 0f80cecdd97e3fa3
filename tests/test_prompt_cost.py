"""`pdserve-bench trace --prompt-cost` (bench/load/prompt_cost.py): served prompt steps priced from a step trace."""

import json

import pytest

from pdserve.bench.load import prompt_cost, trace


def _step(i: int, chunks: list[tuple[int, int]], decode: int, ms: float) -> dict:
    return {"i": i, "kind": "step", "path": "piecewise", "t": i * 0.3, "decode": decode, "decode_ctx": decode * 9000,
            "chunks": [list(c) for c in chunks], "tokens": sum(b - a for a, b in chunks) + decode,
            "schedule_ms": 0.1, "launch_ms": 5.0, "device_ms": ms, "gap_ms": 0.0, "wait_ms": 0.0,
            "done_t": i * 0.3 + ms / 1e3}


def _priced(chunks, decode, per_prefix_k=0.0) -> float:
    """20 ms per 1k tokens + 1.2 per million pairs + 10 a step + 0.5 a decode row (+ per_prefix_k per 1k keys of
    prefix)."""
    tokens = sum(b - a for a, b in chunks)
    pairs = sum((b - a) * (a + b + 1) / 2 for a, b in chunks)
    prefix = max(a for a, _ in chunks)
    return 20 * tokens / 1e3 + 1.2 * pairs / 1e6 + 10 + 0.5 * decode + per_prefix_k * prefix / 1e3


def _prompt(size: int, chunk: int, start_i: int, per_prefix_k: float) -> list[dict]:
    steps, pos, i = [], 0, start_i
    while pos < size:
        end = min(size, pos + chunk)
        steps.append(_step(i, [(pos, end)], decode=i % 5, ms=_priced([(pos, end)], i % 5, per_prefix_k)))
        pos, i = end, i + 1
    return steps


ENGINE = {"prefill": [{"tokens": n, "ours_ms": {"median": 20 * n / 1e3 + 1.2 * n * (n + 1) / 2 / 1e6}}
                      for n in (1024, 4096, 16384, 32768)]}


def test_the_fit_reads_the_prices_back_and_the_prefix_cost_shows_by_depth():
    steps = [s for k, size in enumerate((9000, 17000, 30000, 12000)) for s in _prompt(size, 3000 + 500 * k, 20 * k, 0.0)]
    out = prompt_cost.report(steps, ENGINE)
    f = out["fit"]
    assert f["ms_per_1k_tokens"] == pytest.approx(20, rel=1e-6) and f["ms_per_m_pairs"] == pytest.approx(1.2, rel=1e-6)
    assert f["ms_per_step"] == pytest.approx(10, rel=1e-6) and f["ms_per_decode_row"] == pytest.approx(0.5, rel=1e-6)
    ref = out["reference"]
    assert ref["ms_per_1k_tokens"] == pytest.approx(20) and ref["ms_per_m_pairs"] == pytest.approx(1.2)
    assert all(row["excess_ms"] == pytest.approx(10) for row in out["excess_by_prefix"])  # the step's own 10 ms
    # a cost per prefix key (2 ms per 1k keys of prefix) shows as an excess growing with the depth
    deep = [s for k, size in enumerate((9000, 17000, 30000, 12000)) for s in _prompt(size, 3000 + 500 * k, 20 * k, 2.0)]
    rows = prompt_cost.report(deep, ENGINE)["excess_by_prefix"]
    assert [r["prefix"] for r in rows] == ["none", "1-8192", "8193-16384", "16385-24576", "24577+"]
    excess = [r["excess_ms"] for r in rows]
    assert excess == sorted(excess) and excess[-1] - excess[0] > 40
    s = prompt_cost.summary(steps)
    assert s["prompt_tokens"] == 68000 and s["prompt_steps"] == len(steps)


def test_the_trace_command_prints_and_writes_it(tmp_path, capsys):
    folder = tmp_path / "steps"
    folder.mkdir()
    steps = [s for k, size in enumerate((9000, 17000, 30000)) for s in _prompt(size, 4096, 20 * k, 1.0)]
    header = {"trace": "pdserve steps", "version": 1, "worker": "colocated-0", "role": "colocated", "device": "cuda:0",
              "model": "m", "chunked_prefill": True, "chunk_tokens": 4096, "unix_time": 0.0}
    (folder / "steps-colocated-0.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *steps]) + "\n")
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({**ENGINE, "decode": [{"batch": b, "context": c, "ours_ms": {"median": 5 + b * 0.1}}
                                                        for b in (1, 8) for c in (1024, 4096)]}))
    out = tmp_path / "t.json"
    assert trace.main([str(folder), "--profile", str(engine), "--prompt-cost", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{len(steps)} prompt steps, 56000 prompt tokens" in printed and "| 24577+ |" in printed
    cost = json.loads(out.read_text())["prompt_cost"][str(folder)]
    rows = cost["excess_by_prefix"]  # 1 ms per 1k keys of prefix on top of the engine's prices: 10 ms, then more
    assert rows[0]["excess_ms"] == pytest.approx(10) and rows[-1]["excess_ms"] > rows[0]["excess_ms"] + 20
