"""Free-block bookkeeping for the paged KV cache: integers only, no torch.

`BlockPool` keeps a sorted list of free extents and hands out contiguous ranges where
it can, because every run boundary costs one copy call or one NIXL descriptor when a
request's KV moves to another worker.
"""

from __future__ import annotations

import bisect

from pdserve.protocol.control import blocks_for  # noqa: F401  here too: the engine's callers import it from its pool


def runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Merge block ids into (start, length) runs of consecutive ids, in order."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both sides are consecutive at once."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} source vs {len(dst)} destination")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class OutOfBlocks(Exception):
    pass


class BlockPool:
    """Free-block bookkeeping: sorted, merged free extents [(start, length), ...]."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_blocks]
        self.num_free = num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks, as few runs as possible: the smallest extent that fits all n,
        else the largest extents first."""
        if n <= 0:
            return []
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        start = self.take_range(n)
        if start is not None:
            return list(range(start, start + n))
        out: list[int] = []
        while len(out) < n:
            i = max(range(len(self._lengths)), key=lambda j: self._lengths[j])
            out += self._take(i, min(n - len(out), self._lengths[i]))
        return out

    def allocate_after(self, block: int) -> int:
        """One block, block+1 when it is free (keeps a growing request contiguous)."""
        i = bisect.bisect_right(self._starts, block + 1) - 1
        if i >= 0 and self._starts[i] == block + 1:
            return self._take(i, 1)[0]
        return self.allocate(1)[0]

    def take_range(self, n: int) -> int | None:
        """The start of n contiguous free blocks, taken from the smallest extent that holds them; None when
        no extent does (nothing is taken). A range never becomes a list of ids here (staging.Space hands out
        millions of units this way)."""
        fitting = [i for i, ln in enumerate(self._lengths) if ln >= n]
        if not fitting:
            return None
        return self._cut(min(fitting, key=lambda j: self._lengths[j]), n)

    def _take(self, i: int, n: int) -> list[int]:
        start = self._cut(i, n)
        return list(range(start, start + n))

    def _cut(self, i: int, n: int) -> int:
        """n blocks off the front of extent i; their start."""
        start, length = self._starts[i], self._lengths[i]
        if n == length:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i], self._lengths[i] = start + n, length - n
        self.num_free -= n
        return start

    def free(self, blocks: list[int]) -> None:
        for start, length in runs(sorted(blocks)):
            self.free_range(start, length)

    def free_range(self, start: int, length: int) -> None:
        """Blocks start..start+length-1 free again, merged with their free neighbours (ValueError: outside the
        pool, or any of them free already)."""
        if start < 0 or start + length > self.num_blocks:
            raise ValueError(f"blocks {start}..{start + length - 1} outside pool of {self.num_blocks}")
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + length) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start
        ):
            raise ValueError(f"double free of blocks in {start}..{start + length - 1}")
        self._starts.insert(i, start)
        self._lengths.insert(i, length)
        self.num_free += length
        # merge with the right neighbour, then the left
        if i + 1 < len(self._starts) and start + length == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths[i]
            del self._starts[i], self._lengths[i]

    @property
    def extents(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))
