"""Overlapped steps: the host prepares and launches step N+1 while the GPU still runs step N.

Every step picks its tokens on the device (sampler.py: greedy or drawn, with penalties, masks,
seeds and logprobs) and copies them, with the logprobs asked for, to pinned host memory behind a
CUDA event, without waiting. With overlap on, the engine then schedules and launches the next step
at once: a request whose next input is a token still on the device holds PENDING in its output_ids
(so its positions, blocks and decode row are planned as for any token) and the runner copies the
token's id into its input row on the device (`feed`). Only then does the engine read step N's tokens
back (Sampler.results), and turn them into outputs (text, stop checks) while step N+1 runs: sampled
tokens arrive one step late, as vLLM's async scheduling and SGLang's overlap scheduler have them.
With overlap off, the engine reads each step back right after launching it: the same path, the
same tokens (the engine's `_launch` and `_settle` are the only places a step is run and recorded).

What it costs: a request that stops at step N (EOS, a stop string) already has a row in step N+1,
whose token is dropped. Its blocks are not given back while step N+1 may still write into them:
they wait in `Inflight.deferred` until that step is read back (the fence for this engine's own
writes; without it a transfer could be handed a block the GPU still writes). That row also makes
step N+1 longer than its synchronous twin: where a step's products run over its own rows (the CPU),
the library may take another kernel for the other rows (MKL's does by row count and place), so
their logits, and the KV they write, can differ from the synchronous step's in the last bits
(tests/test_overlap.py compares logprob values where the rows were the same).

The KV tiers keep it: their copies run on side streams ordered by CUDA events, never by the host's
reading a step back. A store waits for an event recorded on the compute stream when it is issued,
after every step launched so far, the one in flight included (a block is named, and may be stored,
once the step that completes it is launched); a reused block's next write waits for the stores
reading it (HostTier.before_reuse); a load waits for the compute stream likewise, and the engine
schedules its request once the load's event has passed (Tiers.poll): each wait is an event on a
stream, none a host sync. On the CPU every copy is done when issued.

A step whose rows need a token still on the device at a position other than a decode row's input
(a preempted request recomputed in the same step) cannot be fed: the step in flight is read back
first (`fed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.workers.engine.request import PENDING, Request, decode_row
from pdserve.workers.engine.sampling_device import Picked

__all__ = ["PENDING", "Inflight", "feed", "fed", "pop_pending"]


@dataclass
class Inflight:
    work: list[tuple[Request, int]]
    done: list[Request]  # the requests whose token this step picks, in its rows' order
    picked: Picked | None  # their tokens on the device and on their way to the host (None: no row done)
    logits: dict[int, torch.Tensor]  # row -> a copy of its logits, for the requests that asked (return_logits)
    start: float  # time.monotonic() at launch
    members: set[int] = field(default_factory=set)  # id() of every request in `work`
    deferred: list[list[int]] = field(default_factory=list)  # block lists freed once this step is read back
    traced: dict | None = None  # its step trace line, completed when it is read back (step_trace.py)

    def __post_init__(self):
        self.members = {id(r) for r, _ in self.work}
        self.index = {id(r): i for i, r in enumerate(self.done)}

    @property
    def tokens(self) -> torch.Tensor:
        """[len(done)] int64 on the device: each row's token."""
        return self.picked.tokens


def feed(work: list[tuple[Request, int]], inflight: Inflight | None) -> tuple[list[int], list[int], torch.Tensor] | None:
    """The decode rows of `work` whose input token is still on the device: (rows, their index in the
    step in flight's tokens, those tokens), or None. Decode rows come first in a step, in `work` order."""
    if inflight is None:
        return None
    rows, src = [], []
    decodes = [r for r, n in work if decode_row(r, n)]
    for i, r in enumerate(decodes):
        if r.output_ids and r.output_ids[-1] == PENDING:
            rows.append(i)
            src.append(inflight.index[id(r)])
    return (rows, src, inflight.tokens) if rows else None


def fed(work: list[tuple[Request, int]]) -> bool:
    """Every token of `work` still on the device is a decode row's input (what `feed` can supply)."""
    return all(decode_row(r, n) for r, n in work if r.output_ids and r.output_ids[-1] == PENDING)


def pop_pending(req: Request) -> int:
    """Take the PENDING tokens off the end of req.output_ids; how many there were."""
    n = 0
    while req.output_ids and req.output_ids[-1] == PENDING:
        req.output_ids.pop()
        n += 1
    return n
