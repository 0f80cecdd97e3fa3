"""Turning one step's logits into one token per request, each request on its own.

    sample(logits, requests)            -> a token id (or that request's SamplingError) per row
    token_logprobs(logits, reqs, toks)  -> each asking row's TokenLogprobs (None for the others)
    logprobs_of(logits, targets, k)     -> TokenLogprobs per row (the runner's prompt logprobs too)

Processing first, only for the rows that need it (the common case, no penalties, masks or bias and
min_tokens reached, costs nothing extra): logit_bias added (OpenAI's), every token outside
allowed_token_ids (a mask built at the request's first step and kept with it) and each bad word's
next token (vLLM's: the word's last token where the output ends with the ones before it) masked to
-inf; min_tokens masks EOS and stop_token_ids to -inf until reached; repetition_penalty (vLLM/HF:
every token of the prompt or the output, logit / r if > 0 else * r), then frequency_penalty * count
and presence_penalty * (count > 0) subtracted (OpenAI: output tokens only). The counts are per-row
[rows, vocab] tensors built on the device for those rows alone, each step, from the request's own
tokens (so a decode worker that adopted a request counts exactly what the colocated run counts).

Greedy rows take one batched max, which also checks every row: a row holding NaN or +inf (its max
is not finite) fails that request alone. Sampled rows apply temperature, top-k and top-p, then
draw; min_p (vLLM's) drops the tokens less likely than min_p x the top one's probability, after
top-k and before top-p. A seeded request draws its n-th token from a generator seeded with (seed,
n), so it gives the same tokens whatever shares its batch, and whether its first token was drawn on
a prefill worker and the rest on a decode worker or all in one place.

Logprobs are of the raw logits (log_softmax before processing, temperature, top-k/p: vLLM's default
`raw_logprobs`), so they do not depend on how the token was chosen; -inf is reported as
LOGPROB_FLOOR (-9999, as vLLM does: JSON has no -inf).

One request cannot fail another: whatever goes wrong computing one row comes back as a
SamplingError in that row's place, and the other rows are tokens as if it were not there (a batched
processing step that raises is redone row by row, so only the row at fault fails). The draw is
kept numerically safe before it starts, not caught after (on CUDA, multinomial over NaN
probabilities is a device-side assert that ends the process): the row is finite, and the
temperature divides (row - max), so the top logit is exactly 0 and no temperature in range
overflows (1e-40 gives the argmax, as greedy would).
"""

from __future__ import annotations

from typing import Iterable

import torch

from pdserve.workers.engine.request import Request
from pdserve.protocol.control import LOGPROB_FLOOR, TokenLogprobs


