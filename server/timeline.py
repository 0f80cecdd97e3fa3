"""One request's timeline, assembled from the stamps each process took on its own clock.

The router's stamps (Clock) and each worker's (P.Timeline.stamps, by name) are subtracted only from
stamps of the same process, as the rows of protocol/phases.py name them, so clock offsets between hosts
cannot bend the numbers:

    ttft_phases_ms       the time to first token split into the phases of protocol/phases.py; they
                         sum to ttft_ms (what could not be split is `unattributed`, never hidden)
    queue_ms             parse + route + inbox + prefill_queue: arrival -> prefill start, less the
                         request's flight to the worker
    prefill_ms           prefill (or colocated) worker, one forward over the prompt
    transfer_ms          prefill worker: first copy issued -> last copy complete
    transfer_exposed_ms  prefill worker: prefill end -> last copy complete, before "kv done" is sent (what TTFT pays)
    first_decode_step_ms decode (or colocated) worker: the step that makes token 2
    ttft_ms, e2e_ms      router: arrival -> token 1 handed to the response, -> last token received
    decode_tokens_per_s  router: tokens after the first / (last token - first token)

The router's stamps (Clock) cut its part of token 1's path: arrival | parse | prepared | route |
dispatched | ... workers ... | token1_landed | first_token. Between dispatched and token1_landed the
workers' own stretches (each phase's worker spans) are subtracted from the router's round trip, and what
is left is the messages' flight (`hops`): every stretch the workers report is disjoint from the others and from
the flights, so hops >= 0 (zmq, where the prefill worker's "kv_delivered" is the decode worker's ack, is
the one exception: the ack's flight back is inside transfer_exposed and short of hops; with nixl,
the decode worker's wait for the write notifications after the done notice is in hops). The first
decode step makes token 2; it is inside e2e_ms, never inside ttft_ms (token 1 comes from prefill).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from pdserve.protocol import phases as PH
from pdserve.protocol import control as P
from pdserve.protocol.phases import ms
from pdserve.protocol.enums import TIERS
from pdserve.protocol.timings import Timings


@dataclass
class Clock:
    """Router-side stamps of one request, time.monotonic() seconds."""

    arrival: float
    prepared: float | None = None  # parsed, tokenized (the plan, policy and workers, is made after)
    dispatched: float | None = None  # Generate (colocated) or Prefill (disaggregated) about to be sent
    token1_landed: float | None = None  # token 1's message read off the router's socket (the reader thread)
    first_token: float | None = None  # token 1 handed to the response
    last_token: float | None = None

    @classmethod
    def start(cls) -> "Clock":
        return cls(time.monotonic())


def ttft_phases(clock: Clock, prefilled_by: P.Timeline | None, token1_by: P.Timeline | None,
                disaggregated: bool) -> dict[str, float | None]:
    """The split of ttft_ms (ms, in PH.NAMES order), each phase from its row. `prefilled_by`: the timeline
    of the worker that prefilled; `token1_by`: of the worker that sent token 1 (the same one when colocated)."""
    sides = _sides(clock, prefilled_by, token1_by)
    out: dict[str, float | None] = {}
    inside: list[float | None] = []  # every stretch a worker spent on token 1's path
    for p in PH.PHASES:
        if p.disaggregated_only and not disaggregated or p.less_workers or not p.spans:
            out[p.name] = None  # not on this path, or what is left (below)
            continue
        parts = [_span(sides, s) for s in p.spans]
        inside += [v for s, v in zip(p.spans, parts) if s.side != PH.ROUTER]
        out[p.name] = _sum(*parts)
    complete = all(v is not None for v in inside)
    for p in PH.PHASES:
        if p.less_workers:  # the round trip less the time inside the workers: the messages' flight
            trip = _sum(*(_span(sides, s) for s in p.spans))
            out[p.name] = trip - sum(inside) if trip is not None and complete else None
    ttft = _span(sides, PH.TTFT)
    out[PH.UNATTRIBUTED] = None if ttft is None else ttft - PH.total_ms(out)
    return {name: _r(out[name]) for name in PH.NAMES}


def timings(*, policy: str, clock: Clock, prompt_tokens: int, completion_tokens: int, worker: str,
            prefilled_by: P.Timeline | None, decoded_by: P.Timeline | None,
            prefill: P.PrefillDone | None = None, prefill_worker: str | None = None,
            transport: str | None = None, mode: str | None = None, kv_skipped_tokens: int = 0) -> Timings:
    """A finished request's Timings (ms unless named otherwise)."""
    disaggregated = prefill is not None
    phases = ttft_phases(clock, prefilled_by, decoded_by, disaggregated)
    sides = _sides(clock, prefilled_by, decoded_by)
    decode_s = None if clock.first_token is None or clock.last_token is None else clock.last_token - clock.first_token
    tps = (completion_tokens - 1) / decode_s if completion_tokens > 1 and decode_s else None
    pre = prefilled_by
    cached = pre.cached_tokens if pre is not None else None
    return Timings(
        **as_measured(pre),
        policy=policy,
        queue_ms=_r(_sum(*(phases[k] for k in PH.QUEUE))),
        **{f"{name}_ms": phases[name] for name in AS_PHASE},
        transfer_ms=_r(prefill.transfer_ms) if disaggregated else None,
        first_decode_step_ms=_r(_span(sides, PH.FIRST_STEP)),
        ttft_ms=_r(_span(sides, PH.TTFT)),
        e2e_ms=_r(_span(sides, PH.E2E)),
        ttft_phases_ms=phases,
        decode_tokens_per_s=_r(tps),
        kv_bytes=prefill.kv_bytes if disaggregated else 0,
        transport=transport if disaggregated else None,
        mode=mode if disaggregated else None,
        prefill_worker=prefill_worker if disaggregated else None,
        decode_worker=worker if disaggregated else None,
        worker=worker,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        # the prefix cache: the prompt tokens the computing worker computed (cached_tokens: those whose KV
        # it reused, as measured), and (disaggregated) those the decode worker held already, not transferred
        recomputed_tokens=None if cached is None else prompt_tokens - cached,
        reused_tokens=None if cached is None else reused(cached, pre.tier_tokens),
        kv_skipped_tokens=kv_skipped_tokens if disaggregated else None,
    )


