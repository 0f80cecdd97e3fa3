"""Worker choice (--routing): which of the live workers that can take a part of a request gets it. The
Planner (server/routing.py) makes the configured rule once and asks it at each choice.

    CHOICES[Routing(cfg.routing)](index)   the rule, a WorkerChoice; index: the router's KV index
      .worker(workers, job)                (worker, estimate): the colocated or prefill worker, of `workers`
      .decode(paired, need, job)           (worker, estimate): the decode worker, of `paired` (each has a
                                           prefill worker that can send it KV), one with `need` free blocks
                                           first
      .priced(workers)                     whether it prices these workers from their reports; policy auto
                                           then decides from the measured costs (server/kv_route.py
                                           auto_policy), else from the prompt's length
  estimate: what the pricing expected on that worker (server/kv_route.py Estimate); None: not priced
  (timings.route and pdserve_routed then say least-loaded).

LeastLoaded (least-loaded): the least loaded worker (load below).
KVAware (kv): the lowest predicted TTFT under the load rule (server/kv_route.py choose); the decode worker
is the one holding most of the prompt. Least loaded while none of the workers reports its block names.

A new rule: its member in protocol/enums.py Routing and its class here in CHOICES.
"""

from __future__ import annotations

from pdserve.protocol.enums import Routing
from pdserve.server.job import Job
from pdserve.server.kv_index import KVIndex
from pdserve.server.kv_route import Estimate, choose, not_overloaded, reporting
from pdserve.server.pool import WorkerState


def load(w: WorkerState) -> tuple[int, int]:
    """Smaller is less loaded: requests the router has in flight there (exact, immediate), then the
    worker's own queue as of its last heartbeat, then more free blocks."""
    return (len(w.inflight) + w.queue_depth, -w.free_blocks)


def least_loaded(workers: list[WorkerState], need_blocks: int = 0) -> WorkerState:
    """The least loaded of `workers` (not empty), of those with need_blocks free if any has them."""
    roomy = [w for w in workers if w.free_blocks >= need_blocks]
    return min(roomy or workers, key=load)


class WorkerChoice:
    """A worker-choice rule (see the top)."""

    def __init__(self, index: KVIndex):
        self.index = index

    def worker(self, workers: list[WorkerState], job: Job) -> tuple[WorkerState, Estimate | None]:
        raise NotImplementedError

    def decode(self, paired: list[WorkerState], need: int, job: Job) -> tuple[WorkerState, Estimate | None]:
        raise NotImplementedError

    def priced(self, workers: list[WorkerState]) -> bool:
        return False


class LeastLoaded(WorkerChoice):
    """The least loaded worker; a decode worker with free blocks for the prompt first."""

    def worker(self, workers: list[WorkerState], job: Job) -> tuple[WorkerState, Estimate | None]:
        return least_loaded(workers), None

    def decode(self, paired: list[WorkerState], need: int, job: Job) -> tuple[WorkerState, Estimate | None]:
        return least_loaded(paired, need), None


class KVAware(LeastLoaded):
    """The lowest predicted TTFT, priced from the prefix each worker holds and its measured costs; least
    loaded while none of the workers reports its block names."""

    def worker(self, workers: list[WorkerState], job: Job) -> tuple[WorkerState, Estimate | None]:
        """The tokens it expects to compute on the chosen worker count as ahead of the next request there
        until this one's first token."""
        if not self.priced(workers):
            return super().worker(workers, job)
        est = choose(workers, self.index, job.prompt_ids)
        est.worker.pending[job.request_id] = est.uncached_tokens
        est.worker.chosen += 1
        return est.worker, est

    def decode(self, paired: list[WorkerState], need: int, job: Job) -> tuple[WorkerState, Estimate | None]:
        """Of those not overloaded (with `need` free blocks, if any has), the one holding most of the prompt
        (it is not sent again), then the less loaded, then the one with more free blocks."""
        if not self.priced(paired):
            return super().decode(paired, need, job)
        candidates = not_overloaded([d for d in paired if d.free_blocks >= need] or paired)
        held = {d.id: choose([d], self.index, job.prompt_ids) for d in candidates}
        decode = max(candidates, key=lambda d: (sum(held[d.id].cached.values()), -load(d)[0], d.free_blocks))
        return decode, held[decode.id]

    def priced(self, workers: list[WorkerState]) -> bool:
        return reporting(workers, self.index)


CHOICES: dict[Routing, type[WorkerChoice]] = {Routing.KV: KVAware, Routing.LEAST_LOADED: LeastLoaded}
