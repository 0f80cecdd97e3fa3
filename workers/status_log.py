"""What a worker tells its log about itself: one line at start (its KV capacity and where the start's
time went: model load, KV pool, graphs, warm-up request), then one every
--stats-interval seconds while it has work (throughput, running, waiting, KV usage), like vLLM's
engine lines.

    startup_line(worker_id, role, engine) -> str
    StatsLine(worker_id, interval_s)
      .received(msg) / .sent(msg)      every control message in and out (the main thread)
      .due()                           after each tick: has an interval passed?
      .log(running, waiting, free_blocks, num_blocks, cache)   then: the line (cache: the prefix
                                       cache's cumulative P.CacheFigures, for the interval's hit rate)

Counted here, from the messages: prompt tokens that arrived to be prefilled (Generate, Prefill) and
tokens sent to the router (Tokens). Idle intervals log nothing, except the first one after work, so
the log shows where the load ended.
"""

from __future__ import annotations

import logging
import time

from pdserve.protocol import control as P

log = logging.getLogger("pdserve.worker")


def startup_line(worker_id: str, role: str, engine) -> str:
    lay, cfg = engine.layout, engine.config
    blocks = engine.blocks.num_blocks
    tokens = blocks * lay.block_size
    gib = blocks * lay.num_layers * lay.block_bytes / 2**30
    per_request = tokens / engine.max_model_len
    start = engine.start  # where the start went (workers/engine/start_times.py), once it is over
    started = f"; {start.describe()}" if start.total_s is not None else ""
    return (f"{worker_id}: {role} on {engine.device}, model {engine.model_name} ({lay.dtype}); KV cache {blocks} blocks "
            f"x {lay.block_size} tokens = {tokens} tokens, {gib:.3g} GiB; max concurrency {cfg.max_num_seqs} "
            f"requests (--max-num-seqs), {per_request:.2f}x for requests of max_model_len {engine.max_model_len} "
            f"tokens{started}")


class StatsLine:
    def __init__(self, worker_id: str, interval_s: float):
        self.worker_id = worker_id
        self.interval_s = interval_s  # 0: never
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._since = time.monotonic()
        self._was_busy = False
        self._cache_seen = (0, 0)  # (queried, hit) prompt tokens, cumulative, at the last line

    def received(self, msg) -> None:
        if isinstance(msg, (P.Generate, P.Prefill)):
            self.prompt_tokens += len(msg.prompt_ids)

    def sent(self, msg) -> None:
        if isinstance(msg, P.Tokens):
            self.generation_tokens += len(msg.outputs)

    def due(self) -> bool:
        return self.interval_s > 0 and time.monotonic() - self._since >= self.interval_s

    def maybe_log(self, running: int, waiting: int, free_blocks: int, num_blocks: int,
                  cache: P.CacheFigures | None = None) -> str | None:
        """The line, logged, if an interval has passed and there was (or is, or just was) work."""
        return self.log(running, waiting, free_blocks, num_blocks, cache) if self.due() else None

    def log(self, running: int, waiting: int, free_blocks: int, num_blocks: int,
            cache: P.CacheFigures | None = None) -> str | None:
        """The interval's line, logged if there was (or is, or just was) work; starts the next interval."""
        now = time.monotonic()
        span = max(now - self._since, 1e-9)
        busy = bool(self.prompt_tokens or self.generation_tokens or running or waiting)
        line = None
        if busy or self._was_busy:
            used = num_blocks - free_blocks
            line = (f"{self.worker_id}: prompt throughput {self.prompt_tokens / span:.1f} tokens/s, generation "
                    f"throughput {self.generation_tokens / span:.1f} tokens/s, running {running} reqs, waiting "
                    f"{waiting} reqs, KV cache usage {100 * used / max(num_blocks, 1):.1f}% ({used}/{num_blocks} "
                    f"blocks)")
            if cache is not None:
                seen = (cache.queried_tokens, cache.hit_tokens())
                queried, hit = seen[0] - self._cache_seen[0], seen[1] - self._cache_seen[1]
                line += f", prefix cache hit rate {100 * hit / queried:.1f}%" if queried > 0 else ""
            log.info("%s", line)
        if cache is not None:
            self._cache_seen = (cache.queried_tokens, cache.hit_tokens())
        self._was_busy = busy
        self.prompt_tokens = self.generation_tokens = 0
        self._since = now
        return line
