"""Work that holds the interpreter for long, kept to a share of the router's time.

Parsing a body of megabytes holds the GIL for the whole call (json.loads of 600,000 ids: ~40 ms on one
core), on a thread or not: while it runs, the event loop streams nobody's tokens. Twenty clients sending
such bodies one after another would keep it so nearly all the time, although every one of them is
refused. A Pacer runs such jobs one at a time and, after a job of d seconds, starts the next no sooner
than d x (1 / share - 1) later: they take at most `share` of the router's time between them, and the
event loop gets the rest in every stretch, whatever the number of senders. A body under the threshold
(most prompts) never waits here.

    Pacer(share).run(executor, fn, arg)   fn(arg) on the executor, paced as above
"""

from __future__ import annotations

import asyncio
import time

HEAVY_SHARE = 0.25  # of the router's time that parsing big bodies may take


class Pacer:
    def __init__(self, share: float = HEAVY_SHARE):
        if not 0 < share <= 1:
            raise ValueError(f"a pacer's share is in (0, 1], got {share}")
        self.share = share
        self._turn = asyncio.Lock()  # FIFO: waiters go in arrival order
        self._next_at = 0.0  # time.monotonic() before which no job starts
        self.busy_s = 0.0  # the jobs' time in all (tests and metrics)

    async def run(self, executor, fn, arg):
        async with self._turn:
            wait = self._next_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            start = time.monotonic()
            try:
                return await asyncio.get_running_loop().run_in_executor(executor, fn, arg)
            finally:
                took = time.monotonic() - start
                self.busy_s += took
                self._next_at = time.monotonic() + took * (1 / self.share - 1)
