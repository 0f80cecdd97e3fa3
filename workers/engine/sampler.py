"""Turning one step's logits into one token per request, each request on its own.

Greedy rows take one batched max, which also checks every row: a row holding NaN or +inf (its max
is not finite) fails that request alone. Sampled rows apply temperature, top-k and top-p, then
draw. A seeded request draws its n-th token from a generator seeded with (seed, n), so it gives
the same tokens whatever shares its batch, and whether its first token was drawn on a prefill
worker and the rest on a decode worker or all in one place.

One request cannot fail another: whatever goes wrong computing one row comes back as a
SamplingError in that row's place, and the other rows are tokens as if it were not there. The
draw is kept numerically safe before it starts, not caught after (on CUDA, multinomial over
NaN probabilities is a device-side assert that ends the process): the row is finite, and the
temperature divides (row - max), so the top logit is exactly 0 and no temperature in range
overflows (1e-40 gives the argmax, as greedy would).
"""

from __future__ import annotations

import torch

from workers.engine.request import Request


class SamplingError(RuntimeError):
    """One request's token could not be computed; the message names the request and why."""


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int | SamplingError]:
        """logits: [len(requests), vocab] float32 -> a token id (or the error) per request, in order."""
        top, tokens = logits.max(dim=-1)  # NaN propagates into the max: one reduction checks the row
        out: list[int | SamplingError] = torch.where(top.isfinite(), tokens, -1).tolist()
        for i, r in enumerate(requests):
            if out[i] < 0:
                out[i] = SamplingError(f"request {r.request_id}: its logits are not finite (NaN or inf) at "
                                       f"generated token {len(r.output_ids)}; no token can be chosen")
            elif r.params.temperature > 0:
                try:
                    out[i] = self._draw(logits[i], r)
                except Exception as e:  # this request's draw, not the batch's
                    out[i] = SamplingError(f"request {r.request_id}: sampling generated token {len(r.output_ids)} "
                                           f"failed: {type(e).__name__}: {e}")
        return out

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        row = (row.float() - row.max()) / p.temperature  # <= 0, the top exactly 0: exp() cannot overflow
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cum = sorted_probs.cumsum(0)
            drop = cum - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        gen = self._generator(req)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = torch.Generator(device=self.device)
        # mixed within the generator's 64 bits: any seed in 0..2**63-1 works (2**50 * 1_000_003 does not fit);
        # seeds below 2**64 / 1_000_003 (about 1.8e13) give the same stream as before the wrap
        gen.manual_seed((req.params.seed * 1_000_003 + len(req.output_ids)) % 2**64)
        return gen
