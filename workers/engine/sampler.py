"""Turning one step's logits into one token per request, on the device for the whole batch, each
request by its own parameters; nothing here waits for the device.

    pick(logits, requests, prev) -> Picked   the tokens (and the asked logprobs) chosen on the device,
                                             their one copy to the host under way
    results(picked, requests)                once read back: per row (token id or that request's
                                             SamplingError, its TokenLogprobs or None)
    sample(logits, requests)                 pick and read back: a token id (or SamplingError) per row
    process(logits, requests)                the processed logits alone, and the rows that failed (tests)
    logprobs_of(logits, targets, k)          TokenLogprobs per row, read back (the runner's prompt logprobs)

Processing first, only for the rows that need it (the common case, no penalties, masks or bias and
min_tokens reached, costs nothing extra): logit_bias added (OpenAI's), every token outside
allowed_token_ids and each bad word's next token (vLLM's: the word's last token where the output
ends with the ones before it) masked to -inf; min_tokens masks EOS and stop_token_ids to -inf until
reached; repetition_penalty (vLLM/HF: every token of the prompt or the output, logit / r if > 0 else
* r), then frequency_penalty * count and presence_penalty * (count > 0) subtracted (OpenAI: output
tokens only).

What a request needs across steps is built at its first token that needs it and kept with it
(RowState, `Request.sampler_state`): its bias row and banned tokens ([vocab] tensors: a step costs
the same whatever the lists' length), its penalty counts, its generator. The counts live on the
device and grow there by each token as it is picked, so a step can be picked before the step
before it is read back (overlap.py: that token is PENDING on the host). The one thing that reads
the output's tail, a bad word of several tokens, compares the host's known tokens there and the
token still on the device (`prev`, the step in flight) on the device.

Greedy rows take one batched max, which also checks every row: a row holding NaN or +inf (its max
is not finite) fails that request alone. Drawn rows apply temperature, top-k, min-p (vLLM's: drops
the tokens less likely than min_p x the top one's probability) and top-p, then draw
(sampling_device.draw: the per-request draw this replaced, batched, bit for bit). A seeded request
draws its n-th token from its generator seeded with (seed, n), n counting the token still on the
device, so it gives the same tokens whatever shares its batch, whether its steps overlapped or not,
and whether its first token was drawn on a prefill worker and the rest on a decode worker or all in
one place.

Logprobs are of the raw logits (log_softmax before processing, temperature, top-k/p: vLLM's default
`raw_logprobs`), so they do not depend on how the token was chosen; gathered on the device and
copied back with the tokens; -inf is reported as LOGPROB_FLOOR (-9999, as vLLM does: JSON has no -inf).

One request cannot fail another: a request whose state cannot be built (an id outside the
vocabulary) fails alone, and a batched pick that raises is redone row by row, so only the row at
fault fails, its SamplingError naming what failed. The draw is kept numerically safe before it
starts, not caught after: temperature divides (row - max), so the top logit is exactly 0 and no
temperature in range overflows; the draw's argmax needs no valid distribution (nothing asserts on
the device), and a row that is not finite is failed from the max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from pdserve.protocol.control import TokenLogprobs
from pdserve.workers.engine.request import PENDING, Request
from pdserve.workers.engine.sampling_device import DrawParams, Picked, draw, gather_logprobs, to_device

# what a row's pick was doing when it failed, as its error says it
PROCESS, DRAW, LOGPROBS = "applying its penalties or min_tokens", "sampling generated token {n}", \
    "the logprobs of generated token {n}"


class SamplingError(RuntimeError):
    """One request's token could not be computed; the message names the request and why."""


class _Stage(Exception):
    def __init__(self, stage: str, cause: Exception):
        super().__init__(stage)
        self.stage, self.cause = stage, cause

    def error(self, r: Request) -> SamplingError:
        what = self.stage.format(n=len(r.output_ids))
        return SamplingError(f"request {r.request_id}: {what} failed: {type(self.cause).__name__}: {self.cause}")


