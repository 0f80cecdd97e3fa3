"""The sampler's arithmetic for a whole batch, on the device (sampler.py decides which rows take which
part and keeps each request's state; nothing here reads a Request, nothing here waits for the device).

    DrawParams.of(params, n_out)             the drawn rows' temperature, top-k, top-p, min-p as host arrays
    draw(x, p, generators) -> [s] int64      probabilities(), then one draw per row
    probabilities(x, p, seeded) -> [s, vocab]  temperature, top-k, min-p, top-p
    gather_logprobs(logits, targets, k)      the raw distribution's logprobs: ([m, 1 + k] values, [m, k] ids)
    Picked.start(tokens, packed)             a step's tokens (and logprobs) on their way to the host
    Picked.rows() -> [(token or -1, (logprob, top ids, top logprobs) or None)]   once they are there

The draw is the per-request draw it replaced, batched, operation for operation, so a seeded request
draws the very tokens it drew before (tests/test_sampling_batched.py holds the old draw as its
oracle): (x - max) / temperature; -inf below the k-th largest; softmax; min_p drops the tokens less
likely than min_p x the top one's and renormalises; top_p keeps the smallest prefix of the sorted
probabilities that reaches it and renormalises; then the token is argmax(probs / q), q ~ Exp(1) per
token: what torch.multinomial(probs, 1) computes (its one-sample path), so q is drawn as it drew it,
`exponential_` over the row, from the request's own generator for a seeded row. Every element-wise
step, max, softmax, top-k and sort computes each row alone whatever the batch; two reductions do
not: a sum or a cumulative sum over [s, vocab] may associate differently from one over [vocab] (the
CPU splits a long row across threads, CUDA scans a lone row with another kernel), so a seeded row's
sums and cumulative sums are taken over that row alone ([1, vocab]): the same bits whatever shares
its batch, and the same as the per-request draw. Unseeded rows take the batched ones.

On CUDA a tensor divided by a host scalar is multiplied by the scalar's float32 reciprocal
(PyTorch's div_true_kernel_cuda), which is what dividing a row by its Python temperature did: the
batched division does the same there (`divided`). Checked bit for bit on the CPU; the test runs on
CUDA too wherever a GPU is present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pdserve.protocol.control import LOGPROB_FLOOR
from pdserve.workers.engine.step_inputs import to_device  # through pinned memory: no wait for the stream


@dataclass
class DrawParams:
    """What the drawn rows ask, one entry per row (host arrays: built without a list per parameter)."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64, 0: off
    top_p: np.ndarray  # float32, 1: off
    min_p: np.ndarray  # float32, 0: off

    @classmethod
    def of(cls, params: list) -> "DrawParams":
        """params: each drawn row's Sampling."""
        n = len(params)
        t = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
        k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
        tp = np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)
        mp = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
        return cls(t, k, tp, mp)


def divided(x: torch.Tensor, t: np.ndarray) -> torch.Tensor:
    """x: [s, vocab] / t[:, None], as dividing each row by its Python float divides it on this device."""
    if x.device.type == "cuda":
        return x * to_device(np.float32(1.0) / t, x.device)[:, None]
    return x / to_device(t, x.device)[:, None]


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, alone: list[int]) -> torch.Tensor:
    """fn (a sum or cumulative sum over the last dimension) of x: [s, vocab], the rows in `alone`
    each taken over itself alone (see the module docstring)."""
    if len(alone) == x.shape[0]:
        return fn(x) if len(alone) == 1 else torch.cat([fn(x[i:i + 1]) for i in range(len(alone))])
    out = fn(x)
    for i in alone:
        out[i:i + 1] = fn(x[i:i + 1])
    return out


def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True)


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1)


def _rows(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask)


