"""A worker's steps, one JSON line each: what a served step held, which forward ran it, and where its
time went on the host and on the device. `--step-trace DIR` turns it on (EngineConfig.step_trace);
each worker writes DIR/steps-<worker id>.jsonl from the moment it is ready (its warm-up is not in it).
`pdserve-bench trace` reads the files and sets each step beside what the planner's profile says a step
of that make costs (bench/load/trace.py).

Why: a load run's timings say a request's prefill phase took 98 ms where the profile's forward takes
16; only the steps around it say whether the GPU was busy with other rows, idle while the host
launched, or time-sliced with another process. This records that for every step at the cost of two
CUDA events and a dict, written in batches.

The first line describes the trace: {"trace": "pdserve steps", "version", "worker", "device", "role",
"model", "unix_time" (of t = 0), and the settings that shape its steps}. Then one line per step (a worker
restarted under the same id appends its own header and steps):

    i               the step's number on this worker
    kind            "step" (a colocated or decode worker's engine step) or "prefill" (a prefill
                    worker's forward of whole prompts)
    path            the forward that ran it (ModelRunner.path): decode-graph, piecewise-graph, piecewise
                    (the piecewise segments run directly: past the graphs' tokens, or no graphs), eager
    t               seconds since t = 0 when the step began (before its scheduling)
    decode          decode rows; decode_ctx: the context their attention reads, summed
    chunks          [[start, end], ...] the prompt positions each prompt row computed
    tokens          rows in the forward (decode rows + prompt tokens)
    schedule_ms     host: choosing the step's rows (a colocated or decode worker's scheduler; a prefill
                    worker's taking of the prompts' blocks, a reload from the KV tiers included)
    launch_ms       host: building its inputs and launching its forward and sampling (on the CPU, where
                    a forward is done when launched, its whole run)
    device_ms       device: from the forward's first kernel to the sampled tokens' copy (CUDA events;
                    null on the CPU)
    gap_ms          device: from the previous step's end to this one's start on the compute stream: the
                    device waiting for the host to launch it, or other work queued between (null for
                    the first step and on the CPU)
    wait_ms         host: blocked reading the step's tokens back
    launch_cpu_ms   host: CPU time the launching thread itself used during launch_ms (time.thread_time);
                    launch_ms well above it: the thread waited (the GIL, a lock, a sleep) or was preempted
    launch_gc_ms    host: Python's garbage collector during launch_ms (gc.callbacks)
    launch_sync_ms  host: waits for the device during launch_ms (a graph's staging buffer, `host_wait`);
                    CUDA may spin in them, so they count in launch_cpu_ms too
    launch_csw      [voluntary, involuntary] context switches of the launching thread during launch_ms
                    (getrusage(RUSAGE_THREAD); null where the platform has none): involuntary ones are
                    the scheduler taking the core away
    startup_work    compiles and graph captures while it launched (compiles.work_count: torch.compile
                    frames, Triton compiles, graphs); 0 once the worker's start covered what it runs
    done_t          seconds since t = 0 when its outputs were recorded

Written in batches (every FLUSH_STEPS steps or FLUSH_S seconds, whenever the worker has no request, and at
close), at most MAX_STEPS steps
(the last line then says {"truncated": true}). Nothing of a prompt's text or tokens is written.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time

import torch

from pdserve.workers.engine.request import decode_row

FLUSH_STEPS = 256
FLUSH_S = 2.0
MAX_STEPS = 1_000_000  # about 200 MB of lines
VERSION = 1


class _HostTime:
    """Running totals of this process's host time that a step's launch may include: garbage collection
    (a gc.callbacks hook, installed once a trace exists) and waits for the device (`host_wait`)."""

    gc_s = 0.0
    sync_s = 0.0
    _gc_began: float | None = None
    _hooked = False

    @classmethod
    def hook(cls) -> None:
        if not cls._hooked:
            gc.callbacks.append(cls._on_gc)
            cls._hooked = True

    @classmethod
    def _on_gc(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._gc_began = time.perf_counter()
        elif cls._gc_began is not None:
            cls.gc_s += time.perf_counter() - cls._gc_began
            cls._gc_began = None


def host_wait(event) -> None:
    """event.synchronize(), its time counted as a wait for the device in the step trace (launch_sync_ms)."""
    t = time.perf_counter()
    event.synchronize()
    _HostTime.sync_s += time.perf_counter() - t


_THREAD_USAGE = getattr(resource, "RUSAGE_THREAD", None)  # Linux


def _switches() -> tuple[int, int] | None:
    if _THREAD_USAGE is None:
        return None
    u = resource.getrusage(_THREAD_USAGE)
    return u.ru_nvcsw, u.ru_nivcsw


def trace_path(directory: str, worker: str) -> str:
    """The file a worker of this id writes in `directory`."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker)
    return os.path.join(directory, f"steps-{safe}.jsonl")


