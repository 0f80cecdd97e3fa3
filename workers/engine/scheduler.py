"""Continuous batching: what each request computes in the next step.

Queues: `waiting` (added by the engine, no KV yet: WAITING, or PREEMPTED at the front) and
`running` (blocks in the pool for every position it has: PREFILLING, then RUNNING once the
engine appends its first token). The queues only order requests; their state is the Request's
own status, which the scheduler moves along its ladder (request.py) when it admits or preempts.
A step is a list of (request, n): compute n positions of that request from its num_computed on
(see runner.py).

Chunked prefill (the default, as vLLM and SGLang run): every step carries each running
request's next token (its decode) plus prompt tokens up to `chunk_tokens` in all: the
rest of a prompt that is part way through, then newly admitted ones. A prompt token at
position p counts 1 + p / attention_tokens against that budget (a chunk deep in a long prompt
attends over more keys), so steps cost about the same from a prompt's start to its end. A 16k prompt is thus
prefilled over many steps while the running requests keep getting a token each step; the
cost of that interference is what the colocated comparison measures.

Unchunked (`chunked=False`): a step is either a prefill of whole prompts (up to
`max_batched_tokens`, the first one admitted even past it) or a decode of all running
requests, never both; after a prefill step, if anything is running, the next step decodes.

Both:
- A waiting request is admitted only when the pool has blocks for all its tokens and the
  sequence cap allows. A full pool makes requests wait, never fail.
- Admission takes a prompt's blocks through `prompts` (prompt_blocks.py, the one place a
  prompt's blocks are taken): the longest prefix of its full blocks that the prefix cache
  holds is shared, not computed, and its prefill starts after them (at least its last token
  is computed, for the logits of its next token); blocks the KV tiers hold may be reloaded.
- A decode that needs a new block when none is free preempts the newest running request:
  its blocks go back and it returns to the front of `waiting` (PREEMPTED), to be prefilled
  again from its prompt and the tokens it already made.
- Finishing is the engine's (it frees the blocks wherever the request is); remove() takes a
  request out of the queues.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pdserve.workers.engine.prompt_blocks import PromptBlocks
from pdserve.workers.engine.request import IllegalTransition, Request, Status

if TYPE_CHECKING:
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.tiering import Tiers


class Scheduler:
    def __init__(self, prompts: PromptBlocks, config: EngineConfig):
        self.prompts = prompts  # a prompt's blocks, taken at admission
        self.blocks = prompts.blocks
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_batched_tokens = config.max_batched_tokens
        self.chunked = config.chunked_prefill
        self.chunk_tokens = config.step_chunk_tokens
        self.attention_tokens = config.chunk_attention_tokens  # see _weight; 0: every prompt token counts 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_was_prefill = False

    def add(self, req: Request) -> None:
        if req.status is not Status.WAITING:
            raise IllegalTransition(f"request {req.request_id}: only a waiting request can be scheduled, "
                                    f"this one is {req.status.value}")
        self.waiting.append(req)

    def adopt(self, req: Request) -> None:
        """A RUNNING request whose KV is already in req.block_ids joins the running batch."""
        if req.status is not Status.RUNNING:
            raise IllegalTransition(f"request {req.request_id}: only a running request joins the batch, "
                                    f"this one is {req.status.value}")
        self.running.append(req)

    @property
    def tiers(self) -> Tiers | None:
        """The KV tiers below the pool (None: none); prompt_blocks' to own."""
        return self.prompts.tiers

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, positions to compute) for the next step; [] when idle."""
        if self.tiers is not None:
            for r in self.running:
                self.tiers.poll(r)
        if self.chunked:
            return self._schedule_chunked()
        # a reloaded prefix landed: the rest of that prompt is prefilled like a new one
        ready = [(r, r.num_tokens - r.num_computed) for r in self.running
                 if r.num_tokens - r.num_computed > 1 and not self._loading(r)]
        if (self.waiting or ready) and not (self._last_was_prefill and self.running):
            batch = ready + self._admit(self.max_batched_tokens - sum(n for _, n in ready), whole=True)
            if batch:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        return [(r, 1) for r in self.grow_running()
                if r.num_tokens - r.num_computed == 1 and not full(r) and not self._loading(r)]

    def _loading(self, req: Request) -> bool:
        return self.tiers is not None and self.tiers.loading(req)

    def _schedule_chunked(self) -> list[tuple[Request, int]]:
        running = [r for r in self.grow_running() if not self._loading(r)]
        work = [(r, 1) for r in running if r.num_tokens - r.num_computed == 1 and not full(r)]
        budget = float(self.chunk_tokens)
        for r in running:
            left = r.num_tokens - r.num_computed
            if left > 1 and budget >= 0.5:
                n = self._chunk(r.num_computed, left, budget)
                if n:
                    work.append((r, n))
                    budget -= n * self._weight(r.num_computed)
        if budget >= 0.5:
            work += self._admit(budget, whole=False)
        return work

    def _weight(self, position: int) -> float:
        """What one prompt token from `position` on counts for in the chunk budget: attending over
        the prefix makes a chunk late in a long prompt cost more than the same tokens early on."""
        return 1.0 + position / self.attention_tokens if self.attention_tokens else 1.0

    def _chunk(self, position: int, left: int, budget: float) -> int:
        return min(left, round(budget / self._weight(position)))

    def _admit(self, budget: float, whole: bool) -> list[tuple[Request, int]]:
        """Admit waiting requests into `running`; whole: their whole prompts (the first even past
        the budget), else the first `budget` tokens of each, in order, until it is spent."""
        batch: list[tuple[Request, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens
            claim = self.prompts.plan(req)
            cached = claim.blocks * self.block_size
            if whole and batch and n - cached > budget:
                break
            if not whole and not claim.lower and self._chunk(cached, n - cached, budget) == 0:
                break  # what is left of the budget does not buy one token this far into the prompt
            if not self.prompts.fits(claim):
                break
            self.waiting.popleft()
            req.start_prefill()
            self.prompts.take(req, claim)
            self.running.append(req)
            if claim.lower:  # the next blocks come back from host memory or disk; it computes once they land
                continue
            take = n - cached if whole else self._chunk(cached, n - cached, budget)
            batch.append((req, take))
            budget -= take if whole else take * self._weight(cached)
        return batch

    def grow_running(self) -> list[Request]:
        """Make sure every running request has a slot for every position it has."""
        for req in list(self.running):
            if req not in self.running:  # preempted below while serving an earlier one
                continue
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
        if self.tiers is not None:
            self.tiers.poll(req, wait=True)  # no copy may still be landing in blocks that go back
        req.preempt()
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_computed = req.named_blocks = 0
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Out of the queues (the engine finishes it and frees its blocks); no-op if not queued."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)


def full(req: Request) -> bool:
    """It has all its max_tokens (the last one may still be on the device: overlap.py), so it finishes
    once that is read back; a step more would compute a token nobody gets."""
    return len(req.output_ids) >= req.params.max_tokens