@dataclass(eq=False)
class RowState:
    """The sampler's tensors for one request, on the device (see the module docstring)."""

    vocab: int
    device: torch.device
    bias: torch.Tensor | None = None  # [vocab] float32: logit_bias, 0 elsewhere
    ban: torch.Tensor | None = None  # [vocab] bool: outside allowed_token_ids, or a one-token bad word
    long_words: tuple = ()  # bad words of several tokens: banned by what the output ends with
    counts: torch.Tensor | None = None  # [vocab] float32: its output tokens so far (penalties)
    prompt_seen: torch.Tensor | None = None  # [vocab] bool: its prompt's tokens (repetition_penalty)
    generator: torch.Generator | None = None  # seeded for each token drawn

    @classmethod
    def build(cls, r: Request, vocab: int, device: torch.device) -> "RowState":
        p = r.params
        st = cls(vocab, device)
        if p.logit_bias:
            ids = _ids_in(vocab, "logit_bias", list(p.logit_bias))
            st.bias = torch.zeros(vocab, device=device)
            st.bias[ids] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).to(device)
        one = [w[0] for w in p.bad_words_ids if len(w) == 1]
        if p.allowed_token_ids or one:
            st.ban = torch.zeros(vocab, dtype=torch.bool, device=device)
            if p.allowed_token_ids:
                st.ban[_ids_in(vocab, "allowed_token_ids", p.allowed_token_ids)] = True
                st.ban = ~st.ban
            if one:
                st.ban[_ids_in(vocab, "bad_words", one)] = True
        st.long_words = tuple(list(w) for w in p.bad_words_ids if len(w) > 1)
        _ids_in(vocab, "bad_words", [t for w in st.long_words for t in w])
        if p.penalized:
            if PENDING in r.output_ids:
                raise RuntimeError("its penalty counts were first asked for with a token still on the device")
            st.counts = token_counts([r.output_ids], vocab, device)[0]
            if p.repetition_penalty != 1.0:
                st.prompt_seen = token_counts([r.prompt_ids], vocab, device)[0] > 0
        if p.seed is not None and not p.greedy:
            st.generator = torch.Generator(device=device)
        return st