class StepTrace:
    def __init__(self, path: str, device: torch.device, header: dict, work_count=lambda: 0):
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # appended to: a worker restarted under the same id (pdserve's supervision) adds a header and its steps
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.file = os.fdopen(fd, "w")
        self.path = path
        self.cuda = device.type == "cuda"
        self.t0 = time.monotonic()
        # the header at once: a trace file always says what it is
        self.file.write(json.dumps({"trace": "pdserve steps", "version": VERSION, **header,
                                    "unix_time": time.time()}) + "\n")
        self.file.flush()
        self.lines: list[str] = []
        self.steps = 0
        self.flushed = self.t0
        self.last_end: torch.cuda.Event | None = None  # the previous step's end on the compute stream
        self.truncated = False
        self.work_count = work_count  # compiles and captures so far (compiles.work_count)
        _HostTime.hook()

    @classmethod
    def of_engine(cls, engine, worker: str, role: str) -> "StepTrace":
        """The trace of this engine's steps, in its config's step_trace directory, its header naming the
        worker and the settings that shape its steps."""
        c, mixed = engine.config, engine.runner.mixed
        header = {"worker": worker, "role": role, "device": str(engine.device), "model": engine.model_name,
                  "chunked_prefill": c.chunked_prefill, "chunk_tokens": c.step_chunk_tokens,
                  "max_batched_tokens": c.max_batched_tokens, "max_num_seqs": c.max_num_seqs,
                  "graph_tokens": max(mixed.graph_buckets, default=0) if mixed is not None else 0,
                  "overlap": engine.overlap}
        from pdserve.workers.engine.compiles import work_count

        return cls(trace_path(c.step_trace, worker), engine.device, header, lambda: work_count(engine))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def begin(self, kind: str, work, began: float, scheduled: float) -> dict | None:
        """A step about to launch: its make and host stamps so far (monotonic seconds); the device's start
        event is recorded here. None once MAX_STEPS were written."""
        if self.steps >= MAX_STEPS:
            if not self.truncated:
                self.truncated = True
                self.lines.append(json.dumps({"truncated": True, "steps": self.steps}))
                self.flush()
            return None
        decode, ctx, chunks = 0, 0, []
        for r, n in work:
            if decode_row(r, n):
                decode += 1
                ctx += r.num_computed + 1
            else:
                chunks.append([r.num_computed, r.num_computed + n])
        entry = {"i": self.steps, "kind": kind, "path": None, "t": round(began - self.t0, 6), "decode": decode,
                 "decode_ctx": ctx, "chunks": chunks, "tokens": decode + sum(b - a for a, b in chunks),
                 "schedule_ms": round((scheduled - began) * 1e3, 3), "_launch": time.monotonic(),
                 "_work": self.work_count(), "_host": (time.thread_time(), _HostTime.gc_s, _HostTime.sync_s,
                                                        _switches())}
        self.steps += 1
        if self.cuda:
            entry["_start"] = torch.cuda.Event(enable_timing=True)
            entry["_start"].record()
            entry["_prev"] = self.last_end
        return entry

    def launched(self, entry: dict | None, path: str | None) -> None:
        """The step's forward and sampling are launched (the device's end event recorded here)."""
        if entry is None:
            return
        entry["path"] = path
        entry["launch_ms"] = round((time.monotonic() - entry.pop("_launch")) * 1e3, 3)
        entry["startup_work"] = self.work_count() - entry.pop("_work")
        cpu, gc_s, sync_s, csw = entry.pop("_host")
        entry["launch_cpu_ms"] = round((time.thread_time() - cpu) * 1e3, 3)
        entry["launch_gc_ms"] = round((_HostTime.gc_s - gc_s) * 1e3, 3)
        entry["launch_sync_ms"] = round((_HostTime.sync_s - sync_s) * 1e3, 3)
        now = _switches()
        entry["launch_csw"] = None if csw is None else [now[0] - csw[0], now[1] - csw[1]]
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            entry["_end"] = self.last_end = end

    def settled(self, entry: dict | None, wait_s: float) -> None:
        """Its tokens are on the host (so both of its events have passed): the line is complete."""
        if entry is None:
            return
        start, end, prev = entry.pop("_start", None), entry.pop("_end", None), entry.pop("_prev", None)
        if end is not None:  # recorded just after the tokens' copy, which has passed: a wait of microseconds at most
            end.synchronize()
        entry["device_ms"] = round(start.elapsed_time(end), 3) if start is not None and end is not None else None
        entry["gap_ms"] = round(prev.elapsed_time(start), 3) if prev is not None and start is not None else None
        entry["wait_ms"] = round(wait_s * 1e3, 3)
        entry["done_t"] = round(self.now(), 6)
        self.lines.append(json.dumps(entry))
        if self.due():
            self.flush()

    def due(self) -> bool:
        """Lines wait to be written: FLUSH_STEPS of them, or some for FLUSH_S seconds."""
        return len(self.lines) >= FLUSH_STEPS or (bool(self.lines) and time.monotonic() - self.flushed >= FLUSH_S)

    def flush(self) -> None:
        if self.lines and not self.file.closed:
            self.file.write("\n".join(self.lines) + "\n")
            self.file.flush()
        self.lines.clear()
        self.flushed = time.monotonic()

    def close(self) -> None:
        if not self.file.closed:
            self.flush()
            self.file.close()

