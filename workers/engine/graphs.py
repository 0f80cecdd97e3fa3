"""CUDA graphs of the decode forward (DecodeGraphs) and of the piecewise forward of steps with prompt
tokens (MixedGraphs), both over the model cut at attention (layers.Cut) where it can be cut.

DecodeGraphs: one graph per (batch bucket, block-table bucket), captured the first time a step of
that shape comes (about two forwards' time), then replayed. Inputs go through static buffers: a step
builds its inputs (step_inputs.build, its block table straight into the buffer), copies its token
ids, positions, slots and lengths into them, replays, and reads the logits out. A capture's forwards
run in the runner's attention context over the buffers (runner.attend_decode); a replay runs no
Python attention. Rows beyond the real batch are padding: they read block 0 with length 1 and write
their K/V into the pool's scratch block, which no request owns.

What a decode graph captures (EngineConfig.decode_graph_forward):
    cut      the piecewise path's segments (the same Cut, its compiled code and buffers, MixedGraphs'
             too) at T = the batch bucket's rows, with paged decode attention between them over the
             bucket's table, lengths and max context (cut_forward); the last segment's head over the
             batch's rows into the Cut's logits. The graph reads its token ids and positions from its own
             buffer (an overlapped step's fed tokens land there), the rest from the Cut's. Batch 1 runs
             its segments over MIN_ROWS = 2 rows, attention over 1 (see MIN_ROWS). So a worker compiles
             the layers' code once, for both kinds of graph: the first decode graph compiles it and
             nothing else does (transformers' layers stay uncompiled: only the eager path runs them)
    layers   transformers' forward (runner.forward) with each decoder layer torch.compiled: a compile of
             its own beside the segments', and a second for batch 1 (dynamo specialises a size of 1);
             what a model that cannot be cut (layers.cuttable) always runs

Buckets: batch 1, 2, 4, 8, then multiples of 16 up to max_num_seqs; block tables in
powers of two from 16 blocks, up to the widest table a request can have: max_model_len's
blocks, or the pool's if it holds fewer (a request never holds more blocks than the pool has).
Attention reads only each request's own blocks (programs past a request's length return at
once), so a wider table costs almost nothing; its width only sizes the kernel's split of the
context, and a 32k-token context needs 8 table buckets. `capture(capture_order())` takes every
graph ahead of traffic (a decode or colocated worker does at start), so no request pays for a
capture; `capture_s` holds each graph's seconds (Engine.warmup reports them in the start's parts).
With EngineConfig.graphs "lazy" the start takes the first bucket only (the largest: it compiles what
every graph runs and sizes the shared memory pool); the worker takes the others one at a time while
it has no request (`capture_idle`, from its loop), and a step whose graph is not there yet captures
it first, as before. MixedGraphs' token buckets likewise: the largest at start, the rest while idle
(after the decode graphs), a step of a bucket not taken yet capturing it.
A capture costs one warm-up forward and the captured one, plus whatever that first forward
compiles: on the first graph, the dense code's torch.compile (dynamic sizes) and the paged-attention
kernels' Triton variants (with "layers", on the first graph of batch 1 the layers' code again).
No other bucket compiles anything: the split of the context (paged_kernel.decode_split), the batch
and the table width are run-time arguments of the kernels, which Triton does not specialise, so every
bucket and every mixed step runs the same variant (bench/engine/kernel_variants.py counts them on the
CPU); the positions sit at storage offset 0 of the input buffer, and the Cut's buffers hold a row more
than any step uses, because dynamo guards a storage offset and a view's base like sizes (duck sizing
would tie them to the first batch, and the next batch would recompile). tests/test_decode_cut.py
counts a start's compiles on the CPU.

Captures run in CUDA's thread-local capture mode (CAPTURE_MODE): a worker's other threads (the transports'
I/O threads, the KV tiers' copy threads) query and wait on their own events while the loop may capture a
graph (lazily, or a step's missing bucket), and in the default global mode such a call from another thread
fails the capture (PyTorch's own NCCL watchdog met that: pytorch/pytorch#104487, #148594). Thread-local mode
still refuses what this thread must not do while capturing.
"""

