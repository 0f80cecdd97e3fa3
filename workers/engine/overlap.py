"""Overlapped steps: the host prepares and launches step N+1 while the GPU still runs step N.

A step whose requests all take the top token with nothing applied to their logits and nothing to
report beside the token (Sampler.plain) picks its tokens on the device and copies them to pinned
host memory behind a CUDA event, without waiting. The engine then schedules and launches the next
step at once: a request whose next input is a token still on the device holds PENDING in its
output_ids (so its positions, blocks and decode row are planned as for any token) and the runner
copies the token's id into its input row on the device (`feed`). Only then does the engine read
step N's tokens back (`Inflight.wait`), and turn them into outputs (text, stop checks) while step
N+1 runs: sampled tokens arrive one step late, as vLLM's async scheduling and SGLang's overlap
scheduler have them.

What it costs: a request that stops at step N (EOS, a stop string) already has a row in step N+1,
whose token is dropped. Its blocks are not given back while step N+1 may still write into them:
they wait in `Inflight.deferred` until that step is read back (the fence for this engine's own
writes; without it a transfer could be handed a block the GPU still writes).

Any other step (sampling, penalties, logprobs, logits asked; the KV tiers on) first reads the step
in flight back and then runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.workers.engine.request import Request

PENDING = -1  # an output token still on the device


@dataclass
class Inflight:
    work: list[tuple[Request, int]]
    done: list[Request]  # the requests whose token this step samples, in its rows' order
    tokens: torch.Tensor  # [len(done)] int64 on the device
    host: torch.Tensor  # its copy in (pinned) host memory, valid once `event` has passed
    ok: torch.Tensor  # [len(done)] bool: the row's logits were finite
    event: object | None  # torch.cuda.Event recorded after the copies (None on the CPU)
    start: float  # time.monotonic() at launch
    members: set[int] = field(default_factory=set)  # id() of every request in `work`
    deferred: list[list[int]] = field(default_factory=list)  # block lists freed once this step is read back

    def __post_init__(self):
        self.members = {id(r) for r, _ in self.work}
        self.index = {id(r): i for i, r in enumerate(self.done)}

    def wait(self) -> tuple[list[int], list[bool]]:
        """Block until the step's tokens are on the host; (token ids, finite) per row of `done`."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist(), self.ok.tolist()


def greedy_async(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object | None]:
    """Top tokens of [K, vocab] logits on their device, and their copies to the host behind an event."""
    top, tokens = logits.max(dim=-1)  # NaN propagates into the max: one reduction checks the row
    ok = top.isfinite()
    if logits.device.type != "cuda":
        return tokens, tokens, ok, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    ok_host = torch.empty(ok.shape, dtype=ok.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ok_host.copy_(ok, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return tokens, host, ok_host, event


def feed(work: list[tuple[Request, int]], inflight: Inflight | None) -> tuple[list[int], list[int], torch.Tensor] | None:
    """The decode rows of `work` whose input token is still on the device: (rows, their index in the
    step in flight's tokens, those tokens), or None. Decode rows come first in a step, in `work` order."""
    if inflight is None:
        return None
    rows, src = [], []
    decodes = [r for r, n in work if n == 1 and r.num_computed]
    for i, r in enumerate(decodes):
        if r.output_ids and r.output_ids[-1] == PENDING:
            rows.append(i)
            src.append(inflight.index[id(r)])
    return (rows, src, inflight.tokens) if rows else None


def pop_pending(req: Request) -> int:
    """Take the PENDING tokens off the end of req.output_ids; how many there were."""
    n = 0
    while req.output_ids and req.output_ids[-1] == PENDING:
        req.output_ids.pop()
        n += 1
    return n
