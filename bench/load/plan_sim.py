"""The planner's model of a deployment: a worker's measured profile and a discrete-event simulation of
requests through colocated workers or a prefill pool and a decode pool.

    Profile.from_engine_json(data)   a forward's fixed cost, the prompt tokens' cost by position and the
                                     decode step time by batch x context, from `pdserve-bench engine`'s JSON
    Split(prefill, decode, ...)      a deployment: colocated (prefill 0) with N workers, or xP:yD
    simulate(split, profile, requests)   each request's first-token and finish time, and its longest gap
                                         between two tokens (an ITL SLO judges a request by that)

The model, stated so it can be checked against a measured run:
  - every forward pays a fixed cost (fixed_ms: the weights read once, the layers launched), whatever its
    tokens; from an engine JSON it is the decode fit's alpha (Profile.from_engine_json says why);
  - prompt tokens [a, b) of a prompt cost tokens(a, b) = T(b) - T(a) beyond it, T the measured prefill
    times less the fixed cost (linear between the measured points, through 0, the last segment's slope
    beyond): the measured curve's shape, attention growing with the context, is kept;
  - a decode step of batch B over contexts c_i costs alpha + beta B + gamma sum(c_i), a least-squares fit
    of the measured batch x context grid (weights read once a step, per-row work, KV read);
  - a colocated chunked step runs the decodes and a chunk of waiting prompts, a token at position p
    counting 1 + p / chunk_attention_tokens against the chunk budget (the scheduler's rule); it costs the
    decode step plus the chunk's tokens (the decode step already reads the weights: the fixed cost is not
    paid twice), or the fixed cost plus the chunk's tokens when nothing decodes, plus chunk_step_ms: what
    the engine's chunked steps measured beyond their decodes and tokens (Profile.from_engine_json). Many
    small chunks thus cost a step each;
  - a forward of whole prompts (a prefill worker's, an unchunked colocated worker's) takes the waiting
    prompts in arrival order while their tokens fit max_batched_tokens, at most max_num_seqs of them,
    the first whatever its length (workers/roles/prefill.py, the scheduler's unchunked step); it costs the
    fixed cost once plus every prompt's tokens, and all of them have their first token at its end. An
    unchunked colocated worker never runs it beside its decodes: after it, if anything runs, a decode step;
  - a prefill worker's KV moves in kv_bytes / link bandwidth (plus a fixed cost) after its forward, the
    first token arrives with it; the decode worker adopts the request at its next step;
  - a new request goes to the worker with the least queued work (prompt tokens waiting, or rows running);
  - a worker holds at most max_batch decoding rows; more wait;
  - shared (1P:1D on one GPU): while both workers run a step each advances at its own measured pace, not
    an even half: a decode step takes shared_decode_slowdown (2.0) times its time alone, a prefill forward
    shared_prefill_slowdown (1.65) times, and a forward that overlaps decoding pays shared_prefill_extra_ms
    (9.1 ms) more once; each pays the fixed cost of its own forwards. Measured on the H200 by
    bench/load/plan_shared.py from the 1P:1D runs in bench/results/load-h200-2026-12-01/results.json.gz (87151ad,
    one prompt a forward, decode batches 1-11; rates 4, 8, 16 and 8 req/s, the cold first run at 2 left out)
    against engine-nvidia-h200-2026-12-01-4acfb30.json: 4912 gaps between tokens inside a forward took 1.99x
    the profile's decode step (outside every forward 1.00x); 73 forwards with a request decoding throughout
    took 18.4 ms + 1.65x their tokens' cost (median error 3%; an even half, 2x the forward, is 14-23% slow
    on each of the 19 long prompts, 8k-16k tokens, that fill the prefill worker), forwards alone 0.97x.
    The paces sum past 1 (1/1.99 + 1/1.65): a decode step's host work leaves the GPU to the prefill. Not
    measured: decode batches past 11, batched forwards (the extra is taken per forward), another GPU.
Torch-free.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.settings.worker import EngineConfig


@dataclass
class Profile:
    prefill_tokens: list[int]
    prefill_ms: list[float]  # measured: a forward of one whole prompt of that many tokens
    decode_coef: tuple[float, float, float]  # alpha ms, beta ms per row, gamma ms per context token
    kv_bytes_per_token: int = 0
    source: str = ""
    fixed_ms: float = 0.0  # what every forward pays whatever its tokens (0: all of a prefill is in its tokens)
    chunk_step_ms: float = 0.0  # what a chunked step with prompt tokens pays beyond its decodes and those tokens
    # the engine overlaps its steps on this device (CUDA: workers/engine/overlap.py): a colocated or decode
    # worker decides step N+1's rows when step N begins, so a request that arrives during step N joins N+2
    overlap: bool = False

    def tokens(self, start: int, end: int) -> float:
        """Milliseconds prompt tokens [start, end) add to a forward, beyond its fixed cost."""
        return self._cumulative(end) - self._cumulative(start)

    def prefill(self, start: int, end: int) -> float:
        """Milliseconds of a forward of prompt tokens [start, end) alone: the fixed cost and the tokens'."""
        return self.fixed_ms + self.tokens(start, end)

    def _cumulative(self, n: int) -> float:
        xs, ys = [0, *self.prefill_tokens], [0.0, *(m - self.fixed_ms for m in self.prefill_ms)]
        if n <= xs[-1]:
            return float(np.interp(n, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (n - xs[-1])

    def decode(self, batch: int, context_sum: int) -> float:
        a, b, g = self.decode_coef
        return max(0.0, a + b * batch + g * context_sum)

    def step_ms(self, rows: int, context_sum: int, chunks: list[tuple[int, int]], chunked: bool = False) -> float:
        """A forward of `rows` decode rows over `context_sum` keys and prompt positions [start, end) of each
        chunk: the decode step (its fixed cost included) or, with no rows, the fixed cost alone, plus the
        chunks' tokens, plus chunk_step_ms for a colocated chunked step with prompt tokens (`chunked`). The
        one rule the simulation and the served steps' comparison (bench/load/trace.py) both price by."""
        ms = self.decode(rows, context_sum) if rows else self.fixed_ms
        ms += sum(self.tokens(a, b) for a, b in chunks)
        return ms + (self.chunk_step_ms if chunks and chunked else 0.0)

    @classmethod
    def from_points(cls, prefill: dict[int, float], decode: list[tuple[int, int, float]], kv_bytes_per_token: int = 0,
                    source: str = "", fixed_ms: float | None = 0.0) -> "Profile":
        """prefill {tokens: ms}; decode [(batch, context, ms)] (each row at that context). fixed_ms: a forward's
        fixed cost; None: the decode fit's alpha (from_engine_json says why), at most the shortest prefill's."""
        if not prefill or not decode:
            raise ValueError("a profile needs prefill points and decode points")
        tokens = sorted(prefill)
        # a noisy measurement can make a longer prompt look cheaper: the cumulative cost never falls, so no
        # segment of a prompt costs less than nothing
        ms = np.maximum.accumulate([float(prefill[t]) for t in tokens])
        rows = np.array([[1.0, b, b * c] for b, c, _ in decode])
        coef, *_ = np.linalg.lstsq(rows, np.array([t for _, _, t in decode]), rcond=None)
        fixed = float(coef[0]) if fixed_ms is None else fixed_ms
        fixed = min(max(0.0, fixed), float(ms[0]))  # no prompt's tokens cost less than nothing
        return cls(tokens, [float(m) for m in ms], tuple(float(c) for c in coef), kv_bytes_per_token, source, fixed)

    @classmethod
    def from_engine_json(cls, data: dict, source: str = "") -> "Profile":
        """`pdserve-bench engine` JSON: prefill [{tokens, ours_ms: {median}}], decode [{kind: uniform, batch,
        context, ours_ms: {median}}], config.kv_bytes_per_token, and chunked.on when it ran.

        The fixed cost of a forward is the decode fit's alpha: a decode step's cost at no rows, the weights read
        once and every layer launched, which a forward of prompts pays too on the same GPU. The prefill points
        agree without pinning it: on the H200 (engine-nvidia-h200-2026-12-01-4acfb30.json) a quadratic through
        their four lengths, 1k-32k, crosses 0 tokens at 2-3 ms against alpha's 5.6, and with alpha taken out
        the tokens' cost per token grows with the prompt from the first segment on (attention), as it must.

        A chunked step with prompt tokens beside decodes costs more than its decode step and those tokens:
        in the chunked scenario (decodes running while a long prompt is prefilled in chunks, the engine's own
        step loop) the prompt's steps took (ttft - steps x the steady decode gap - the prompt's tokens) /
        steps more each: 9 ms on that H200 profile, where the mixed-step point, a bare forward without the
        step's bookkeeping, shows about 1. chunk_step_ms is that, 0 where the JSON has no chunked scenario."""
        try:
            prefill = {int(p["tokens"]): float(p["ours_ms"]["median"]) for p in data["prefill"]}
            decode = [(int(d["batch"]), int(d["context"]), float(d["ours_ms"]["median"])) for d in data["decode"]
                      if d.get("kind", "uniform") == "uniform"]
            kv = int((data.get("config") or {}).get("kv_bytes_per_token") or 0)
            profile = cls.from_points(prefill, decode, kv, source, fixed_ms=None)
            devices = (data.get("provenance") or {}).get("devices") or []
            profile.overlap = any(str(d).startswith("cuda") for d in devices)
            on = (data.get("chunked") or {}).get("on")
            if on and on.get("prefill_steps"):
                steps = int(on["prefill_steps"])
                rest = float(on["ttft_ms"]) - steps * float(on["steady_gap_ms"]["median"]) \
                    - profile.tokens(0, int(on["prompt"]))
                profile.chunk_step_ms = max(0.0, rest / steps)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an engine profile (pdserve-bench engine JSON): missing or bad {e}") from e
        return profile

    def to_dict(self) -> dict:
        return {"source": self.source, "prefill_points": dict(zip(self.prefill_tokens, self.prefill_ms)),
                "fixed_ms_per_forward": self.fixed_ms, "chunk_step_ms": self.chunk_step_ms, "overlap": self.overlap,
                "decode_fit_ms": dict(zip(("alpha", "beta_per_row", "gamma_per_context_token"), self.decode_coef)),
                "kv_bytes_per_token": self.kv_bytes_per_token}


@dataclass(frozen=True)
class Split:
    """prefill == 0: `decode` colocated workers; else a prefill pool and a decode pool."""
    prefill: int
    decode: int
    chunk: int = 512  # colocated: prompt tokens per step (0: unchunked, whole prompts in steps of their own)
    # a prompt token at position p counts 1 + p / chunk_attention_tokens against `chunk` (the scheduler's rule)
    chunk_attention_tokens: int = EngineConfig.chunk_attention_tokens
    max_batch: int = EngineConfig.max_num_seqs  # decoding rows a worker holds: its --max-num-seqs
    link_gbps: float = 100.0  # GB/s between a prefill and a decode worker
    transfer_fixed_ms: float = 0.5
    shared: bool = False  # 1P:1D on one GPU: the two workers time-slice it
    # shared, while both run a step: a decode step's time over its time alone, a prefill forward's, and what a
    # forward that overlaps decoding pays once more (ms, at the shared pace); the model's list says their source
    shared_decode_slowdown: float = 2.0
    shared_prefill_slowdown: float = 1.65
    shared_prefill_extra_ms: float = 9.1
    # a forward of whole prompts (a prefill worker's, an unchunked colocated one's): prompt tokens at most (the
    # first prompt whatever its length; 1: one prompt a forward) and prompts at most; the worker's defaults
    max_batched_tokens: int = EngineConfig.max_batched_tokens
    max_num_seqs: int = EngineConfig.max_num_seqs

    def __post_init__(self):
        if self.decode < 1 or self.prefill < 0 or (self.shared and (self.prefill, self.decode) != (1, 1)):
            raise ValueError(f"a split needs >= 1 decode (or colocated) worker; shared is 1P:1D only: {self}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"max_batched_tokens and max_num_seqs must be >= 1: {self}")
        if min(self.shared_decode_slowdown, self.shared_prefill_slowdown) < 1 or self.shared_prefill_extra_ms < 0:
            raise ValueError(f"a shared GPU slows each side by a factor >= 1 and adds >= 0 ms: {self}")

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
    last_token: float | None = None  # when its latest token came
    max_gap_s: float = 0.0  # its longest wait between two tokens (the load bench's ITL SLO judges that)


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
    prefilled_last: bool = False  # unchunked colocated: the last step was whole prompts (the next decodes)
    began: float = 0.0  # when its current (or last) step began
    overlapped: bool = False  # shared: the step in flight has run beside the other worker's (paid the extra)
    queued: int = 0  # prompt tokens still to prefill over `waiting` (not decode): kept as they change, since
                     # summing them at every arrival made an overloaded probe quadratic in its requests

    def load(self) -> int:
        if self.role == "decode":
            return len(self.running) + len(self.waiting)
        return self.queued + len(self.running)

    def enqueue(self, r: "Req") -> None:
        self.waiting.append(r)
        if self.role != "decode":
            self.queued += r.prompt - r.done_prefill


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

    def pace(w: _Worker, running: list) -> float:
        """The share of its pace alone a running step advances at: 1 alone on its GPU, else its side's."""
        if len(running) < 2:
            return 1.0
        return 1.0 / (split.shared_decode_slowdown if w.role == "decode" else split.shared_prefill_slowdown)

    def reshare(gpu: int, now: float, change) -> None:
        """Advance the GPU's running steps to `now` at the old paces, apply `change`, reschedule their ends."""
        running = [w for w in on_gpu[gpu] if w.busy]
        for w in running:
            w.left_ms -= (now - w.since) * 1e3 * pace(w, running)
            w.since = now
        change()
        running = [w for w in on_gpu[gpu] if w.busy]
        for w in running:
            if len(running) > 1 and w.role == "prefill" and not w.overlapped:
                w.overlapped = True  # the extra, in work at the shared pace: shared_prefill_extra_ms of time
                w.left_ms += split.shared_prefill_extra_ms * pace(w, running)
            w.version += 1
            push(now + max(0.0, w.left_ms) / pace(w, running) / 1e3, "step", (w, w.version))

    def whole_prompts(w: _Worker, room: int, cutoff: float) -> list:
        """A forward of whole prompts: the waiting ones that arrived by `cutoff`, in arrival order, while their
        tokens fit max_batched_tokens, at most `room` of them, the first whatever its length."""
        batch, tokens = [], 0
        for r in w.waiting:
            if r.arrival > cutoff:
                break
            n = r.prompt - r.done_prefill
            if batch and (tokens + n > split.max_batched_tokens or len(batch) >= room):
                break
            batch.append((r, r.prompt))
            tokens += n
        return batch

    def weight(position: int) -> float:
        return 1.0 + position / split.chunk_attention_tokens if split.chunk_attention_tokens else 1.0

    def chunk_of(w: _Worker, cutoff: float) -> list:
        """A colocated chunked step's prompt tokens: the waiting prompts in order (a new one once it arrived by
        `cutoff`), each token at position p counting weight(p) against `chunk` (workers/engine/scheduler.py)."""
        chunks, budget = [], float(split.chunk)
        for r in w.waiting:
            if not r.done_prefill and r.arrival > cutoff:
                break
            n = min(r.prompt - r.done_prefill, round(budget / weight(r.done_prefill))) if budget >= 0.5 else 0
            if n <= 0:
                break
            chunks.append((r, r.done_prefill + n))
            budget -= n * weight(r.done_prefill)
        return chunks

    def start(w: _Worker, now: float, after_step: bool = False) -> None:
        """Begin the worker's next step at `now`, if it has one. With overlap (Profile.overlap) a colocated or
        decode worker that just ended a step decided this one when that step began (w.began): what arrived
        since joins the step after, unless this one would be empty (the engine then schedules it at once)."""
        if w.busy:
            return
        if after_step and profile.overlap and w.role != "prefill" and w.began < now:
            if begin_step(w, now, w.began):
                return
        begin_step(w, now, now)

    def begin_step(w: _Worker, now: float, cutoff: float) -> bool:
        """The step of what arrived by `cutoff`; False: nothing to run."""
        while w.role == "decode" and w.waiting and len(w.running) < split.max_batch \
                and w.waiting[0].first_token <= cutoff:
            w.running.append(w.waiting.popleft())
        rows = list(w.running[:split.max_batch])
        chunks: list = []
        if w.role == "prefill" and w.waiting:
            chunks = whole_prompts(w, split.max_num_seqs, cutoff)
        elif w.role == "colocated" and w.waiting and len(w.running) < split.max_batch:
            if split.chunk > 0:
                chunks = chunk_of(w, cutoff)
            elif not (w.prefilled_last and rows):  # unchunked: whole prompts in a step of their own
                chunks = whole_prompts(w, min(split.max_num_seqs, split.max_batch - len(w.running)), cutoff)
                rows = [] if chunks else rows
        if not rows and not chunks:
            return False
        w.prefilled_last = not rows
        # the decode step pays the forward's fixed cost; a forward of prompts alone pays it itself
        ms = profile.step_ms(len(rows), sum(r.prompt + r.generated for r in rows),
                             [(r.done_prefill, end) for r, end in chunks], w.role == "colocated" and split.chunk > 0)

        def begin():
            w.busy, w.step, w.left_ms, w.since, w.overlapped, w.began = True, (rows, chunks), ms, now, False, now
        reshare(w.gpu, now, begin)
        return True

    def step_done(w: _Worker, now: float) -> None:
        rows, chunks = w.step

        def end():
            w.busy, w.step = False, ()
        reshare(w.gpu, now, end)
        for r in rows:
            r.generated += 1
            r.max_gap_s = max(r.max_gap_s, now - r.last_token)
            r.last_token = now
            if r.generated >= r.output:
                r.finish = now
                w.running.remove(r)
        for r, end in chunks:
            w.queued -= end - r.done_prefill
            r.done_prefill = end
            if end < r.prompt:
                continue
            w.waiting.remove(r)
            r.generated = 1  # the prefill samples the first token
            if w.role == "colocated":
                r.first_token = r.last_token = now
                if r.output <= 1:
                    r.finish = now
                else:
                    w.running.append(r)
            else:
                ms = split.transfer_fixed_ms + profile.kv_bytes_per_token * r.prompt / (split.link_gbps * 1e9) * 1e3
                push(now + ms / 1e3, "kv", r)
        start(w, now, after_step=True)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            w = min(front, key=_Worker.load)
            w.enqueue(payload)
            start(w, now)
        elif kind == "step":
            w, version = payload
            if version == w.version:
                step_done(w, now)
        else:  # "kv": the first token with it; the decode worker takes it at its next step
            r = payload
            r.first_token = r.last_token = now
            if r.output <= 1:
                r.finish = now
                continue
            w = min(back, key=_Worker.load)
            w.enqueue(r)
            start(w, now)
    return requests
