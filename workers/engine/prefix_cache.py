"""Prefix cache: full KV blocks named by their tokens, kept after a request ends, shared by the next.

Integers and bytes only, no torch (STYLE: bookkeeping testable alone). A full block is named by a
hash chained over its tokens and its parent block's name (protocol/blocks.py: the router computes
the same names to route by them), so two prompts that begin alike have the
same leading names and one lookup finds how much of a prompt's KV already sits in the pool:

    name(block i) = H(name(block i-1) + tokens of block i)      name(block -1) = root (model + layout)

`PrefixCache` stands where the engine's `BlockPool` stood (same calls: can_allocate, allocate,
allocate_after, free, num_free, num_blocks) and adds the reuse:

    match(names) -> blocks        the longest run of leading names whose blocks are in the pool
    acquire(blocks)               a request uses those blocks too (refcount + 1; no longer evictable)
    register(names, blocks)       these in-use blocks now hold the KV those names describe (full, computed)
    free(blocks)                  a request lets go (refcount - 1); at 0 a named block stays, evictable
                                  (least recently used first), an unnamed one goes back to the free list
    allocate(n)                   free blocks first, then the least recently used named ones (evicted:
                                  `on_evict` runs first, so a copy still reading them can be waited for)

Free space (`num_free`) counts evictable blocks: a cached block costs a request nothing to take.
A request frees its blocks last-first, so the tail of a prefix is evicted before its head (a
missing head makes the rest unreachable). With `enabled=False` nothing is named: a plain pool.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from pdserve.protocol.blocks import extend_names, root_name  # noqa: F401  (the one naming; the router's too)
from pdserve.workers.engine.block_pool import BlockPool, OutOfBlocks


def names_upto(req, num_blocks: int, block_size: int, root: bytes) -> list[bytes]:
    """The request's first num_blocks block names (`req.block_names`, extended from `req.tokens()` as
    far as needed; every one of those blocks must be full of known tokens)."""
    have = len(req.block_names)
    if num_blocks > have:
        extend_names(req.block_names, req.tokens(have * block_size, num_blocks * block_size), block_size, root)
    return req.block_names[:num_blocks]


class PrefixCache:
    def __init__(self, num_blocks: int, enabled: bool = True):
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.enabled = enabled
        self.on_evict: Callable[[list[int]], None] | None = None  # before evicted blocks get a new owner
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._ref: dict[int, int] = {}  # blocks in use -> how many requests use them
        self._lru: OrderedDict[int, None] = OrderedDict()  # named blocks nobody uses, oldest first
        self.evictions = 0  # blocks
        self.queried_tokens = 0  # prompt tokens looked up (count()), and of those found cached
        self.hit_tokens = 0

    # ---- space ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.pool.num_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or not."""
        return len(self._name_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def can_allocate(self, n: int, reuse: Sequence[int] = ()) -> bool:
        """n fresh blocks fit once `reuse` (matched blocks about to be acquired) is taken."""
        return n <= self.num_free - sum(1 for b in reuse if b in self._lru)

    def allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        take = min(n, self.pool.num_free)
        out = self.pool.allocate(take) if take else []
        if n > take:
            out += self._evict(n - take)
        for b in out:
            self._ref[b] = 1
        return out

    def allocate_after(self, block: int) -> int:
        """One block, block+1 when it is free (keeps a growing request contiguous)."""
        b = self.pool.allocate_after(block) if self.pool.num_free else self._evict(1)[0]
        self._ref[b] = 1
        return b

    def _evict(self, n: int) -> list[int]:
        if n > len(self._lru):
            raise OutOfBlocks(f"asked for {n} more blocks, {len(self._lru)} evictable")
        # ascending: a request's blocks went into the LRU tail first, and a transfer pays one copy
        # (or NIXL descriptor) per run of consecutive blocks, so evicted ones must come back in order
        out = sorted(self._lru.popitem(last=False)[0] for _ in range(n))
        for b in out:
            del self._block_of[self._name_of.pop(b)]
        self.evictions += n
        if self.on_evict is not None:
            self.on_evict(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        unnamed = []
        for b in reversed(blocks):  # the tail first: evicted before the head
            r = self._ref.get(b)
            if r is None:
                raise ValueError(f"double free of block {b} (not in use)")
            if r > 1:
                self._ref[b] = r - 1
                continue
            del self._ref[b]
            if b in self._name_of:
                self._lru[b] = None
            else:
                unnamed.append(b)
        self.pool.free(unnamed)

    # ---- reuse ---------------------------------------------------------------------------------

    def match(self, names: Sequence[bytes]) -> list[int]:
        """Blocks of the longest run of leading names held in the pool (not acquired)."""
        out = []
        if self.enabled:
            for name in names:
                b = self._block_of.get(name)
                if b is None:
                    break
                out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b in self._lru:
                del self._lru[b]
            elif b not in self._ref:
                raise ValueError(f"block {b} is neither in use nor cached; match() it first")
            self._ref[b] = self._ref.get(b, 0) + 1

    def register(self, names: Sequence[bytes], blocks: Sequence[int]) -> None:
        """blocks[i] (in use, full, computed) holds the KV names[i] describes. A name another block
        already holds stays with that block (this one goes back unnamed when freed)."""
        if not self.enabled:
            return
        for name, b in zip(names, blocks):
            if b in self._name_of or name in self._block_of:
                continue
            if b not in self._ref:
                raise ValueError(f"block {b} is not in use; only a request's own blocks can be named")
            self._name_of[b] = name
            self._block_of[name] = b

    def count(self, asked_tokens: int, hit_tokens: int) -> None:
        """One prompt's lookup, for the hit rate (a preempted request's second lookup is not one)."""
        self.queried_tokens += asked_tokens
        self.hit_tokens += hit_tokens

    def name_of(self, block: int) -> bytes | None:
        return self._name_of.get(block)

    def held_names(self) -> list[bytes]:
        """Every name the pool holds now (what the worker reports to the router); may raise RuntimeError
        when read from another thread while a step changes it (the caller tries again later)."""
        return list(self._block_of)