# A worker's Timeline field that has a Timings field of the same name is reported as the worker that
# prefilled measured it (cached_tokens, reload_ms): a new one is a field in each struct and the line that
# measures it; what the router composes (the phases, queue_ms, ...) timings() writes out.
AS_MEASURED = tuple(f.name for f in fields(Timings) if f.name in P.Timeline.__struct_fields__)
# A phase that has a Timings field of its name + "_ms" is reported there too (prefill_ms, transfer_exposed_ms).
AS_PHASE = tuple(name for name in PH.NAMES if f"{name}_ms" in {f.name for f in fields(Timings)})


def as_measured(timeline: P.Timeline | None) -> dict:
    if timeline is None:
        return {}
    return {name: _r(v) if isinstance(v := getattr(timeline, name), float) else v for name in AS_MEASURED}


def _sides(clock: Clock, prefilled_by: P.Timeline | None, token1_by: P.Timeline | None) -> dict[str, dict]:
    """Each side's stamps by name (protocol/phases.py's sides)."""
    return {PH.ROUTER: vars(clock), PH.PREFILLING: (prefilled_by or P.Timeline()).stamps,
            PH.TOKEN1: (token1_by or P.Timeline()).stamps}


def _span(sides: dict[str, dict], span: PH.Span) -> float | None:
    """Milliseconds between two stamps of one side; None if either is missing."""
    stamps = sides[span.side]
    return ms(stamps.get(span.start), stamps.get(span.end))


def _sum(*parts: float | None) -> float | None:
    """Sum of the parts that are known; None if none is."""
    known = [p for p in parts if p is not None]
    return sum(known) if known else None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def reused(cached: int, tier_tokens: dict[str, int]) -> dict[str, int]:
    """timings.reused_tokens: of the cached prompt tokens, those reloaded from each tier below the worker's
    pool (its Timeline's tier_tokens), the rest its pool's own ("device")."""
    tiers = {t: tier_tokens.get(t, 0) for t in TIERS}
    return {"device": cached - sum(tiers.values()), **tiers}
