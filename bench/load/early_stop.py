"""Stopping a capacity probe once its verdict is certain.

A probe fails when fewer than `target` (0.9) of its planned requests meet every SLO. Some misses are
known before the request ends:

    ttft   no first token yet, and more than the TTFT limit since it was sent
    tpot   the first token came, the answer is not done, and the decode time so far already exceeds
           limit x (max_tokens - 1): TPOT = (E2E - TTFT) / (output - 1) and output <= max_tokens
    e2el   more than the E2E limit since it was sent
    a request that ended failing an SLO, or with an error

Once those certain misses exceed (1 - target) x planned, no later answer can make the probe pass: the
rest of its minute would only pile work onto a server already judged. A run past capacity fails this way
within seconds of its queue passing the TTFT limit, instead of sending all of its arrivals and waiting for
the queue they built to drain (minutes at twice the capacity). Its result block then says so
(`stopped_early`), with its goodput fraction as the bound it proved: at most (planned - missed) / planned.

Passing probes and every non-probe run are never stopped: their numbers are whole runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.bench.load.metrics import RequestRecord, meets_slos

CHECK_EVERY_S = 0.2  # how often the sender looks for a certain failure
SETTLE_TIMEOUT_S = 120.0  # after a stop: how long the server may take to drop what it was sent


@dataclass
class _Live:
    start: float  # perf_counter when sent
    max_tokens: int
    first: float | None = None  # perf_counter of the first token


@dataclass
class EarlyStop:
    slos_ms: dict[str, float]  # metric -> limit, as --goodput (ttft, tpot, e2el)
    target: float  # share of the planned requests that must meet every SLO
    planned: int  # requests the full run would send
    live: dict[int, _Live] = field(default_factory=dict)  # index -> a request in flight
    ended_missed: int = 0  # requests that ended without meeting every SLO (errors too)
    stopped_at_s: float | None = None  # seconds after the run start, when it stopped (None: ran whole)
    missed_at_stop: int | None = None
    sent_at_stop: int | None = None
    settle_s: float | None = None  # after the stop, until the server reported nothing in flight

    def started(self, index: int, now: float, max_tokens: int) -> None:
        self.live[index] = _Live(now, max_tokens)

    def first_token(self, index: int, now: float) -> None:
        live = self.live.get(index)
        if live is not None and live.first is None:
            live.first = now

    def ended(self, rec: RequestRecord) -> None:
        self.live.pop(rec.index, None)
        if not meets_slos(rec, self.slos_ms):
            self.ended_missed += 1

    def __post_init__(self):
        self._limits_s = {m: ms / 1e3 for m, ms in self.slos_ms.items()}

    def _missing(self, live: _Live, now: float) -> bool:
        limits = self._limits_s
        if "ttft" in limits and live.first is None and now - live.start > limits["ttft"]:
            return True
        if "e2el" in limits and now - live.start > limits["e2el"]:
            return True
        return ("tpot" in limits and live.first is not None and live.max_tokens > 1
                and now - live.first > limits["tpot"] * (live.max_tokens - 1))

    def missed(self, now: float) -> int:
        """Requests that cannot meet every SLO any more: ended so, or in flight past a limit."""
        return self.ended_missed + sum(self._missing(live, now) for live in self.live.values())

    def certain_fail(self, now: float) -> bool:
        """No outcome of what is left can bring the met share up to the target."""
        return self.planned > 0 and (self.planned - self.missed(now)) < self.target * self.planned

    def stop(self, now: float, t0: float, sent: int) -> None:
        self.stopped_at_s = now - t0
        self.missed_at_stop = self.missed(now)
        self.sent_at_stop = sent

    @property
    def stopped(self) -> bool:
        return self.stopped_at_s is not None

    def bound(self) -> float | None:
        """The goodput fraction a stopped run proved it could not exceed."""
        if not self.stopped:
            return None
        return (self.planned - self.missed_at_stop) / self.planned

    def to_dict(self) -> dict:
        return {"stopped_at_s": self.stopped_at_s, "planned": self.planned, "sent": self.sent_at_stop,
                "missed": self.missed_at_stop, "goodput_fraction_at_most": self.bound(),
                "settle_s": self.settle_s,
                "reason": (f"{self.missed_at_stop} of {self.planned} planned requests had missed an SLO "
                           f"{self.stopped_at_s:.1f} s in ({self.sent_at_stop} sent): the goodput fraction "
                           f"could reach at most {self.bound():.2f} < {self.target:g}")
                if self.stopped else None}


def server_idle(health: dict) -> bool:
    """/health's workers: nothing queued, running or in flight on any of them."""
    return all(not (w.get("in_flight") or w.get("running") or w.get("queue_depth"))
               for w in health.get("workers", []))
