"""Continuous batching: which requests run in the next step.

Queues: `waiting` (admitted by add(), no KV yet, or preempted) and `running` (KV in the
pool, one token per decode step). A step is either a prefill of some waiting requests
or a decode of all running ones, never both in one forward; in a colocated worker the
two share the GPU step by step, and that interference is what the comparison measures.

- A waiting request is admitted only when the pool has blocks for all its tokens, and
  while the step's token budget and the sequence cap allow; the first one is admitted
  even past the token budget (a prompt longer than the budget runs alone), so nothing
  waits forever. A full pool makes requests wait, never fail.
- After a prefill step, if anything is running, the next step decodes: a stream of
  arrivals cannot starve running requests.
- A decode step that needs a new block when none is free preempts the newest running
  request: its blocks go back and it returns to the front of `waiting`, to be prefilled
  again from its prompt and the tokens it already made.
"""

from __future__ import annotations

from collections import deque

from workers.engine.block_pool import BlockPool, blocks_for
from workers.engine.request import Request, Status


class Scheduler:
    def __init__(self, blocks: BlockPool, block_size: int, max_num_seqs: int, max_batched_tokens: int):
        self.blocks = blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_was_prefill = False

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def adopt(self, req: Request) -> None:
        """A request whose KV is already in req.block_ids joins the running batch."""
        req.status = Status.RUNNING
        self.running.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Request], bool]:
        """(requests, is_prefill) for the next step; ([], False) when idle."""
        if self.waiting and not (self._last_was_prefill and self.running):
            batch = self._admit()
            if batch:
                self._last_was_prefill = True
                return batch, True
        self._last_was_prefill = False
        return self._grow_running(), False

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens
            if batch and tokens + n > self.max_batched_tokens:
                break
            need = blocks_for(n, self.block_size)
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            req.block_ids = self.blocks.allocate(need)
            req.num_computed = 0
            req.status = Status.RUNNING
            batch.append(req)
            tokens += n
        self.running.extend(batch)
        return batch

    def _grow_running(self) -> list[Request]:
        """Make sure every running request has a slot for the token it writes this step."""
        for req in list(self.running):
            if req not in self.running:  # preempted below while serving an earlier one
                continue
            # this step writes position num_tokens - 1
            while len(req.block_ids) * self.block_size < req.num_tokens:
                if self.blocks.num_free == 0:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                    continue
                req.block_ids.append(self.blocks.allocate_after(req.block_ids[-1]))
        return list(self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FINISHED
        req.finish_reason = reason
