"""The planner's model of a deployment: a worker's measured profile and a discrete-event simulation of
requests through colocated workers or a prefill pool and a decode pool.

    Profile.from_engine_json(data)   prefill time by prompt length and decode step time by batch x context,
                                     from `pdserve-bench engine`'s JSON
    Split(prefill, decode, ...)      a deployment: colocated (prefill 0) with N workers, or xP:yD
    simulate(split, profile, requests)   each request's first-token and finish time

The model, stated so it can be checked against a measured run:
  - a prefill of tokens [a, b) of a prompt costs prefill_ms(b) - prefill_ms(a) (measured points, linear
    between them, through 0, the last segment's slope beyond);
  - a decode step of batch B over contexts c_i costs alpha + beta B + gamma sum(c_i), a least-squares fit
    of the measured batch x context grid (weights read once a step, per-row work, KV read);
  - a colocated step runs the decodes and a chunk of waiting prompts (chunk tokens; 0: one whole prompt),
    its time the decode step's plus the chunk's prefill: the interference a colocated worker has;
  - a prefill worker runs one prompt at a time; the KV moves in kv_bytes / link bandwidth (plus a fixed
    cost), the first token arrives with it; the decode worker adopts the request at its next step;
  - a new request goes to the worker with the least queued work (prompt tokens waiting, or rows running);
  - a worker holds at most max_batch decoding rows; more wait;
  - shared (1P:1D on one GPU): the GPU is shared evenly while both workers run a step (processor sharing:
    each step's work advances at half speed then), as two processes time-slicing one GPU.
Torch-free.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Profile:
    prefill_tokens: list[int]
    prefill_ms: list[float]
    decode_coef: tuple[float, float, float]  # alpha ms, beta ms per row, gamma ms per context token
    kv_bytes_per_token: int = 0
    source: str = ""

    def prefill(self, start: int, end: int) -> float:
        """Milliseconds to prefill prompt tokens [start, end)."""
        return self._cumulative(end) - self._cumulative(start)

    def _cumulative(self, n: int) -> float:
        xs, ys = [0, *self.prefill_tokens], [0.0, *self.prefill_ms]
        if n <= xs[-1]:
            return float(np.interp(n, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (n - xs[-1])

    def decode(self, batch: int, context_sum: int) -> float:
        a, b, g = self.decode_coef
        return max(0.0, a + b * batch + g * context_sum)

    @classmethod
    def from_points(cls, prefill: dict[int, float], decode: list[tuple[int, int, float]], kv_bytes_per_token: int = 0,
                    source: str = "") -> "Profile":
        """prefill {tokens: ms}; decode [(batch, context, ms)] (each row at that context)."""
        if not prefill or not decode:
            raise ValueError("a profile needs prefill points and decode points")
        tokens = sorted(prefill)
        # a noisy measurement can make a longer prompt look cheaper: the cumulative cost never falls, so no
        # segment of a prompt costs less than nothing
        ms = np.maximum.accumulate([float(prefill[t]) for t in tokens])
        rows = np.array([[1.0, b, b * c] for b, c, _ in decode])
        coef, *_ = np.linalg.lstsq(rows, np.array([t for _, _, t in decode]), rcond=None)
        return cls(tokens, [float(m) for m in ms], tuple(float(c) for c in coef), kv_bytes_per_token, source)

    @classmethod
    def from_engine_json(cls, data: dict, source: str = "") -> "Profile":
        """`pdserve-bench engine` JSON: prefill [{tokens, ours_ms: {median}}], decode [{kind: uniform, batch,
        context, ours_ms: {median}}], config.kv_bytes_per_token."""
        try:
            prefill = {int(p["tokens"]): float(p["ours_ms"]["median"]) for p in data["prefill"]}
            decode = [(int(d["batch"]), int(d["context"]), float(d["ours_ms"]["median"])) for d in data["decode"]
                      if d.get("kind", "uniform") == "uniform"]
            kv = int((data.get("config") or {}).get("kv_bytes_per_token") or 0)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an engine profile (pdserve-bench engine JSON): missing or bad {e}") from e
        return cls.from_points(prefill, decode, kv, source)

    def to_dict(self) -> dict:
        return {"source": self.source, "prefill_points": dict(zip(self.prefill_tokens, self.prefill_ms)),
                "decode_fit_ms": dict(zip(("alpha", "beta_per_row", "gamma_per_context_token"), self.decode_coef)),
                "kv_bytes_per_token": self.kv_bytes_per_token}


@dataclass(frozen=True)
class Split:
    """prefill == 0: `decode` colocated workers; else a prefill pool and a decode pool."""
    prefill: int
    decode: int
    chunk: int = 512  # colocated: prompt tokens per step (0: a whole prompt in one step)
    max_batch: int = 256
    link_gbps: float = 100.0  # GB/s between a prefill and a decode worker
    transfer_fixed_ms: float = 0.5
    shared: bool = False  # 1P:1D on one GPU: the two workers time-slice it

    def __post_init__(self):
        if self.decode < 1 or self.prefill < 0 or (self.shared and (self.prefill, self.decode) != (1, 1)):
            raise ValueError(f"a split needs >= 1 decode (or colocated) worker; shared is 1P:1D only: {self}")

    @property
    def gpus(self) -> int:
        return 1 if self.shared else self.prefill + self.decode

    @property
    def label(self) -> str:
        if self.shared:
            return "1P:1D sharing 1 GPU"
        if self.prefill == 0:
            return f"colocated x{self.decode}" + (" unchunked" if self.chunk == 0 else f" chunk {self.chunk}")
        return f"{self.prefill}P:{self.decode}D"


@dataclass
class Req:
    index: int
    arrival: float  # seconds
    prompt: int
    output: int
    done_prefill: int = 0
    generated: int = 0
    first_token: float | None = None
    finish: float | None = None


@dataclass
class _Worker:
    role: str  # "colocated" | "prefill" | "decode"
    waiting: deque = field(default_factory=deque)  # prompts to prefill, or (decode) requests to adopt
    running: list = field(default_factory=list)  # decoding rows
    gpu: int = 0
    busy: bool = False
    step: tuple = ()  # what the step in flight does: (decoding rows, [(req, end token)])
    left_ms: float = 0.0  # the step's work left at full speed, as of `since`
    since: float = 0.0
    version: int = 0  # a step-end event of an older version is stale (the GPU's share changed)

    def load(self) -> int:
        if self.role == "decode":
            return len(self.running) + len(self.waiting)
        return sum(r.prompt - r.done_prefill for r in self.waiting) + len(self.running)


def simulate(split: Split, profile: Profile, requests: list[Req]) -> list[Req]:
    """Runs every request to its end (no deadline); returns them with first_token and finish set."""
    events: list = []
    seq = [0]

    def push(t: float, kind: str, payload) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, payload))

    if split.prefill == 0:
        front = [_Worker("colocated", gpu=i) for i in range(split.decode)]
        back = front
    else:
        front = [_Worker("prefill", gpu=i) for i in range(split.prefill)]
        back = [_Worker("decode", gpu=0 if split.shared else split.prefill + i) for i in range(split.decode)]
    on_gpu: dict[int, list[_Worker]] = {}
    for w in {id(w): w for w in front + back}.values():
        on_gpu.setdefault(w.gpu, []).append(w)
    for r in requests:
        push(r.arrival, "arrive", r)

    def reshare(gpu: int, now: float, change) -> None:
        """Advance the GPU's running steps to `now` at the old share, apply `change`, reschedule their ends."""
        running = [w for w in on_gpu[gpu] if w.busy]
        for w in running:
            w.left_ms -= (now - w.since) * 1e3 / len(running)
            w.since = now
        change()
        running = [w for w in on_gpu[gpu] if w.busy]
        for w in running:
            w.version += 1
            push(now + max(0.0, w.left_ms) * len(running) / 1e3, "step", (w, w.version))

    def start(w: _Worker, now: float) -> None:
        if w.busy:
            return
        while w.role == "decode" and w.waiting and len(w.running) < split.max_batch:
            w.running.append(w.waiting.popleft())
        rows = list(w.running[:split.max_batch])
        chunks, ms = [], 0.0
        if rows:
            ms += profile.decode(len(rows), sum(r.prompt + r.generated for r in rows))
        if w.role == "prefill" and w.waiting:
            r = w.waiting[0]
            chunks.append((r, r.prompt))
            ms += profile.prefill(r.done_prefill, r.prompt)
        elif w.role == "colocated" and w.waiting and len(w.running) < split.max_batch:
            budget = split.chunk if split.chunk > 0 else w.waiting[0].prompt - w.waiting[0].done_prefill
            for r in w.waiting:
                if budget <= 0:
                    break
                end = min(r.prompt, r.done_prefill + budget)
                chunks.append((r, end))
                ms += profile.prefill(r.done_prefill, end)
                budget -= end - r.done_prefill
        if not rows and not chunks:
            return
        def begin():
            w.busy, w.step, w.left_ms, w.since = True, (rows, chunks), ms, now
        reshare(w.gpu, now, begin)

    def step_done(w: _Worker, now: float) -> None:
        rows, chunks = w.step

        def end():
            w.busy, w.step = False, ()
        reshare(w.gpu, now, end)
        for r in rows:
            r.generated += 1
            if r.generated >= r.output:
                r.finish = now
                w.running.remove(r)
        for r, end in chunks:
            r.done_prefill = end
            if end < r.prompt:
                continue
            w.waiting.remove(r)
            r.generated = 1  # the prefill samples the first token
            if w.role == "colocated":
                r.first_token = now
                if r.output <= 1:
                    r.finish = now
                else:
                    w.running.append(r)
            else:
                ms = split.transfer_fixed_ms + profile.kv_bytes_per_token * r.prompt / (split.link_gbps * 1e9) * 1e3
                push(now + ms / 1e3, "kv", r)
        start(w, now)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            w = min(front, key=_Worker.load)
            w.waiting.append(payload)
            start(w, now)
        elif kind == "step":
            w, version = payload
            if version == w.version:
                step_done(w, now)
        else:  # "kv": the first token with it; the decode worker takes it at its next step
            r = payload
            r.first_token = now
            if r.output <= 1:
                r.finish = now
                continue
            w = min(back, key=_Worker.load)
            w.waiting.append(r)
            start(w, now)
    return requests