from __future__ import annotations

import time

import torch

from pdserve.workers.engine import attention, step_inputs
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.step_trace import host_wait

# A decode graph's segments run over this many rows at least: batch 1 runs them over 2 rows (the
# second padding) and its attention over 1. Dynamo specialises a size of 1, so segments over 1 row
# would compile the layers' code a second time; a GEMM over 2 rows reads the same weight bytes as a
# GEMV over 1, and attention (whose split of the context depends on the batch) still sees 1 row.
MIN_ROWS = 2
CAPTURE_MODE = "thread_local"  # see the module's docstring


def _buckets(limit: int, start: list[int], step_fn) -> list[int]:
    """start's sizes below limit, then step_fn's, the last one limit itself (a limit below start[0]: [limit])."""
    out = [b for b in start if b < limit]
    b = out[-1] if out else 0
    while b < limit:
        b = step_fn(b) if b else start[0]
        out.append(min(b, limit))
    return sorted(set(out))


def cut_forward(cut, t: int, segment) -> None:
    """The cut model's forward, in the step's attention context (attention.stepping): segment(i) runs
    segment i (directly, or a graph's replay), and between two segments attention runs over rows
    [0, t) of the Cut's q, k, v, straight into its attn buffer (the segments may run over more rows:
    padding)."""
    out = cut.attn[:t].view(t, cut.num_heads, cut.head_dim)
    segment(0)
    for i, layer in enumerate(cut.layers):
        attn = layer.self_attn
        q = cut.q[:t].transpose(0, 1).unsqueeze(0)  # [1, H, t, D], as transformers hands it over
        k = cut.k[:t].transpose(0, 1).unsqueeze(0)
        v = cut.v[:t].transpose(0, 1).unsqueeze(0)
        attention.paged_attention(attn, q, k, v, None, scaling=attn.scaling, out=out)
        segment(i + 1)


def decode_buckets(max_num_seqs: int, max_blocks_per_seq: int, pool_blocks: int) -> tuple[list[int], list[int]]:
    """(batch buckets, block-table buckets) of the decode graphs. pool_blocks: the blocks requests may
    hold; a request's table lists distinct blocks of the pool, so none is wider than that."""
    batches = _buckets(max_num_seqs, [1, 2, 4, 8], lambda b: b + 16 if b >= 16 else 16)
    return batches, _buckets(min(max_blocks_per_seq, pool_blocks), [16], lambda b: b * 2)


class IdleCaptures:
    """What both kinds of graphs share for EngineConfig.graphs "lazy": each kind has `pending()` (its buckets
    not captured yet, in capture order), `capture(buckets)` and `idle` (the buckets taken while idle)."""

    idle: set

    def pending(self) -> list:
        raise NotImplementedError

    def capture(self, buckets: list) -> float:
        raise NotImplementedError

    def capture_idle(self) -> float:
        """Capture the next pending bucket while no request is on the worker: a step that arrives meanwhile
        waits for one capture at most. Seconds spent (0: none left)."""
        pending = self.pending()
        if not pending:
            return 0.0
        self.idle.add(pending[0])
        return self.capture(pending[:1])


