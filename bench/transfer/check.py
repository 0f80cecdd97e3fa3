"""What lets `pdserve-bench transfer`'s exact-match check fail: fresh prompts, poisoned
destinations, and a fault knob that proves the check catches a transport that drops data.

    prompt_ids(vocab, n, seed)     n token ids drawn from a seeded generator: each run its own prompt
    run_seed(*parts)               a run's seed from (bench seed, length, method, arm, round)
    poison(pool, blocks, seed)     fill those blocks (all layers) with NaN (float pools) or seeded
                                   garbage bytes: a transport that writes nothing leaves them poisoned,
                                   instead of holding an earlier run's KV of the same prompt
    scrub(pool)                    after a run was judged: NaN -> 0 all over the pool, so a poisoned
                                   block a broken run left behind cannot leak into the next run
    step_logits(engine, req)       step the engine until `req` (added or adopted) finishes: the logits
                                   of each of its steps, to compare bitwise with the reference's
    FAULTS / parse_fault / break_sender   the sender side's deliberate faults (tests only):
        skip-block:K   every request's block K (negative: from the end) is never sent
        skip-all       nothing is sent; the transfer still reports success

The faults wrap a sender's transfer factory (`ChannelSender._new_transfer`, where every transport's
sender makes a transfer of its transfer_class) so the transport moves a Plan with runs left out; the receiver still
sees the full reservation and a clean done notice, as it would from a buggy sender.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from pdserve.workers.engine.block_pool import paired_runs
from pdserve.workers.transfer.plan import Plan

FAULTS = ("skip-block:K", "skip-all")


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_logits(engine, req) -> list:
    logits = []
    while not req.finished:
        logits += [o.logits for o in engine.step() if o.request_id == req.request_id]
    return logits


def run_seed(*parts) -> int:
    """A stable seed from the run's coordinates (str seeds hash with SHA-512, the same in every process)."""
    return random.Random("/".join(str(p) for p in parts)).randrange(2**31)


def poison(pool: torch.Tensor, blocks: list[int], seed: int) -> None:
    """pool: [layers, blocks, ...]; overwrite the given blocks of every layer."""
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    if pool.dtype.is_floating_point:
        pool.index_fill_(1, index, float("nan"))
    else:
        gen = torch.Generator().manual_seed(seed)
        shape = (pool.shape[0], len(blocks), *pool.shape[2:])
        nbytes = math.prod(shape) * pool.element_size()
        garbage = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
        pool[:, index] = garbage.view(pool.dtype).view(shape).to(pool.device)
    if pool.device.type == "cuda":  # done before another process may write into these blocks
        torch.cuda.synchronize(pool.device)


def scrub(pool: torch.Tensor) -> None:
    if pool.dtype.is_floating_point:
        torch.nan_to_num_(pool, nan=0.0)


def parse_fault(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    if text == "skip-all":
        return ("skip-all", 0)
    kind, _, arg = text.partition(":")
    if kind == "skip-block":
        try:
            return (kind, int(arg))
        except ValueError:
            pass
    raise ValueError(f"unknown fault {text!r}; choose one of {', '.join(FAULTS)} (K: a block index)")


def skip(plan: Plan, fault: tuple[str, int]) -> Plan:
    """The plan with the faulty part left out (the runs re-paired around a skipped block)."""
    kind, k = fault
    if kind == "skip-all":
        return dataclasses.replace(plan, runs=())
    pairs = [(s + i, d + i) for s, d, n in plan.runs for i in range(n)]
    del pairs[k % len(pairs)]
    return dataclasses.replace(plan, runs=tuple(paired_runs([s for s, _ in pairs], [d for _, d in pairs])))


def break_sender(sender, fault: tuple[str, int]) -> None:
    make = sender._new_transfer

    def broken(peer, plan: Plan):
        return make(peer, skip(plan, fault))

    sender._new_transfer = broken
