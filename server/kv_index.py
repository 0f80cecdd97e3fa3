"""The router's index of where KV blocks are: per worker, the block names it holds and in which tiers.

    KVIndex(max_bytes)
      .register(worker_id)              a new incarnation that names its blocks: it holds nothing yet
      .apply(worker_id, KVEvents)       a worker's report (protocol/control.py): names its tiers gained, lost
      .accepted(worker_id, names)       it took a request of this prompt (its first token came, or its
                                        prefill report): its pool holds these names, before its report says so
      .forget(worker_id)                it restarted, was dropped, or a report was lost: its names go, at once
                                        for every lookup; their memory is freed by reap()
      .reap(limit) -> left              free up to `limit` forgotten entries (the router's pool calls it in
                                        slices between other work, so forgetting millions never stalls it)
      .held(worker_id, names) -> tiers  of a prompt's block names, the leading run that worker holds, each
                                        one's best tier ("gpu" before "host" before "disk")

Fed by what the workers say only, so it may be stale, never wrong: a name it lists that the worker has
evicted costs that request a recompute (the worker looks its own cache up; the index only steers). The
router's own guess when it chooses a worker is never indexed: a request the worker refuses (or that
fails before its first token) leaves nothing behind. A lost report (a gap in `seq`) forgets the
worker's names until its next full report (`reset`). A full report replaces the worker's names with its
snapshot, except those accepted since its last report came: the report and the first token travel on
different sockets, so a snapshot taken just before a prefill ended can arrive after that request's first
token (its next report would list them again; meanwhile a conversation's next turn would miss).

Bounded in bytes: at most max_bytes (MAX_BYTES, 512 MiB: ~3M entries), counted as ENTRY_BYTES per
(name, worker) entry, the most one takes as measured with tracemalloc (tests/test_kv_index.py): the
16-byte name's object (49 bytes) and its slot in a dict, whose table is 1.5x to 6x its entries (it
doubles as it grows, and keeps the slots of deleted names until its next resize): 100-115 bytes an
entry while filling, up to ~170 under churn at the bound. Past the bound the worker holding the most
names loses its least recently reported ones first (a forgotten name is a miss, like an evicted one):
one worker's reports cannot push the others' out while it holds more than they do.
"""

from __future__ import annotations

import logging
from itertools import islice

from pdserve.protocol import control as P
from pdserve.protocol.enums import TIERS

log = logging.getLogger("pdserve.router")

BEST_FIRST = ("gpu", *TIERS)  # every P.KVTier: reading a name from an earlier one is cheaper
BIT = {t: 1 << i for i, t in enumerate(BEST_FIRST)}
MAX_BYTES = 512 * 2**20  # the index's memory: ~3M (name, worker) entries, a 16-token block each
ENTRY_BYTES = 176  # one (name, worker) entry at most, as measured (tests/test_kv_index.py), with a margin
REAP_SLICE = 4096  # forgotten entries freed per reap() call: a millisecond or two
EVICT_SLACK = 64  # past the bound, 1/64 of it goes at once
MAX_FRESH = 65536  # names accepted between two reports of a worker kept for a full report (~8 MiB at most)


def best_tier(bits: int) -> str | None:
    return next((t for t in BEST_FIRST if bits & BIT[t]), None)


class KVIndex:
    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.max_entries = max(1, max_bytes // ENTRY_BYTES)
        # worker id -> name -> tier bits, least recently reported first (a dict keeps the order of insertion)
        self._held: dict[str, dict[bytes, int]] = {}
        self._seq: dict[str, int] = {}  # worker id -> the seq of its last report
        self._dying: list[dict[bytes, int]] = []  # forgotten, not freed yet (reap)
        self._fresh: dict[str, dict[bytes, None]] = {}  # worker id -> names accepted since its last report
        self.entries = 0  # (name, worker) pairs held, all workers
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
        fresh = self._fresh.pop(worker_id, ())
        if ev.reset:
            self.forget(worker_id)
        elif last is None or ev.seq != last + 1:  # a report was lost (or this one came before the reset)
            self.lost_reports += 1
            log.info("worker %s: KV report %d after %s; forgetting its block names until its next full report",
                     worker_id, ev.seq, last)
            self.forget(worker_id)
        self._seq[worker_id] = ev.seq  # its later reports apply; names they add are right
        held = self._held.get(worker_id)
        for group in ev.removed if held else ():
            bit = BIT[group.tier]
            for name in group.names:
                bits = held.get(name, 0)
                if not bits & bit:
                    continue
                if bits & ~bit:
                    held[name] = bits & ~bit
                else:
                    del held[name]
                    self.entries -= 1
        for group in ev.stored:
            self._add(worker_id, group.tier, group.names)
        if ev.reset and fresh:  # (see the top: a full report's snapshot may predate them)
            self._add(worker_id, "gpu", fresh)

    def accepted(self, worker_id: str, names: list[bytes]) -> None:
        """This worker took a request of a prompt of these block names (its first token, or its prefill
        report, came): its pool holds them now, before its next report says so (a conversation's next
        turn may come first). Evicted unreported later, they are stale: misses, until its next full
        report."""
        if self.reporting(worker_id):
            self._add(worker_id, "gpu", names)
            fresh = self._fresh.setdefault(worker_id, {})
            if len(fresh) < MAX_FRESH:  # (a worker that reports nothing new, fully cached prompts: bounded)
                fresh.update(dict.fromkeys(names))

    def _add(self, worker_id: str, tier: str, names) -> None:
        bit = BIT[tier]
        held = self._held.setdefault(worker_id, {})
        for name in names:
            bits = held.pop(name, None)  # and in again: to the end, the most recent
            held[name] = bit if bits is None else bits | bit
            self.entries += bits is None
        if self.entries > self.max_entries:
            self._evict()

    def _evict(self) -> None:
        """Below the bound by a slack (so that this runs once in so many names, not for each): the least
        recently reported names of the worker holding the most go. A dict's oldest keys are its first
        (one C-speed pass over the slots deleted before them, which its next resize drops)."""
        while self.entries > self.max_entries - self.max_entries // EVICT_SLACK:
            held = max(self._held.values(), key=len)
            n = min(len(held), self.entries - self.max_entries + self.max_entries // EVICT_SLACK)
            for name in list(islice(held, n)):
                del held[name]
            self.entries -= n

    def forget(self, worker_id: str) -> None:
        """Its names are gone for every lookup now; their memory goes in reap()'s slices."""
        self._seq.pop(worker_id, None)
        self._fresh.pop(worker_id, None)
        held = self._held.pop(worker_id, None)
        if held:
            self.entries -= len(held)
            self._dying.append(held)

    def reap(self, limit: int = REAP_SLICE) -> int:
        """Free up to `limit` forgotten entries; how many are left to free."""
        while limit > 0 and self._dying:
            held = self._dying[-1]
            if len(held) <= limit:
                limit -= len(held)
                held.clear()
                self._dying.pop()
            else:
                for _ in range(limit):
                    held.popitem()
                limit = 0
        return self.dying

    @property
    def dying(self) -> int:
        """Forgotten entries whose memory reap() has not freed yet."""
        return sum(len(h) for h in self._dying)

    def held(self, worker_id: str, names: list[bytes]) -> list[str]:
        held = self._held.get(worker_id)
        out = []
        for name in names if held else ():
            tier = best_tier(held.get(name, 0))
            if tier is None:
                break
            out.append(tier)
        return out

    def names_of(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))