class DecodeGraphs(IdleCaptures):
    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int, cut=None):
        """cut: the model's layers.Cut (the piecewise path's), whose segments the graphs run; None: the
        layers forward (runner.forward)."""
        self.runner = runner
        self.cut = cut
        dev = runner.device
        # the pool's last block is the scratch block: requests hold the others
        self.batch_buckets, self.block_buckets = decode_buckets(max_num_seqs, max_blocks_per_seq,
                                                                runner.kv.layout.num_blocks - 1)
        nm = self.block_buckets[-1]
        nb = max(self.batch_buckets[-1], MIN_ROWS)  # rows of the vectors: a segment runs over MIN_ROWS at least
        # Every input of a step in one buffer, so a step makes one host-to-device copy from
        # pinned memory: positions, ids, K slots, V slots, lengths ([nb] each), block tables [nb, nm]
        cuda = dev.type == "cuda"  # (the buffers are made on the CPU too: tests run the forwards there)
        self.host = torch.zeros(5 * nb + nb * nm, dtype=torch.long, pin_memory=cuda)
        self.packed = torch.zeros_like(self.host, device=dev)
        self.copied = torch.cuda.Event() if cuda else None  # the last copy out of `host` is done: it may be rewritten
        self.pos, self.ids, self.k_slots, self.v_slots, self.lens, self.table = self._views(self.packed, nb, nm)
        self.host_arrays = {k: t.numpy() for k, t in zip(self.NAMES, self._views(self.host, nb, nm))}
        self.keep = torch.arange(nb, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_s: dict[tuple[int, int], float] = {}  # (batch, blocks) -> seconds its capture took
        self.idle: set[tuple[int, int]] = set()  # the buckets captured while the worker had no request
        self.mempool = None

    # The positions come first, at storage offset 0: the compiled layers take them (position_ids), and
    # dynamo guards a tensor's storage offset like a size. At offset nb, equal to the first bucket's
    # batch (the largest), duck sizing tied the two, and the next batch recompiled every layer's code.
    NAMES = ("pos", "ids", "k_slots", "v_slots", "lens", "table")

    @staticmethod
    def _views(buf: torch.Tensor, nb: int, nm: int) -> tuple[torch.Tensor, ...]:
        return (*buf[: 5 * nb].view(5, nb).unbind(0), buf[5 * nb:].view(nb, nm))

    @staticmethod
    def _bucket(n: int, buckets: list[int]) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} is beyond the largest graph bucket {buckets[-1]}")

    def decode(self, work: list[tuple[Request, int]], feed=None) -> torch.Tensor:
        """A step of decodes only ((request, 1) each) -> [len(work), vocab] logits."""
        n = len(work)
        key = (self._bucket(n, self.batch_buckets),
               self._bucket(max(len(r.block_ids) for r, _ in work), self.block_buckets))
        batch, blocks = key
        if self.copied is not None:
            host_wait(self.copied)  # the last step's copy out of `host` is done: rewrite it
        h = self.host_arrays
        self._stage(step_inputs.build(work, self.runner.block_size, table=h["table"][:, :blocks]), batch, blocks)
        nb, width = len(self.ids), self.table.shape[1]
        used = 5 * nb + batch * width  # the rows of the table this step reads
        self.packed[:used].copy_(self.host[:used], non_blocking=True)
        if self.copied is None:  # no CUDA (tests): the bucket's forward runs directly
            step_inputs.apply_feed(self.ids, feed)
            return self._forward(batch, blocks)[:n]
        self.copied.record()
        step_inputs.apply_feed(self.ids, feed)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(batch, blocks)
        graph.replay()
        return self.outputs[key][:n]

    def _stage(self, inp: step_inputs.StepInputs, batch: int, blocks: int) -> None:
        """`inp`'s rows into the host buffers (its table is there already), padded to `batch` rows
        (MIN_ROWS at least): padding rows read block 0 with length 1 and write their K/V into the
        scratch block (token 0 at position 0, where the segments run over more rows than attention)."""
        h, n, bs = self.host_arrays, len(inp.decodes), self.runner.block_size
        scratch_k = self.runner.scratch_block * 2 * bs
        rows = max(batch, MIN_ROWS)
        h["table"][n:batch, :blocks] = 0
        h["ids"][:n], h["ids"][n:rows] = inp.ids, 0
        h["pos"][:n], h["pos"][n:rows] = inp.positions, 0
        h["lens"][:n], h["lens"][n:rows] = inp.ctx_lens, 1
        h["k_slots"][:n], h["k_slots"][n:rows] = inp.k_slots, scratch_k
        h["v_slots"][:n], h["v_slots"][n:rows] = inp.v_slots, scratch_k + bs

    def capture_order(self) -> list[tuple[int, int]]:
        """Every (batch, blocks) bucket, widest table and largest batch first (the shared memory pool
        is sized by the first)."""
        return [(batch, blocks) for blocks in self.block_buckets[::-1] for batch in self.batch_buckets[::-1]]

    def pending(self) -> list[tuple[int, int]]:
        """The buckets not captured yet, in capture order."""
        return [key for key in self.capture_order() if key not in self.graphs]

    def capture(self, keys: list[tuple[int, int]]) -> float:
        """Capture the graphs of these (batch, blocks) buckets ahead of traffic, with padding rows only
        (they touch the scratch block alone); returns the seconds it took."""
        start = time.monotonic()
        scratch_k = self.runner.scratch_block * 2 * self.runner.block_size
        self.ids.zero_(), self.pos.zero_(), self.table.zero_(), self.lens.fill_(1)
        self.k_slots.fill_(scratch_k)
        self.v_slots.fill_(scratch_k + self.runner.block_size)
        for batch, blocks in keys:
            if (batch, blocks) not in self.graphs:
                self._capture(batch, blocks)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return time.monotonic() - start

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The forward a graph of this bucket captures -> [batch, vocab] float32 logits (a static buffer)."""
        r, cut = self.runner, self.cut
        with r.attend_decode(self.k_slots[:batch], self.v_slots[:batch], self.table[:batch, :blocks],
                             self.lens[:batch], blocks * r.block_size):
            if cut is None:
                return r.forward(self.ids[:batch], self.pos[:batch], self.keep[:batch])
            rows, inputs, keep = max(batch, MIN_ROWS), (self.ids, self.pos), self.keep[:batch]
            cut_forward(cut, batch, lambda i: cut.segment(i, rows, inputs=inputs, keep=keep))
            return cut.logits[:batch]

    def _capture(self, batch: int, blocks: int) -> torch.cuda.CUDAGraph:
        # One warm-up forward on a side stream: whatever is initialised lazily (the layers' compiled
        # code, a Triton kernel variant, cuBLAS's plan for a shape, an allocation) happens in it and
        # not in the graph; a second would find nothing left to initialise. It writes the same K/V
        # the replay will write (the scratch block), so it changes nothing.
        start = time.monotonic()
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(batch, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode=CAPTURE_MODE):
            out = self._forward(batch, blocks)
        self.mempool = graph.pool()
        self.graphs[(batch, blocks)] = graph
        self.outputs[(batch, blocks)] = out
        torch.cuda.synchronize(self.runner.device)
        self.capture_s[(batch, blocks)] = time.monotonic() - start
        return graph


class MixedGraphs(IdleCaptures):
    """Steps that carry prompt tokens (decodes and prompt chunks mixed, or prompt chunks alone), at
    most `max_tokens` tokens and `max_keep` kept rows: the model cut at attention (layers.Cut),
    each of its L + 1 dense segments captured once per token bucket and replayed, attention run
    eagerly between them over the step's real rows (it takes any mix of decodes, fresh chunks and
    chunks over a cached prefix, and calls the transfer's per-layer hook).

    A step of T tokens runs the segments of the smallest bucket >= T: rows [T, bucket) are padding
    (token 0 at position 0; attention neither reads nor writes them; their results are dropped).
    Buckets: 16, 32, 64, then multiples of 64 up to max_tokens. Without CUDA graphs (the CPU, or
    cuda_graphs off) the same segments run directly over the step's T rows, no padding: the same
    code path, tested on the CPU.

    Graphs are taken only for buckets up to `graph_tokens`: a longer step's segments run directly
    over its own rows (compiled where the layers are). Past about a thousand tokens a segment's
    matrix products take milliseconds and its launches tens of microseconds, so a graph saves
    little there, while capturing every bucket up to an 8k-token chunk budget (130 buckets of L + 1
    segments each) would hold a worker's start for tens of seconds.
    """

    def __init__(self, runner, max_tokens: int, max_keep: int, use_graphs: bool, compile: bool = False,
                 graph_tokens: int | None = None):
        from pdserve.workers.engine.layers import Cut

        self.runner = runner
        dev = runner.device
        self.buckets = _buckets(max_tokens, [16, 32, 64], lambda b: b + 64)
        self.max_tokens, self.max_keep = self.buckets[-1], max_keep
        self.cut = Cut(runner.model, self.max_tokens, max_keep, dev, compile=compile)
        self.use_graphs = use_graphs
        # the largest bucket replayed as graphs (steps above it run their segments directly)
        self.graph_limit = max((b for b in self.buckets if b <= (graph_tokens or self.max_tokens)),
                               default=self.buckets[0])
        n, k = self.max_tokens, max_keep
        # ids, positions [n], kept rows [k], K and V slots [n] in one buffer: one host-to-device copy a step
        self.host = torch.zeros(4 * n + k, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.packed = torch.zeros_like(self.host, device=dev)
        self.host_np = self.host.numpy()
        self.cut.ids, self.cut.pos = self.packed[:n], self.packed[n:2 * n]
        self.cut.keep = self.packed[2 * n:2 * n + k]
        self.k_slots, self.v_slots = self.packed[2 * n + k:3 * n + k], self.packed[3 * n + k:]
        self.copied = torch.cuda.Event() if use_graphs else None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_s: dict[int, float] = {}  # token bucket -> seconds its segments' capture took
        self.idle: set[int] = set()  # the buckets captured while the worker had no request
        self.mempool = None

    @property
    def graph_buckets(self) -> list[int]:
        """The token buckets replayed as graphs (none without CUDA graphs)."""
        return [b for b in self.buckets if b <= self.graph_limit] if self.use_graphs else []

    def fits(self, tokens: int, keep: int) -> bool:
        return tokens <= self.max_tokens and keep <= self.max_keep

    def graphed(self, tokens: int) -> bool:
        """A step of this many tokens replays graphs (else its segments run directly)."""
        return self.use_graphs and tokens <= self.graph_limit

    def slots(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V slots of a step of `tokens` rows: views of the buffer run() fills."""
        return self.k_slots[:tokens], self.v_slots[:tokens]

    def run(self, inp, feed=None) -> torch.Tensor:
        """The forward of a step, run in the runner's attention context over `slots` -> [K, vocab] logits."""
        t, kept = len(inp.ids), len(inp.keep)
        graphed = self.graphed(t)
        # graphs replay a bucket's rows; a step run directly (the CPU, or past the graph limit) takes its own
        # rows only (padding rows would multiply a decode step's matrix products on the CPU: 16 rows for one token)
        bucket = DecodeGraphs._bucket(t, self.buckets) if graphed else t
        n = self.max_tokens
        if self.copied is not None:
            host_wait(self.copied)  # the last step's copy out of `host` is done: rewrite it
        h = self.host_np
        h[:t], h[t:bucket] = inp.ids, 0
        h[n:n + t], h[n + t:n + bucket] = inp.positions, 0
        h[2 * n:2 * n + kept], h[2 * n + kept:2 * n + self.max_keep] = inp.keep, 0
        s = 2 * n + self.max_keep
        h[s:s + t], h[s + n:s + n + t] = inp.k_slots, inp.v_slots
        self.packed.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        step_inputs.apply_feed(self.cut.ids, feed)
        segments = self._segments(bucket, kept, graphed)
        cut_forward(self.cut, t, lambda i: segments[i]())
        return self.cut.logits[:kept].clone()  # the buffer is the next step's

    def _segments(self, bucket: int, kept: int, graphed: bool) -> list:
        if not graphed:  # the head over the kept rows only (a graph's is over max_keep rows)
            return [lambda i=i: self.cut.segment(i, bucket, kept) for i in range(self.cut.num_segments)]
        graphs = self.graphs.get(bucket)
        if graphs is None:
            graphs = self._capture(bucket)
        return [g.replay for g in graphs]

    def pending(self) -> list[int]:
        """The token buckets replayed as graphs and not captured yet, largest first."""
        return [b for b in self.graph_buckets[::-1] if b not in self.graphs]

    def capture(self, buckets: list[int] | None = None) -> float:
        """Capture the segments of these token buckets (default: every one up to the graph limit) ahead
        of traffic; seconds spent."""
        if not self.use_graphs:
            return 0.0
        start = time.monotonic()
        # Padding rows only, as at start: an idle capture follows served steps, whose inputs are still in the
        # buffer, and a kept row of a longer step lies past a smaller bucket's rows (the head's gather in the
        # capture's warm-up run indexed out of them: a device-side assert on CUDA). No step is in flight here
        # (ahead of traffic, or idle); a step whose graph is missing captures it with _capture, its inputs kept.
        # The zeroing is ordered after the last step's copy into the buffer on the same stream, as DecodeGraphs'
        # reset is: the host buffer is not touched, so no wait for that copy.
        self.packed.zero_()
        # largest first: the shared pool is sized once
        for b in (buckets or self.graph_buckets)[::-1]:
            if b not in self.graphs:
                self._capture(b)
        torch.cuda.synchronize(self.runner.device)
        return time.monotonic() - start

    def warm(self, bucket: int) -> None:
        """Every segment of this token bucket once, as its capture runs them before taking the graphs
        (whatever they compile, they compile here)."""
        for i in range(self.cut.num_segments):
            self.cut.segment(i, bucket)

    def _capture(self, bucket: int) -> list[torch.cuda.CUDAGraph]:
        start = time.monotonic()
        cut = self.cut
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation must not land in a graph
            self.warm(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for i in range(cut.num_segments):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.mempool, capture_error_mode=CAPTURE_MODE):
                cut.segment(i, bucket)
            self.mempool = g.pool()
            graphs.append(g)
        self.graphs[bucket] = graphs
        torch.cuda.synchronize(self.runner.device)
        self.capture_s[bucket] = time.monotonic() - start
        return graphs