def _ids_in(vocab: int, what: str, ids: list[int]) -> torch.Tensor:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} {bad[:5]} outside the vocabulary (0..{vocab - 1})")
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class _Rows:
    """Which rows of a pick take which part, found in one pass over the requests."""

    proc: list[int]  # processed: penalties, masks, bias, min_tokens
    drawn: list[int]  # not greedy
    asks: list[int]  # logprobs
    pen: list[int]  # penalty counts to grow
    stateful: list[int]  # keep a RowState
    k: int | None  # the most top logprobs a row asks for (None: no row asks)

    @classmethod
    def of(cls, reqs: list[Request]) -> "_Rows":
        rows = cls([], [], [], [], [], None)
        for j, r in enumerate(reqs):
            p = r.params
            penalized, masked, drawn = p.penalized, p.masked, not p.greedy
            if penalized or masked or len(r.output_ids) < p.min_tokens:
                rows.proc.append(j)
            if drawn:
                rows.drawn.append(j)
            if p.logprobs is not None:
                rows.asks.append(j)
                rows.k = max(rows.k or 0, p.logprobs)
            if penalized:
                rows.pen.append(j)
            if penalized or masked or (drawn and p.seed is not None):
                rows.stateful.append(j)
        return rows

    def without(self, skip: dict) -> "_Rows":
        """These rows, less those in `skip` (they take no part; `k` stays: the packed width)."""
        keep = [[j for j in part if j not in skip] for part in (self.proc, self.drawn, self.asks, self.pen)]
        return _Rows(*keep, [j for j in self.stateful if j not in skip], self.k)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(np.asarray(rows, dtype=np.int64), device)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: Iterable[int] = ()):
        self.device = device
        self.eos_token_ids = sorted(set(eos_token_ids))

    # ---- the step's call --------------------------------------------------------------------------

    def pick(self, logits: torch.Tensor, requests: list[Request], prev=None) -> Picked:
        """logits: [len(requests), vocab] float32 -> their tokens, chosen on the device (see the module
        docstring). prev: the step in flight (overlap.Inflight: its `tokens` and `index`), whose tokens
        the requests' outputs end with as PENDING; None when every token is on the host."""
        failed: dict[int, SamplingError] = {}
        rows = _Rows.of(requests)
        states = self._states(requests, rows.stateful, logits.shape[1], failed)
        if failed:
            rows = rows.without(failed)
        try:
            tokens, packed = self._pick(logits, requests, states, prev, rows)
        except _Stage:  # redo row by row: only the row at fault fails
            parts = [self._pick_alone(logits, requests, states, prev, rows.k, failed, j) for j in range(len(requests))]
            tokens, packed = torch.cat([t for t, _ in parts]), torch.cat([p for _, p in parts])
        return Picked.start(tokens, packed, rows.k or 0, failed)

    def results(self, picked: Picked, requests: list[Request]) -> list[tuple[int | SamplingError, TokenLogprobs | None]]:
        """Wait for the picked tokens; per request its token (or SamplingError) and the logprobs it asked for."""
        out: list[tuple[int | SamplingError, TokenLogprobs | None]] = []
        for j, (r, (token, lp)) in enumerate(zip(requests, picked.rows())):
            want = r.params.logprobs
            if j in picked.failed:
                out.append((picked.failed[j], None))
            elif token < 0:
                out.append((not_finite(r), None))
            else:
                out.append((token, None if want is None else TokenLogprobs(lp[0], lp[1][:want], lp[2][:want])))
        return out

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int | SamplingError]:
        """logits: [len(requests), vocab] float32 -> a token id (or the error) per request, read back."""
        return [token for token, _ in self.results(self.pick(logits, requests), requests)]

    def process(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, dict[int, SamplingError]]:
        """The logits to choose from (the input itself when no row needs processing) and the rows
        whose state could not be built."""
        failed: dict[int, SamplingError] = {}
        rows = _Rows.of(requests)
        states = self._states(requests, rows.stateful, logits.shape[1], failed)
        proc = rows.without(failed).proc
        return (self._process_rows(logits, proc, requests, states, None) if proc else logits), failed

    # ---- one pick ---------------------------------------------------------------------------------

    def _states(self, requests: list[Request], stateful: list[int], vocab: int,
                failed: dict[int, SamplingError]) -> list[RowState | None]:
        """Each request's RowState (None for those that keep none), built for those that need one now."""
        out: list[RowState | None] = [None] * len(requests)
        for j in stateful:
            r = requests[j]
            st = r.sampler_state
            if st is None or st.vocab != vocab or st.device != self.device:
                try:
                    st = r.sampler_state = RowState.build(r, vocab, self.device)
                except Exception as e:  # this request's parameters, not the batch's
                    failed[j] = _Stage(PROCESS, e).error(r)
                    continue
            out[j] = st
        return out

    def _pick(self, logits, reqs: list[Request], states, prev, rows: _Rows):
        """-> (tokens [K] int64, packed: [K] int64 or [K, W] float64) on the device (Picked's layout);
        raises _Stage."""
        x, k = logits, rows.k
        if rows.proc:
            try:
                x = self._process_rows(logits, rows.proc, reqs, states, prev)
            except Exception as e:
                raise _Stage(PROCESS, e) from e
        top, tokens = x.max(dim=-1)  # NaN propagates into the max: one reduction checks the row
        ok = top.isfinite()
        if rows.drawn:
            every = len(rows.drawn) == len(reqs)
            try:
                chosen = self._draw(x if every else x[_index(rows.drawn, x.device)], [reqs[j] for j in rows.drawn])
            except Exception as e:
                raise _Stage(DRAW, e) from e
            if every:
                tokens = chosen
            else:
                tokens[_index(rows.drawn, x.device)] = chosen
        packed = torch.where(ok, tokens, -1)
        if k is not None:
            packed = torch.cat([packed.double()[:, None], packed.new_zeros(len(reqs), 1 + 2 * k, dtype=torch.float64)],
                               dim=1)
            if rows.asks:  # the most these rows ask for (a row redone alone asks its own), in columns for k
                at, most = _index(rows.asks, x.device), max(reqs[j].params.logprobs for j in rows.asks)
                try:
                    vals, ids = gather_logprobs(logits[at], tokens[at], most)
                except Exception as e:
                    raise _Stage(LOGPROBS, e) from e
                packed[at, 1:2 + most] = vals.double()
                packed[at, 2 + k:2 + k + most] = ids.double()
        if rows.pen:  # the chosen tokens count from the next step on, on the device (nothing read back)
            one = torch.zeros(len(rows.pen), logits.shape[1], device=x.device)
            one.scatter_(1, tokens[_index(rows.pen, x.device)][:, None], 1.0)
            torch._foreach_add_([states[j].counts for j in rows.pen], list(one.unbind(0)))
        return tokens, packed

    def _pick_alone(self, logits, requests, states, prev, k: int | None, failed: dict[int, SamplingError], j: int):
        r = requests[j]
        if j not in failed:
            rows = _Rows.of([r])
            rows.k = k  # the batch's width
            try:
                return self._pick(logits[j:j + 1], [r], states[j:j + 1], prev, rows)
            except _Stage as e:
                failed[j] = e.error(r)
        tokens = logits[j:j + 1].argmax(dim=-1)  # a valid id for the row the next step may still compute
        packed = torch.full((1,) if k is None else (1, 2 + 2 * k), -1, device=logits.device,
                            dtype=torch.long if k is None else torch.float64)
        return tokens, packed

    def _draw(self, x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """x: [s, vocab] processed logits of the drawn rows -> [s] int64 tokens."""
        generators = []
        for r in reqs:
            gen = r.sampler_state.generator if r.sampler_state is not None else None
            if gen is not None:
                # mixed within the generator's 64 bits: any seed in 0..2**63-1 works; seeds below 2**64 /
                # 1_000_003 (about 1.8e13) give the same stream as before the wrap
                gen.manual_seed((r.params.seed * 1_000_003 + len(r.output_ids)) % 2**64)
            generators.append(gen)
        return draw(x, DrawParams.of([r.params for r in reqs]), generators)

    # ---- processing: bias and masks, min_tokens, penalties ------------------------------------------

    def _process_rows(self, logits, rows: list[int], reqs, states, prev) -> torch.Tensor:
        """A copy of logits (the runner's tensor is an inference tensor, and the caller's) with `rows` processed."""
        if len(rows) == len(reqs):
            return self._processed(logits.clone(), reqs, states, prev)
        at = _index(rows, logits.device)
        out = logits.clone()
        out[at] = self._processed(logits[at], [reqs[j] for j in rows], [states[j] for j in rows], prev)
        return out

    def _processed(self, rows: torch.Tensor, reqs: list[Request], states, prev) -> torch.Tensor:
        """rows: [m, vocab] float32 of the requests that need processing (a copy) -> the processed rows."""
        dev = rows.device
        bias = [i for i, st in enumerate(states) if st is not None and st.bias is not None]
        if bias:
            rows = _with(rows, bias, lambda sub: sub + torch.stack([states[i].bias for i in bias]))
        ban = [i for i, st in enumerate(states) if st is not None and st.ban is not None]
        if ban:
            rows = _with(rows, ban, lambda sub: sub.masked_fill(torch.stack([states[i].ban for i in ban]), float("-inf")))
        if any(st is not None and st.long_words for st in states):
            rows = rows.masked_fill(self._tail_bans(rows, reqs, states, prev), float("-inf"))
        held = [(i, t) for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_tokens
                for t in list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)]
        if held:
            at, ids = _index(held, dev).T
            rows[at, ids] = float("-inf")
        pen = [i for i, r in enumerate(reqs) if r.params.penalized]
        if pen:
            rows = _with(rows, pen, lambda sub: _penalized(sub, [reqs[i] for i in pen], [states[i] for i in pen]))
        return rows

    @staticmethod
    def _tail_bans(rows: torch.Tensor, reqs: list[Request], states, prev) -> torch.Tensor:
        """[m, vocab] bool: each bad word's last token where the output ends with the word's other tokens
        (its last one may still be on the device: compared there)."""
        hits, wait = [], []  # (row, banned id); (row, banned id, index in prev.tokens, the token it must be)
        for i, (r, st) in enumerate(zip(reqs, states)):
            out = r.output_ids
            for w in (st.long_words if st is not None else ()):
                n = len(w) - 1
                if len(out) < n:
                    continue
                tail = out[len(out) - n:]
                if tail[-1] != PENDING:
                    if tail == w[:-1]:
                        hits.append((i, w[-1]))
                elif tail[:-1] == w[:-2]:
                    if prev is None or id(r) not in prev.index:
                        raise RuntimeError("its output ends with a token on the device, and no step is in flight")
                    wait.append((i, w[-1], prev.index[id(r)], w[-2]))
        dev = rows.device
        count = torch.zeros(rows.shape, device=dev)
        if hits:
            at, ids = _index(hits, dev).T
            count.index_put_((at, ids), torch.ones(len(hits), device=dev), accumulate=True)
        if wait:
            at, ids, src, want = _index(wait, dev).T
            match = (prev.tokens.index_select(0, src) == want).float()
            count.index_put_((at, ids), match, accumulate=True)
        return count > 0