class SamplingError(RuntimeError):
    """One request's token could not be computed; the message names the request and why."""


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: Iterable[int] = ()):
        self.device = device
        self.eos_token_ids = sorted(set(eos_token_ids))

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int | SamplingError]:
        """logits: [len(requests), vocab] float32 -> a token id (or the error) per request, in order."""
        logits, failed = self.process(logits, requests)
        top, tokens = logits.max(dim=-1)  # NaN propagates into the max: one reduction checks the row
        out: list[int | SamplingError] = torch.where(top.isfinite(), tokens, -1).tolist()
        for i, r in enumerate(requests):
            if i in failed:
                out[i] = failed[i]
            elif out[i] < 0:
                out[i] = not_finite(r)
            elif not r.params.greedy:
                try:
                    out[i] = self._draw(logits[i], r)
                except Exception as e:  # this request's draw, not the batch's
                    out[i] = SamplingError(f"request {r.request_id}: sampling generated token {len(r.output_ids)} "
                                           f"failed: {type(e).__name__}: {e}")
        return out

    # ---- processing: min_tokens, penalties ----------------------------------------------------------

    def plain(self, r: Request) -> bool:
        """The top token, with nothing applied to the logits and nothing reported beside the token:
        it can be chosen on the device and read back a step later (overlap.py)."""
        p = r.params
        return (p.greedy and not self._needs_processing(r) and p.logprobs is None and p.prompt_logprobs is None
                and not r.return_logits)

    def _needs_processing(self, r: Request) -> bool:
        return r.params.penalized or r.params.masked or len(r.output_ids) < r.params.min_tokens

    def process(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, dict[int, SamplingError]]:
        """The logits to choose from (the input itself when no row needs processing) and the rows
        whose processing failed."""
        rows = [i for i, r in enumerate(requests) if self._needs_processing(r)]
        if not rows:
            return logits, {}
        logits = logits.clone()  # the runner's tensor is an inference tensor, and the caller's
        try:
            logits[rows] = self._processed(logits[rows], [requests[i] for i in rows])
            return logits, {}
        except Exception:  # redo row by row: only the row at fault fails
            failed = {}
            for i in rows:
                try:
                    logits[i] = self._processed(logits[i:i + 1], [requests[i]])[0]
                except Exception as e:
                    failed[i] = SamplingError(f"request {requests[i].request_id}: applying its penalties or "
                                              f"min_tokens failed: {type(e).__name__}: {e}")
            return logits, failed

    def _processed(self, rows: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """rows: [m, vocab] float32 of the requests that need processing -> the processed rows."""
        vocab = rows.shape[1]
        dev = rows.device
        if any(r.params.masked for r in reqs):
            rows = self._masked(rows, reqs)
        for j, r in enumerate(reqs):  # min_tokens: a few ids per row
            if len(r.output_ids) < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                if banned:
                    rows[j, torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
        pen = [j for j, r in enumerate(reqs) if r.params.penalized]
        if not pen:
            return rows
        preqs = [reqs[j] for j in pen]
        sub = rows[pen]
        counts = token_counts([r.output_ids for r in preqs], vocab, dev)  # [p, vocab] float32
        rep = torch.tensor([r.params.repetition_penalty for r in preqs], device=dev)[:, None]
        if (rep != 1.0).any():
            seen = (token_counts([r.prompt_ids for r in preqs], vocab, dev) > 0) | (counts > 0)
            seen &= rep != 1.0
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([r.params.frequency_penalty for r in preqs], device=dev)[:, None]
        presence = torch.tensor([r.params.presence_penalty for r in preqs], device=dev)[:, None]
        sub = sub - freq * counts - presence * (counts > 0).float()
        rows[pen] = sub
        return rows

    @staticmethod
    def _masked(rows: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """rows: [m, vocab] -> logit_bias added, then -inf outside allowed_token_ids and on the bad words'
        next tokens; one indexed write each, over the rows that asked."""
        vocab, dev = rows.shape[1], rows.device
        bias = [(j, r.params.logit_bias) for j, r in enumerate(reqs) if r.params.logit_bias]
        if bias:
            at = torch.tensor([j for j, b in bias for _ in b], dtype=torch.long, device=dev)
            ids = torch.tensor([t for _, b in bias for t in b], dtype=torch.long, device=dev)
            vals = torch.tensor([v for _, b in bias for v in b.values()], dtype=rows.dtype, device=dev)
            rows = rows.index_put((at, ids), vals, accumulate=True)
        allowed = [j for j, r in enumerate(reqs) if r.params.allowed_token_ids]
        if allowed:
            keep = torch.stack([allowed_mask(reqs[j], vocab, dev) for j in allowed])  # [a, vocab] bool
            at = torch.tensor(allowed, dtype=torch.long, device=dev)
            rows[at] = rows[at].masked_fill(~keep, float("-inf"))
        banned = [(j, w[-1]) for j, r in enumerate(reqs) for w in r.params.bad_words_ids
                  if len(w) == 1 or r.output_ids[-(len(w) - 1):] == w[:-1]]
        if banned:
            at, ids = torch.tensor(banned, dtype=torch.long, device=dev).T
            rows[at, ids] = float("-inf")
        return rows

    # ---- drawing ------------------------------------------------------------------------------------

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        row = (row.float() - row.max()) / p.temperature  # <= 0, the top exactly 0: exp() cannot overflow
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0.0:  # the top token's probability is probs.max(); the top token always stays
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
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

    # ---- logprobs -----------------------------------------------------------------------------------

    def token_logprobs(self, logits: torch.Tensor, requests: list[Request],
                       tokens: list[int | SamplingError]) -> list[TokenLogprobs | SamplingError | None]:
        """The logprobs of each sampled token whose request asked (Sampling.logprobs), from the raw
        logits; None for the other rows (and for failed ones); a SamplingError where they could not be
        computed (batched first; if that raises, row by row, so only the row at fault fails)."""
        rows = [i for i, (r, t) in enumerate(zip(requests, tokens))
                if r.params.logprobs is not None and not isinstance(t, SamplingError)]
        out: list[TokenLogprobs | SamplingError | None] = [None] * len(requests)
        if not rows:
            return out
        try:
            groups = [(rows, self._logprobs(logits, requests, tokens, rows))]
        except Exception:
            groups = []
            for i in rows:
                try:
                    groups.append(([i], self._logprobs(logits, requests, tokens, [i])))
                except Exception as e:
                    out[i] = SamplingError(f"request {requests[i].request_id}: the logprobs of generated token "
                                           f"{len(requests[i].output_ids)} failed: {type(e).__name__}: {e}")
        for part, lps in groups:
            for i, lp in zip(part, lps):
                want = requests[i].params.logprobs
                out[i] = lp if len(lp.top_ids) == want else TokenLogprobs(lp.logprob, lp.top_ids[:want],
                                                                          lp.top_logprobs[:want])
        return out

    @staticmethod
    def _logprobs(logits, requests, tokens, rows: list[int]) -> list[TokenLogprobs]:
        k = max(requests[i].params.logprobs for i in rows)
        targets = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=logits.device)
        return logprobs_of(logits[rows], targets, k)


def token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab] float32: how often each token occurs in each list (built on the device; the
    lists are padded with an extra column that is dropped)."""
    width = max((len(x) for x in ids), default=0)
    out = torch.zeros(len(ids), vocab + 1, device=device)
    if width:
        pad = torch.tensor([x + [vocab] * (width - len(x)) for x in ids], dtype=torch.long, device=device)
        out.scatter_add_(1, pad, torch.ones(pad.shape, device=device))
    return out[:, :vocab]


def allowed_mask(r: Request, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool: the tokens r may generate (its allowed_token_ids), built at its first step and kept
    with the request, so a step costs the same whatever the list's length. An id outside the vocabulary
    raises (that request fails, alone)."""
    mask = r.allowed_mask
    if mask is None or mask.shape[0] != vocab or mask.device != device:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[torch.tensor(r.params.allowed_token_ids, dtype=torch.long, device=device)] = True
        r.allowed_mask = mask
    return mask


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logits: [m, vocab], targets: [m] token ids -> per row the target's logprob and the k most
    likely tokens' (one device-to-host copy for the lot)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])[:, 0]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
    else:
        top_lp = top_ids = torch.empty(len(targets), 0, device=lp.device)
    vals = torch.cat([chosen[:, None], top_lp], dim=1).clamp(LOGPROB_FLOOR, 0.0).nan_to_num(nan=LOGPROB_FLOOR).tolist()
    ids = top_ids.long().tolist()
    return [TokenLogprobs(v[0], i, v[1:]) for v, i in zip(vals, ids)]


def not_finite(r: Request) -> SamplingError:
    """The error of a request whose logits hold NaN or inf: no token can be chosen."""
    return SamplingError(f"request {r.request_id}: its logits are not finite (NaN or inf) at "
                         f"generated token {len(r.output_ids)}; no token can be chosen")
