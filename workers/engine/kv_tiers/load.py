"""A load: the LoadHandle the engine polls while a cached prefix comes back into its GPU blocks.

HostTier.load() makes one and fills it (the load path is with the tier's other copies, copies.py):
host entries are copied in at once on the load stream; disk entries are read and verified by a
thread into host slots, then copied in. The handle holds what the engine waits on
(workers/engine/tiering.py), and feeds each tier's measured time to the CostModel when it is done.
    LoadHandle(n, cost, device)               n items; cost: the CostModel each part's time feeds
    done() -> bool                            non-blocking; True once the copies completed (then any
                                              later work on any stream sees the KV)
    wait(timeout=None) -> bool / fence()      block the host until done / make the current stream wait
    error, loaded, bytes, seconds, tier_seconds   what failed (the caller recomputes from `loaded` on)
"""

from __future__ import annotations

import threading
import time

import torch

from pdserve.workers.engine.kv_tiers.cost import CostModel


class LoadHandle:
    """One load(): poll done(); `error` set when an entry could not be served (missing, or refused
    on disk: the caller recomputes from block `loaded` on, the blocks before it landed)."""

    def __init__(self, n: int, cost: CostModel, device: torch.device):
        self._cost = cost
        self._device = device
        self.error: str | None = None
        self._failed = n  # index of the first item that did not land
        self._events: list = []  # CUDA: each part's last copy
        self._parts: dict[str, list] = {}  # tier -> [bytes, start event or seconds, end event or None, extra s]
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._finished = False
        self.bytes = 0
        self.seconds: float | None = None
        self.tier_seconds: dict[str, float] = {}

    @property
    def loaded(self) -> int:
        """Leading items that landed (all of them when error is None)."""
        return self._failed

    def _fail(self, index: int, why: str) -> None:
        with self._lock:
            if index < self._failed:
                self._failed, self.error = index, why

    def done(self) -> bool:
        if self._finished:
            return True
        if self._thread is not None and self._thread.is_alive():
            return False
        if not all(ev.query() for ev in self._events):
            return False
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block the host until the load is complete (False on timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        for ev in self._events:
            while end is not None and not ev.query():
                if time.monotonic() > end:
                    return False
                time.sleep(0.0002)
            ev.synchronize()
        return self.done()

    def fence(self) -> None:
        """The current stream waits for the copies (no host sync, unless a disk read is still on
        its thread: that is joined first, since its copies are not issued yet)."""
        if self._thread is not None:
            self._thread.join()
        if self._device.type == "cuda":  # on the CPU every copy is done once issued
            for ev in self._events:
                torch.cuda.current_stream(self._device).wait_event(ev)

    def _finish(self) -> None:
        self._finished = True
        for tier, (nbytes, start, end, extra) in self._parts.items():
            seconds = (start.elapsed_time(end) / 1e3 if end is not None else start) + extra
            self.tier_seconds[tier] = seconds
            self._cost.observe_load(tier, nbytes, seconds)
        self.seconds = max(self.tier_seconds.values(), default=0.0)
