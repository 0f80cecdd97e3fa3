"""CUDA graphs of the decode forward.

One graph per (batch bucket, block-table bucket), captured the first time a step of that
shape comes (about three forwards' time), then replayed. Inputs go through static
buffers: a step copies its token ids, positions, slots, block tables and lengths into
them, replays, and reads the logits out. Rows beyond the real batch are padding: they
read block 0 with length 1 and write their K/V into the pool's scratch block, which no
request owns.

Buckets: batch 1, 2, 4, 8, then multiples of 16 up to max_num_seqs; block tables in
powers of two from 16 blocks. Attention reads only each request's own blocks (programs
past a request's length return at once), so a wider table costs almost nothing; its width
only sizes the kernel's split of the context, and a 32k-token context needs 8 table
buckets. `capture(batches, blocks)` takes graphs ahead of traffic (a decode or colocated
worker takes all of them at start), so no request pays for a capture.
"""

from __future__ import annotations

import time

import torch

from workers.engine import attention
from workers.engine.request import Request


def _buckets(limit: int, start: list[int], step_fn) -> list[int]:
    out = [b for b in start if b < limit]
    b = out[-1] if out else 0
    while b < limit:
        b = step_fn(b)
        out.append(min(b, limit))
    return sorted(set(out))


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int):
        self.runner = runner
        dev = runner.device
        self.batch_buckets = _buckets(max_num_seqs, [1, 2, 4, 8], lambda b: b + 16 if b >= 16 else 16)
        self.block_buckets = _buckets(max_blocks_per_seq, [16], lambda b: b * 2)
        nb, nm = self.batch_buckets[-1], self.block_buckets[-1]
        # Every input of a step in one buffer, so a step makes one host-to-device copy from
        # pinned memory: ids, positions, K slots, V slots, lengths ([nb] each), block tables [nb, nm]
        self.host = torch.zeros(5 * nb + nb * nm, dtype=torch.long, pin_memory=True)
        self.packed = torch.zeros_like(self.host, device=dev)
        self.copied = torch.cuda.Event()  # the last copy out of `host` is done: it may be rewritten
        self.ids, self.pos, self.k_slots, self.v_slots, self.lens, self.table = self._views(self.packed, nb, nm)
        self.host_views = self._views(self.host, nb, nm)
        self.keep = torch.arange(nb, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.mempool = None

    @staticmethod
    def _views(buf: torch.Tensor, nb: int, nm: int) -> tuple[torch.Tensor, ...]:
        return (*buf[: 5 * nb].view(5, nb).unbind(0), buf[5 * nb:].view(nb, nm))

    @staticmethod
    def _bucket(n: int, buckets: list[int]) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} is beyond the largest graph bucket {buckets[-1]}")

    def decode(self, reqs: list[Request]) -> torch.Tensor:
        n = len(reqs)
        key = (self._bucket(n, self.batch_buckets), self._bucket(max(len(r.block_ids) for r in reqs), self.block_buckets))
        batch, blocks = key
        inp = self.runner.decode_inputs(reqs, batch, blocks)
        ids, pos, k_slots, v_slots, lens, table = self.host_views
        self.copied.synchronize()
        ids[:batch], pos[:batch], lens[:batch] = inp["ids"], inp["pos"], inp["lens"]
        k_slots[:batch], v_slots[:batch] = inp["k_slots"], inp["v_slots"]
        table[:batch, :blocks] = inp["table"]
        used = 5 * len(ids) + batch * table.shape[1]  # the rows of the table this step reads
        self.packed[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(batch, blocks)
        graph.replay()
        return self.outputs[key][:n]

    def capture(self, batches: list[int], blocks: int) -> float:
        """Capture graphs ahead of traffic with padding rows only (they touch the scratch
        block alone); returns the seconds it took."""
        start = time.monotonic()
        scratch_k = self.runner.scratch_block * 2 * self.runner.block_size
        self.ids.zero_(), self.pos.zero_(), self.table.zero_(), self.lens.fill_(1)
        self.k_slots.fill_(scratch_k)
        self.v_slots.fill_(scratch_k + self.runner.block_size)
        for batch in batches:
            if (batch, blocks) not in self.graphs:
                self._capture(batch, blocks)
        torch.cuda.synchronize(self.runner.device)
        return time.monotonic() - start

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        r = self.runner
        attention.STEP.set_decode(self.k_slots[:batch], self.v_slots[:batch], self.table[:batch, :blocks], self.lens[:batch],
                                  blocks * r.block_size)
        return r.forward(self.ids[:batch], self.pos[:batch], self.keep[:batch])

    def _capture(self, batch: int, blocks: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy initialisation must not land in the graph); these
        # forwards write the same K/V the replay will write, so they change nothing.
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(batch, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(batch, blocks)
        self.mempool = graph.pool()
        self.graphs[(batch, blocks)] = graph
        self.outputs[(batch, blocks)] = out
        return graph