def _with(rows: torch.Tensor, sel: list[int], fn) -> torch.Tensor:
    """rows with fn applied to the rows `sel` (all of them: no indexing)."""
    if len(sel) == rows.shape[0]:
        return fn(rows)
    at = _index(sel, rows.device)
    rows[at] = fn(rows[at])
    return rows


def _penalized(sub: torch.Tensor, reqs: list[Request], states: list[RowState]) -> torch.Tensor:
    """sub: [p, vocab] of the penalized requests -> repetition, frequency and presence penalties applied."""
    dev = sub.device
    counts = torch.stack([st.counts for st in states])  # [p, vocab] float32
    rep_np = np.fromiter((r.params.repetition_penalty for r in reqs), dtype=np.float32, count=len(reqs))
    if (rep_np != 1.0).any():
        rep = to_device(rep_np, dev)[:, None]
        seen = counts > 0
        asked = [i for i, st in enumerate(states) if st.prompt_seen is not None]
        if asked:
            seen = _with(seen, asked, lambda s: s | torch.stack([states[i].prompt_seen for i in asked]))
        seen &= rep != 1.0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device(np.fromiter((r.params.frequency_penalty for r in reqs), dtype=np.float32, count=len(reqs)), dev)
    presence = to_device(np.fromiter((r.params.presence_penalty for r in reqs), dtype=np.float32, count=len(reqs)), dev)
    return sub - freq[:, None] * counts - presence[:, None] * (counts > 0).float()


def token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab] float32: how often each token occurs in each list (built on the device; the
    lists are padded with an extra column that is dropped)."""
    width = max((len(x) for x in ids), default=0)
    out = torch.zeros(len(ids), vocab + 1, device=device)
    if width:
        pad = torch.tensor([x + [vocab] * (width - len(x)) for x in ids], dtype=torch.long, device=device)
        out.scatter_add_(1, pad, torch.ones(pad.shape, device=device))
    return out[:, :vocab]


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logits: [m, vocab], targets: [m] token ids -> per row the target's logprob and the k most
    likely tokens' (one device-to-host copy for the lot)."""
    vals, ids = gather_logprobs(logits, targets, k)
    return [TokenLogprobs(v[0], i, v[1:]) for v, i in zip(vals.tolist(), ids.tolist())]


def not_finite(r: Request) -> SamplingError:
    """The error of a request whose logits hold NaN or inf: no token can be chosen."""
    return SamplingError(f"request {r.request_id}: its logits are not finite (NaN or inf) at "
                         f"generated token {len(r.output_ids)}; no token can be chosen")
