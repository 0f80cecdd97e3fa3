"""What a worker tells the router about its KV: the block names each tier holds (as KVEvents, the
difference since the last report) and what prices a request here (KVCosts, in every heartbeat).

    KVReport(engine, worker_id)
      .events() -> KVEvents | None     the heartbeat thread, after each heartbeat: names gained and lost
                                       since the last report (at most MAX_KV_NAMES; the rest next time)
      .costs() -> KVCosts              prefill ms per token (measured), tiers' GB/s, queued prompt tokens
                                       (the scheduler's waiting prompts', and what queue() was last told)
      .observe(request, *batch)        the main thread, at a request's first token: its prefill speed (with
                                       the requests prefilled in the same forward: theirs together)
      .queue(tokens)                   the main thread, a prefill worker as it picks a batch: the prompt
                                       tokens its waiting requests will compute (its queue is the engine's
                                       WAITING requests, which the scheduler never holds)

A report is a difference between two snapshots of the tiers' name sets, not a log of every store and
eviction: nothing is kept per event, a burst costs one message, and a lost message only leaves the
router's index stale (misses). The first report of an incarnation, and one every RESYNC_EVERY, is a
`reset`: the router forgets this worker's names and takes the full set again, so a stale index heals.
"""

from __future__ import annotations

import threading

from pdserve.protocol import control as P
from pdserve.protocol.enums import TIERS

RESYNC_EVERY = 600  # reports between full ones (a stale index heals within this many heartbeats)
DECAY = 0.95  # prefill observations: each older one weighs this much less (a fit over the last ~20)


class KVReport:
    def __init__(self, engine, worker_id: str):
        self.engine = engine
        self.worker_id = worker_id
        self.seq = 0
        self._sent: dict[str, set[bytes]] = {tier: set() for tier in ("gpu", *TIERS)}  # P.KVTier
        self._reset = True
        self._fit = [0.0] * 5  # decayed sums over prefills: n, tokens, ms, tokens^2, tokens x ms
        self._lock = threading.Lock()
        self._queued = 0  # prompt tokens waiting outside the scheduler (a prefill worker's), replaced whole

    def resync(self) -> None:
        """The next report is a full one (a router that did not know this worker)."""
        self._reset = True

    # ---- names ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, set[bytes]] | None:
        """Each tier's names now; None when a step changed the pool under us (the next report has them)."""
        eng = self.engine
        try:
            out = {"gpu": set(eng.blocks.held_names()) if eng.blocks.enabled else set()}
        except RuntimeError:
            return None
        tiers = getattr(eng, "tiers", None)
        for tier in tiers.levels if tiers is not None else ():
            out[tier.name] = set(tier.names())
        return out

    def events(self) -> P.KVEvents | None:
        now = self.snapshot()
        if now is None:
            return None
        reset = self._reset or (self.seq > 0 and self.seq % RESYNC_EVERY == 0)
        if reset:
            self._sent = {t: set() for t in self._sent}
        room = P.MAX_KV_NAMES
        stored, removed = [], []
        for tier, sent in self._sent.items():
            held = now.get(tier, set())
            gone = list(sent - held)[:room]
            room -= len(gone)
            new = list(held - sent)[:room]
            room -= len(new)
            sent.difference_update(gone)
            sent.update(new)
            if gone:
                removed.append(P.TierNames(tier, gone))
            if new:
                stored.append(P.TierNames(tier, new))
        if not (stored or removed or reset):
            return None
        msg = P.KVEvents(self.worker_id, self.seq, reset, stored, removed)
        self.seq += 1
        self._reset = False
        return msg

    # ---- costs ----------------------------------------------------------------------------------

    def observe(self, req, *batch) -> None:
        """A request's prefill is over: its computed tokens over its prefill time. With `batch`, the other
        requests of the same forward (a prefill worker's batch shares the forward's start and end): one
        observation of all their tokens over that time, not one each of a time they shared."""
        s = req.stamps
        if s.prefill_start is None or s.prefill_end is None:
            return
        tokens = sum(len(r.prompt_ids) - r.cached_tokens for r in (req, *batch))
        seconds = s.prefill_end - s.prefill_start
        if tokens <= 0 or seconds <= 0:
            return
        ms = seconds * 1e3
        with self._lock:
            self._fit = [DECAY * s + x for s, x in zip(self._fit, (1.0, tokens, ms, tokens * tokens, tokens * ms))]

    def queue(self, tokens: int) -> None:
        """A prefill worker's waiting requests will compute this many prompt tokens (engine.prefill_tokens:
        a cached prefix is not computed); read by costs() on the heartbeat thread. The main thread counts
        them: the count extends a request's block names and looks the tiers up, which only it may do."""
        self._queued = tokens

    def prefill_model(self) -> tuple[float | None, float]:
        """(ms per token, fixed ms per prefill): a least-squares line through the recent prefills (time
        against computed tokens); while their sizes barely differ, time over tokens and no fixed part."""
        with self._lock:
            n, t, m, tt, tm = self._fit
        if n == 0 or t <= 0:
            return None, 0.0
        spread = n * tt - t * t
        if spread > 1e-6 * n * tt:
            slope = (n * tm - t * m) / spread
            fixed = (m - slope * t) / n
            if slope > 0 and fixed >= 0:
                return slope, fixed
        return m / t, 0.0

    def costs(self) -> P.KVCosts:
        eng = self.engine
        tiers = getattr(eng, "tiers", None)
        gbps = {t.name: tiers.host.cost.bandwidth_gbps(t.name) for t in tiers.levels} if tiers is not None else {}
        try:
            queued = sum(len(r.prompt_ids) - r.num_computed for r in list(eng.scheduler.waiting))
        except RuntimeError:  # the deque changed under us
            queued = 0
        queued += self._queued
        per_token, fixed = self.prefill_model()
        return P.KVCosts(bytes_per_token=eng.layout.bytes_per_token, prefill_ms_per_token=per_token,
                         prefill_ms_fixed=fixed, tier_gbps={t: g for t, g in gbps.items() if g is not None},
                         queued_tokens=max(0, queued))
