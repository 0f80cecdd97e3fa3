"""The router's index of where KV blocks are: block name -> the workers that hold it, and in which tier.

    KVIndex(max_entries)
      .apply(worker_id, KVEvents)       a worker's report (protocol/control.py): names its tiers gained, lost
      .expect(worker_id, names)         the router sent it a prompt of these names: its pool will hold them
      .forget(worker_id)                it restarted, was dropped, or a report was lost: its names go
      .held(worker_id, names) -> tiers  of a prompt's block names, the leading run that worker holds, each
                                        one's best tier ("gpu" before "host" before "disk")

Fed by the workers' reports only, so it may be stale: a name it lists that the worker has evicted costs
that request a recompute (the worker looks its own cache up; the index only steers), never a wrong answer.
A lost report (a gap in `seq`) forgets the worker's names until its next full report (`reset`).

Bounded: at most max_entries (name, worker) pairs; past it the names least recently reported go first
(a forgotten name is a miss, like an evicted one). Each entry is a name's 16 bytes and a small dict.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from pdserve.protocol import control as P
from pdserve.protocol.enums import TIERS

log = logging.getLogger("pdserve.router")

BEST_FIRST = ("gpu", *TIERS)  # every P.KVTier: reading a name from an earlier one is cheaper
BIT = {t: 1 << i for i, t in enumerate(BEST_FIRST)}
MAX_ENTRIES = 4_000_000  # (name, worker) pairs: ~0.5 GB at most; a 16-token block each


def best_tier(bits: int) -> str | None:
    return next((t for t in BEST_FIRST if bits & BIT[t]), None)


class KVIndex:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._where: OrderedDict[bytes, dict[str, int]] = OrderedDict()  # name -> worker id -> tier bits
        self._seq: dict[str, int] = {}  # worker id -> the seq of its last report
        self._count: dict[str, int] = {}  # worker id -> names it holds in the index
        self.entries = 0
        self.lost_reports = 0  # gaps seen (each forgot a worker's names)

    def register(self, worker_id: str) -> None:
        """A new incarnation registered, one that names its blocks: it holds nothing yet (what it does, a
        disk tier's files, its first report says), and it counts as reporting from now on."""
        self.forget(worker_id)
        self._seq[worker_id] = -1

    def reporting(self, worker_id: str) -> bool:
        """Has this worker reported its names (since it registered)?"""
        return worker_id in self._seq

    def apply(self, worker_id: str, ev: P.KVEvents) -> None:
        last = self._seq.get(worker_id)
        if ev.reset:
            self.forget(worker_id)
        elif last is None or ev.seq != last + 1:  # a report was lost (or this one came before the reset)
            self.lost_reports += 1
            log.info("worker %s: KV report %d after %s; forgetting its block names until its next full report",
                     worker_id, ev.seq, last)
            self.forget(worker_id)
            self._seq[worker_id] = ev.seq  # its later reports apply; names they add are right
        self._seq[worker_id] = ev.seq
        for group in ev.removed:
            bit = BIT[group.tier]
            for name in group.names:
                holders = self._where.get(name)
                if holders is None or not holders.get(worker_id, 0) & bit:
                    continue
                left = holders[worker_id] & ~bit
                if left:
                    holders[worker_id] = left
                else:
                    self._drop(name, holders, worker_id)
        for group in ev.stored:
            self._add(worker_id, group.tier, group.names)

    def expect(self, worker_id: str, names: list[bytes]) -> None:
        """The router sent a prompt of these block names to this worker: once prefilled, its pool holds
        them, before the worker's next report says so (a conversation's next turn may come first). If
        the request fails, or they are evicted unreported, the entries are stale: misses, until the
        worker's next full report."""
        if self.reporting(worker_id):
            self._add(worker_id, "gpu", names)

    def _add(self, worker_id: str, tier: str, names) -> None:
        bit = BIT[tier]
        for name in names:
            holders = self._where.get(name)
            if holders is None:
                holders = self._where[name] = {}
            else:
                self._where.move_to_end(name)
            if worker_id not in holders:
                self.entries += 1
                self._count[worker_id] = self._count.get(worker_id, 0) + 1
            holders[worker_id] = holders.get(worker_id, 0) | bit
        while self.entries > self.max_entries:
            name, holders = next(iter(self._where.items()))
            for w in list(holders):
                self._drop(name, holders, w)

    def _drop(self, name: bytes, holders: dict[str, int], worker_id: str) -> None:
        del holders[worker_id]
        self.entries -= 1
        self._count[worker_id] -= 1
        if not holders:
            del self._where[name]

    def forget(self, worker_id: str) -> None:
        self._seq.pop(worker_id, None)
        if not self._count.pop(worker_id, 0):
            return
        for name in [n for n, holders in self._where.items() if worker_id in holders]:
            holders = self._where[name]
            del holders[worker_id]
            self.entries -= 1
            if not holders:
                del self._where[name]

    def held(self, worker_id: str, names: list[bytes]) -> list[str]:
        out = []
        for name in names:
            tier = best_tier(self._where.get(name, {}).get(worker_id, 0))
            if tier is None:
                break
            out.append(tier)
        return out

    def names_of(self, worker_id: str) -> int:
        return self._count.get(worker_id, 0)
