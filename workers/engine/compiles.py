"""Start-up work a worker does while it serves: each one is time a request waits.

A worker's start compiles its code and captures its CUDA graphs ahead of traffic (warmup.py). Whatever
the start did not reach is done the first time a step needs it, inside that step: a torch.compile frame
(dynamo, and Inductor's code under it), a Triton kernel variant, a decode or piecewise graph's capture.
Under load that shows as a slow first minute (a capacity probe judged cold), so the worker says so in
its log, one line per stats interval in which any happened (Worker.run), with what and how long.

    ServingWork().start()     before the engine is built: wraps triton.compiler.compile (once per process,
                              left in place), which each Triton kernel binds at its first launch (a kernel
                              launched before the wrap would compile its later variants unseen)
    .mark(engine)             at ready: what the start did is not reported, only what comes after
    .take(engine) -> dict | None   what happened since the last mark or take (None: nothing)
    describe(taken) -> str    the log line's text

Counted: dynamo's compiled frames and the seconds of `_compile.compile_inner` (torch._dynamo.utils),
Triton compiles by kernel name with their seconds (a compile served from Triton's disk cache counts too,
at a few ms), graphs captured (the engine's decode and piecewise graphs' capture_s, less those a lazy
worker took while it had no request: DecodeGraphs.idle). All cheap to read:
counters and dict sizes, once an interval.
"""

from __future__ import annotations

import contextlib
import threading
import time


# what the worker's warning says before its text (Worker.check_serving_work); the load bench finds it in a log
LOG_MARK = "start-up work while serving (the steps waited for it): "

_TRITON: list[tuple[str, float]] = []  # (kernel, seconds) of every Triton compile since the wrap went in
_LOCK = threading.Lock()


def timing(real, into: list, lock=None):
    """`real` (triton.compiler.compile) wrapped to append (kernel name, seconds) of each call to `into`
    (under `lock`, if given), a failed compile too; pdserve-bench start's CompileWatch uses it as well."""
    guard = lock if lock is not None else contextlib.nullcontext()

    def timed(src, *args, **kwargs):
        t = time.monotonic()
        try:
            return real(src, *args, **kwargs)
        finally:
            with guard:
                into.append((getattr(src, "name", type(src).__name__), time.monotonic() - t))

    return timed


def by_kernel(compiles: list[tuple[str, float]]) -> dict[str, dict]:
    """(kernel, seconds) rows -> {kernel: {"compiles": n, "s": seconds}}."""
    out: dict[str, dict] = {}
    for name, s in compiles:
        row = out.setdefault(name, {"compiles": 0, "s": 0.0})
        row["compiles"] += 1
        row["s"] += s
    return out


def _wrap_triton() -> None:
    """Time triton.compiler.compile, once per process (every ServingWork reads the same record)."""
    try:
        import triton.compiler as tc
    except ImportError:  # no Triton (a CPU-only install): nothing of it to see
        return
    if getattr(tc.compile, "_pdserve_timed", False):
        return
    timed = timing(tc.compile, _TRITON, _LOCK)
    timed._pdserve_timed = True
    tc.compile = timed


class ServingWork:
    def __init__(self):
        self._seen = (0, 0.0, 0, 0, 0.0)  # frames, dynamo s, triton compiles, graphs, graph s: at the last mark/take

    def start(self) -> "ServingWork":
        _wrap_triton()
        return self

    @staticmethod
    def _dynamo() -> tuple[int, float]:
        try:
            from torch._dynamo.utils import compilation_time_metrics
        except ImportError:
            return 0, 0.0
        return _dynamo_frames(), sum(compilation_time_metrics.get("_compile.compile_inner", ()))

    @staticmethod
    def _graphs(engine) -> tuple[int, float]:
        n, s = 0, 0.0
        runner = getattr(engine, "runner", None)
        for part in (getattr(runner, "graphs", None), getattr(runner, "mixed", None)):
            if part is not None:  # a graph taken while the worker had no request held no step
                idle = getattr(part, "idle", ())
                n += len(part.capture_s) - len(idle)
                s += sum((v for k, v in part.capture_s.items() if k not in idle), 0.0)
        return n, s

    def _now(self, engine) -> tuple[int, float, int, int, float]:
        frames, dynamo_s = self._dynamo()
        graphs, graphs_s = self._graphs(engine)
        with _LOCK:
            return frames, dynamo_s, len(_TRITON), graphs, graphs_s

    def mark(self, engine) -> None:
        self._seen = self._now(engine)

    def take(self, engine) -> dict | None:
        frames, dynamo_s, n_triton, graphs, graphs_s = now = self._now(engine)
        f0, d0, t0, g0, gs0 = self._seen
        self._seen = now
        with _LOCK:
            kernels = _TRITON[t0:n_triton]
        if frames == f0 and not kernels and graphs == g0:
            return None
        return {"dynamo_frames": frames - f0, "dynamo_s": dynamo_s - d0, "triton": by_kernel(kernels),
                "graphs": graphs - g0, "graphs_s": graphs_s - gs0}


def _dynamo_frames() -> int:
    """torch.compile's frames compiled so far in this process (0 without dynamo)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return counters["frames"]["ok"]


def work_count(engine) -> int:
    """Compiles and captures so far in this process and engine, counted together (dynamo frames, Triton
    compiles, graphs captured as ServingWork counts them): a step during which it grew waited for start-up
    work (step_trace.py, twice a traced step: no compile times summed here)."""
    with _LOCK:
        triton = len(_TRITON)
    return _dynamo_frames() + triton + ServingWork._graphs(engine)[0]


def describe(taken: dict) -> str:
    """`2 torch.compile frames 3.41 s; Triton _prefix_kernel 0.62 s; 3 graphs captured 0.48 s`."""
    parts = []
    if taken["dynamo_frames"]:
        parts.append(f"{taken['dynamo_frames']} torch.compile frame{'s' if taken['dynamo_frames'] != 1 else ''} "
                     f"{taken['dynamo_s']:.2f} s")
    if taken["triton"]:
        rows = sorted(taken["triton"].items(), key=lambda kv: -kv[1]["s"])
        parts.append("Triton " + ", ".join(f"{name}{' x' + str(r['compiles']) if r['compiles'] > 1 else ''} "
                                           f"{r['s']:.2f} s" for name, r in rows[:6])
                     + (f" and {len(rows) - 6} more" if len(rows) > 6 else ""))
    if taken["graphs"]:
        parts.append(f"{taken['graphs']} graph{'s' if taken['graphs'] != 1 else ''} captured {taken['graphs_s']:.2f} s")
    return "; ".join(parts)