def _take(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    return x if len(rows) == x.shape[0] else x[to_device(rows, x.device)]


def _put(x: torch.Tensor, rows: np.ndarray, sub: torch.Tensor) -> torch.Tensor:
    if len(rows) == x.shape[0]:
        return sub
    x[to_device(rows, x.device)] = sub
    return x


def draw(x: torch.Tensor, p: DrawParams, generators: list[torch.Generator | None]) -> torch.Tensor:
    """x: [s, vocab] float32 processed logits of the drawn rows; generators: each row's, seeded for
    this token (None: the default generator) -> [s] int64 token ids."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    probs = probabilities(x, p, seeded)
    q = torch.empty_like(probs)
    if len(seeded) < len(generators):
        q.exponential_()  # the unseeded rows' (the seeded ones are drawn again below)
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    return (probs / q).argmax(dim=-1)


def probabilities(x: torch.Tensor, p: DrawParams, seeded: list[int]) -> torch.Tensor:
    """x: [s, vocab] -> [s, vocab] float32: the distribution each row draws from (seeded: the rows
    whose reductions are taken alone)."""
    vocab, dev = x.shape[1], x.device
    x = divided(x - x.amax(-1, keepdim=True), p.temperature)  # <= 0, the top exactly 0: exp() cannot overflow
    rows = _rows((p.top_k > 0) & (p.top_k < vocab))
    if len(rows):
        sub, k = _take(x, rows), p.top_k[rows]
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, to_device(k - 1, dev)[:, None])
        x = _put(x, rows, sub.masked_fill(sub < kth, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    rows = _rows(p.min_p > 0.0)
    if len(rows):  # the top token's probability is the row's max; the top token always stays
        sub = _take(probs, rows)
        sub = sub.masked_fill(sub < to_device(p.min_p[rows], dev)[:, None] * sub.amax(-1, keepdim=True), 0.0)
        probs = _put(probs, rows, sub / rowwise(_sum, sub, _alone(rows, seeded)))
    rows = _rows(p.top_p < 1.0)
    if len(rows):
        sub = _take(probs, rows)
        alone = _alone(rows, seeded)
        ordered, order = sub.sort(dim=-1, descending=True)
        cum = rowwise(_cumsum, ordered, alone)
        drop = cum - ordered > to_device(p.top_p[rows], dev)[:, None]  # keep the smallest prefix reaching top_p
        sub = torch.zeros_like(sub).scatter_(1, order, ordered.masked_fill(drop, 0.0))
        probs = _put(probs, rows, sub / rowwise(_sum, sub, alone))
    return probs


def _alone(rows: np.ndarray, seeded: list[int]) -> list[int]:
    """The positions within `rows` of the seeded rows."""
    where = {int(r): j for j, r in enumerate(rows)}
    return [where[i] for i in seeded if i in where]


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [m, vocab], targets: [m] -> ([m, 1 + k] float32: the target's logprob, then the k most
    likely tokens'; -inf and NaN as LOGPROB_FLOOR), [m, k] int64: those tokens), on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
    else:
        top_lp = lp.new_empty(len(targets), 0)
        top_ids = torch.empty(len(targets), 0, dtype=torch.long, device=lp.device)
    return torch.cat([chosen, top_lp], dim=1).clamp(LOGPROB_FLOOR, 0.0).nan_to_num(nan=LOGPROB_FLOOR), top_ids


@dataclass
class Picked:
    """A step's tokens chosen on the device and their copy to the host, one copy for the lot:
    `packed` is [K] int64 token ids (-1: its logits were not finite) when no row asked for logprobs,
    else [K, 2 + 2k] float64 rows [token id, its logprob, the k top logprobs, the k top ids] (ids
    below 2**53 and float32 logprobs are exact in it)."""

    tokens: torch.Tensor  # [K] int64 on the device: a valid id in every row (the next step's input: overlap.feed)
    host: torch.Tensor  # `packed` on the host (pinned on CUDA): valid once `event` has passed
    event: object | None  # torch.cuda.Event recorded after the copy (None: on the host already)
    k: int  # top logprobs per row in `host`
    failed: dict = field(default_factory=dict)  # row -> the error the sampler knew of at pick time

    @classmethod
    def start(cls, tokens: torch.Tensor, packed: torch.Tensor, k: int, failed: dict) -> "Picked":
        if packed.device.type != "cuda":
            return cls(tokens, packed, None, k, failed)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(tokens, host, event, k, failed)

    def rows(self) -> list[tuple[int, tuple[float, list[int], list[float]] | None]]:
        """Wait for the copy; per row (token id or -1, (its logprob, top ids, top logprobs) or None)."""
        if self.event is not None:
            self.event.synchronize()
        if self.host.dim() == 1:
            return [(t, None) for t in self.host.tolist()]
        k = self.k
        return [(int(row[0]), (row[1], [int(t) for t in row[2 + k:]], row[2:2 + k])) for row in self.host.tolist()]