def capture_at_start(runner, start, decode: bool, when: str) -> tuple[float, list[IdleCaptures]]:
    """A worker's graphs ahead of traffic, largest first so each kind's shared memory pool is sized once: the
    decode graph of every (batch, block table) bucket where `decode`, then the piecewise graphs of every token
    bucket; with `when` "lazy" (EngineConfig.graphs) the largest of each kind alone, the others left for idle
    time. Each kind's count and seconds are recorded in `start` (start_times.StartTimes).
    -> (seconds spent, the kinds with buckets left for idle time, decode graphs first)."""
    graphs, mixed = runner.graphs, runner.mixed
    lazy = when == "lazy"
    spent = 0.0
    if graphs is not None and decode:
        keys = graphs.capture_order()
        spent += graphs.capture(keys[:1] if lazy else keys)
        start.decode_graphs, start.decode_graphs_s = len(graphs.capture_s), sum(graphs.capture_s.values(), 0.0)
        start.decode_graphs_left = len(graphs.pending())
    if mixed is not None:
        buckets = mixed.pending()
        spent += mixed.capture(buckets[:1] if lazy and buckets else None)
        start.piecewise_graphs = len(mixed.capture_s) * mixed.cut.num_segments
        start.piecewise_graphs_s = sum(mixed.capture_s.values(), 0.0)
        start.piecewise_buckets_left = len(mixed.pending())
    kinds = [graphs] if graphs is not None and decode else []
    return spent, [g for g in kinds + [mixed] if g is not None and g.pending()] if lazy else []
