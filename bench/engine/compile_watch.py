"""What a stretch of code compiled, and where one call's time went (`pdserve-bench start`).

    CompileWatch()           .start() ... .stop() -> dict: between the two, torch.compile's frames
                             compiled, graphs made, recompiles with dynamo's reasons, compile seconds
                             by phase (torch._dynamo.utils.compilation_time_metrics); Triton compiles
                             through triton.compiler.compile in this process, by kernel, with seconds
                             (a cache hit shows as a compile of a few ms)
    cache_entries()          files in Triton's and Inductor's on-disk caches now (none: a cold start)
    use_cache_dir(folder)    point both caches at folder/triton and folder/inductor (before anything compiles)
    profile_call(fn, device, folder) -> dict   fn under torch.profiler (host activity) and cProfile at
                             once: the top 15 ops by CPU time (children included) and by self CPU time, the top 15 Python
                             functions by cumulative time; full tables and a gzipped trace into folder
"""

from __future__ import annotations

import cProfile
import gzip
import io
import logging
import os
import pstats
import shutil
import time
from pathlib import Path

import torch

from pdserve.workers.engine.compiles import by_kernel, timing

TOP = 15


class _Recompiles(logging.Handler):
    """Dynamo's `recompiles` log records (torch._logging), kept."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.endswith("__recompiles"):
            self.reasons.append(record.getMessage())


class CompileWatch:
    def __init__(self):
        self.triton: list[tuple[str, float]] = []  # (kernel name, seconds) of each triton.compiler.compile call
        self.triton_timed = False

    def start(self) -> "CompileWatch":
        from torch._dynamo.utils import compilation_time_metrics, counters

        self.frames0 = counters["frames"]["ok"]
        self.graphs0 = counters["stats"]["unique_graphs"]
        self.metrics0 = {k: sum(v) for k, v in compilation_time_metrics.items()}
        torch._logging.set_logs(recompiles=True)  # dynamo logs each recompile and its guard failures
        self.handler = _Recompiles()
        logging.getLogger("torch._dynamo").addHandler(self.handler)
        self._time_triton()
        self.began = time.monotonic()
        return self

    def _time_triton(self) -> None:
        """Wrap triton.compiler.compile, which a Triton kernel binds at its first launch."""
        try:
            import triton.compiler as tc
        except ImportError:
            return
        real = tc.compile
        tc.compile = timing(real, self.triton)
        self._restore = lambda: setattr(tc, "compile", real)
        self.triton_timed = True

    def stop(self) -> dict:
        from torch._dynamo.utils import compilation_time_metrics, counters

        logging.getLogger("torch._dynamo").removeHandler(self.handler)
        if not os.environ.get("TORCH_LOGS"):  # back to torch's defaults (TORCH_LOGS, if set, was overridden)
            torch._logging.set_logs()
        if self.triton_timed:
            self._restore()
        phases = {k: sum(v) - self.metrics0.get(k, 0.0) for k, v in compilation_time_metrics.items()}
        kernels = by_kernel(self.triton)
        return {
            "seconds_watched": time.monotonic() - self.began,
            "dynamo_frames_compiled": counters["frames"]["ok"] - self.frames0,
            "dynamo_graphs": counters["stats"]["unique_graphs"] - self.graphs0,
            "dynamo_recompiles": len(self.handler.reasons),
            "dynamo_recompile_reasons": sorted(set(self.handler.reasons))[:20],
            # nested phases (compile_inner holds the others): not to be added up
            "dynamo_phase_s": dict(sorted(((k, v) for k, v in phases.items() if v > 0), key=lambda kv: -kv[1])[:10]),
            "triton_compiles": len(self.triton) if self.triton_timed else None,
            "triton_compile_s": sum(s for _, s in self.triton) if self.triton_timed else None,
            "triton_by_kernel": kernels if self.triton_timed else None,
        }


def _inductor_cache() -> Path:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"))
    return Path(cache_dir())


def _triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def cache_entries() -> dict:
    def count(folder: Path) -> int:
        return sum(len(files) for _, _, files in os.walk(folder)) if folder.is_dir() else 0

    t, i = _triton_cache(), _inductor_cache()
    return {"triton_dir": str(t), "triton_files": count(t), "inductor_dir": str(i), "inductor_files": count(i)}


def use_cache_dir(folder: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = str(Path(folder) / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(folder) / "inductor")


def _op_rows(averages, key: str) -> list[dict]:
    rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:TOP]
    return [{"op": e.key, "calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]


def profile_call(fn, device: torch.device, folder: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    py = cProfile.Profile()
    t = time.monotonic()
    # host activity only: what a capture waits for is the host (compiles, launches), and CUPTI's
    # device tracing is kept out of a stream being captured
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        py.enable()
        try:
            fn()
        finally:
            py.disable()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.monotonic() - t
    averages = prof.key_averages()
    (out / "by-cpu-total.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=50))
    (out / "by-self-cpu.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=50))
    text = io.StringIO()
    stats = pstats.Stats(py, stream=text).sort_stats("cumulative")
    stats.print_stats(60)
    (out / "python-cumulative.txt").write_text(text.getvalue())
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(out / "trace.json.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    functions = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:TOP]
    return {
        "wall_s": wall,
        "ops_by_cpu_total": _op_rows(averages, "cpu_time_total"),
        "ops_by_self_cpu": _op_rows(averages, "self_cpu_time_total"),
        "python_by_cumulative": [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
                                  "own_s": own, "cumulative_s": cum}
                                 for (file, line, name), (_, calls, own, cum, _) in functions],
        "files": sorted(p.name for p in out.iterdir()),
    }
