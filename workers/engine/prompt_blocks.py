"""A prompt's blocks: the one place a request is given the KV blocks for its prompt.

    plan(req, num_tokens) -> Claim   what it would take: the leading blocks the pool holds (shared),
                                     the tier of each block after them to reload rather than compute,
                                     and how many fresh blocks; a look that takes and counts nothing
                                     (a request that waits for room is planned again at every try)
    fits(claim) -> bool              the pool has room for it now
    take(req, claim, wait)           take them: the cached blocks acquired, fresh ones allocated,
                                     num_computed past the cached prefix, the reloads started (wait:
                                     until they land); the lookup counted here, not per plan: in the
                                     tiers' hits and misses, and at the prompt's first placement in the
                                     pool's hit rate
    name(req)                        name its newly completed full blocks (a later prompt reuses them)

Its callers, each once: the scheduler admitting a waiting request (scheduler.py), a prefill worker's
prefill_only and a decode worker's reserve (handoff.py). A running request's next block, one at a
time, is the scheduler's (grow_running). `tiers` is the engine's KV tiers below the pool (None: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.workers.engine.block_pool import blocks_for
from pdserve.workers.engine.prefix_cache import PrefixCache, names_upto
from pdserve.workers.engine.request import Request, Status

if TYPE_CHECKING:
    from pdserve.workers.engine.tiering import Tiers


@dataclass
class Claim:
    """The blocks a prompt would take (plan), taken at once by take()."""
    need: int  # fresh blocks
    hit: list[int] = field(default_factory=list)  # leading blocks the pool holds (shared, already named)
    lower: list[str] = field(default_factory=list)  # the tier of each block after `hit` to reload
    first: bool = True  # its prompt's first placement (not a preempted request's): counts in the hit rate
    looked: list[bytes] = field(default_factory=list)  # the names after `hit` looked for in the tiers

    @property
    def blocks(self) -> int:
        return len(self.hit)


class PromptBlocks:
    def __init__(self, blocks: PrefixCache, block_size: int, root: bytes, tiers: Tiers | None = None):
        self.blocks = blocks
        self.block_size = block_size
        self.root = root  # the prefix cache's root name (model and layout)
        self.tiers = tiers

    def plan(self, req: Request, num_tokens: int | None = None) -> Claim:
        """The blocks for the request's first num_tokens positions (default: all it has). A cached
        prefix is looked up only for all of them (a decode worker's reservation of a whole prompt).
        Counts nothing: the pool's hit rate and the tiers' hits and misses are take()'s."""
        n = req.num_tokens if num_tokens is None else num_tokens
        whole = bool(req.prompt_ids) and n == req.num_tokens
        hit = self.cached_prefix(req) if whole else []
        looked = self.lower_names(req, len(hit)) if whole else []
        lower = self.tiers.plan(looked) if looked else []
        return Claim(blocks_for(n, self.block_size) - len(hit), hit, lower, req.status is not Status.PREEMPTED,
                     looked)

    def fits(self, claim: Claim) -> bool:
        return self.blocks.can_allocate(claim.need, claim.hit)

    def take(self, req: Request, claim: Claim, wait: bool = False) -> None:
        """Give the request its blocks: `claim.hit` shared, `claim.need` fresh, computing from after the
        hit; the blocks after it that `claim.lower` names reloaded from the tiers (asynchronously;
        wait: this caller waits for them, and num_computed grows by what landed)."""
        bs = self.block_size
        self.blocks.acquire(claim.hit)
        req.block_ids = claim.hit + self.blocks.allocate(claim.need)
        req.named_blocks = len(claim.hit)
        req.num_computed = len(claim.hit) * bs
        if claim.first:  # a preempted request's reuse is not its prompt's
            req.cached_tokens = req.num_computed
            self.blocks.count(len(req.prompt_ids), req.cached_tokens)
        if claim.looked:  # counted here, not in plan(): once per placement, however often it was planned
            self.tiers.count(claim.looked)
        if claim.lower:
            k, n = req.named_blocks, len(claim.lower)
            self.tiers.start(req, req.block_names[k:k + n], req.block_ids[k:k + n], claim.lower, k)
            if wait:
                self.tiers.poll(req, wait=True)

    def name(self, req: Request) -> None:
        """Name the request's newly completed full blocks in the prefix cache."""
        bs = self.block_size
        full = min(req.num_computed, req.num_tokens) // bs
        if self.blocks.enabled and full > req.named_blocks and req.block_ids:
            names = names_upto(req, full, bs, self.root)
            self.blocks.register(names[req.named_blocks:full], req.block_ids[req.named_blocks:full])
            req.named_blocks = full

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the request's longest cached prefix, leaving at least its last token to compute."""
        full = (req.num_tokens - 1) // self.block_size
        if not self.blocks.enabled or full == 0 or req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position: nothing may be skipped
        return self.blocks.match(names_upto(req, full, self.block_size, self.root))

    def lower_names(self, req: Request, gpu_blocks: int) -> list[bytes]:
        """The names of the request's full blocks after the GPU hit, those the KV tiers may hold (none
        without tiers); Tiers.plan says which to reload rather than compute."""
        full = (req.num_tokens - 1) // self.block_size
        if self.tiers is None or full <= gpu_blocks:
            return []
        return names_upto(req, full, self.block_size, self.root)[gpu_blocks:]
