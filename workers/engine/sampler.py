"""Turning one step's logits into one token per request.

Greedy rows take one batched argmax. Sampled rows apply temperature, top-k and top-p,
then draw. A seeded request draws its n-th token from a generator seeded with (seed, n),
so it gives the same tokens whatever shares its batch, and whether its first token was
drawn on a prefill worker and the rest on a decode worker or all in one place.
"""

from __future__ import annotations

import torch

from workers.engine.request import Request


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        # logits: [B, vocab] float32
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if not sampled_rows:
            return tokens.tolist()
        out = tokens.tolist()
        for i in sampled_rows:
            out[i] = self._draw(logits[i], requests[i])
        return out

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        row = row.float() / p.temperature
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
        gen.manual_seed(req.params.seed * 1_000_003 + len(req.output_ids))
        return gen
