"""KV-aware worker choice: each candidate priced by the TTFT it would give a request, in milliseconds,
from what the workers report (their block names, server/kv_index.py; their measured costs, KVCosts).

    price(worker, tiers, prompt_tokens, fallback) -> Estimate
        queue     tokens ahead of it there x its prefill ms per token: the prompt tokens the router sent
                  it (less what it expected cached) that have no first token yet: exact and immediate,
                  where the queue a heartbeat reports (KVCosts.queued_tokens, in /health) is up to an
                  interval old and would count a finished burst against the next request
        compute   its fixed ms per prefill + the prompt tokens it does not hold x its ms per token (a line
                  the worker fits through its recent prefills)
        reload    the tokens it holds below its KV pool x KV bytes per token / that tier's measured GB/s
                  (a tier slower than recomputing is not used, as the engine decides: those are computed)
        load      one block's prefill time per request in flight there (the decode steps a colocated
                  worker's prefill shares)
    choose(workers, ...) -> Estimate    the cheapest, among the workers not overloaded (see below)

The load rule: a worker is a candidate only while its requests in flight are at most twice the least
loaded worker's plus four, so one hot prefix cannot pile every request on the worker that holds it: past
that, the request goes where it is recomputed. Prices within 10% of the cheapest's variable part (all
but the fixed ms any prefill costs) plus one block's compute are a tie: it goes to the worker chosen less
often (round robin among equals), then to the less loaded.

A worker that has not measured its prefill speed yet is priced at the others' line (the median of their
ms per token, and of their fixed ms: a worker that registered later pays what any prefill costs like the
others, or a whole prompt recomputed there would look cheaper than a few new tokens on the worker holding
the rest); when none has, tokens count as 1 ms each: the choice then follows cached tokens and queues alone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pdserve.protocol.blocks import block_names
from pdserve.protocol.enums import TIERS, Policy
from pdserve.protocol.timings import Route
from pdserve.server.kv_index import KVIndex

UNMEASURED_MS_PER_TOKEN = 1.0
OVERLOAD_FACTOR, OVERLOAD_SLACK = 2, 4  # the load rule above
TIE = 0.1  # prices within 10% of the cheapest's variable part (and one block's compute) are a tie


@dataclass
class Estimate:
    worker: object  # a WorkerState
    ttft_ms: float
    cached: dict[str, int] = field(default_factory=dict)  # tier -> prompt tokens expected from there
    uncached_tokens: int = 0
    measured: bool = True  # False: priced with another worker's (or no) prefill speed
    ms_per_token: float = UNMEASURED_MS_PER_TOKEN  # the prefill speed it was priced at
    queue_ms: float = 0.0  # of ttft_ms: the tokens ahead of it there
    fixed_ms: float = 0.0  # of ttft_ms: what any prefill costs there (the same wherever it goes)
    names: list[bytes] = field(default_factory=list)  # the prompt's full blocks, as this worker names them


def in_flight(w) -> int:
    """Requests this router has on the worker (exact, now: a heartbeat's counts are up to an interval old,
    and a finished conversation turn still counted there would push its next turn off its prefix)."""
    return len(w.inflight)


def prefill_line(workers) -> tuple[float, float] | None:
    """(ms per token, fixed ms per prefill) of the workers that measured theirs: the median of each (None:
    none has)."""
    seen = [(w.costs.prefill_ms_per_token, w.costs.prefill_ms_fixed) for w in workers
            if w.costs is not None and w.costs.prefill_ms_per_token is not None]
    if not seen:
        return None
    return statistics.median(s for s, _ in seen), statistics.median(f for _, f in seen)


def price(w, tiers: list[str], prompt_tokens: int, fallback: tuple[float, float] | None) -> Estimate:
    """`fallback`: the line (prefill_line) a worker that has not measured its own is priced at."""
    c = w.costs
    own = c.prefill_ms_per_token if c is not None else None
    if own is not None:
        per_token, fixed = own, c.prefill_ms_fixed
    else:
        per_token, fixed = fallback if fallback is not None else (UNMEASURED_MS_PER_TOKEN, 0.0)
    bs = w.info.block_size
    # the engine computes at least the last prompt token: a whole-prompt hit still prefills one
    usable = min(len(tiers), max(0, prompt_tokens - 1) // bs)
    gpu = next((i for i, t in enumerate(tiers[:usable]) if t != "gpu"), usable)
    cached = {"gpu": gpu * bs}
    reload_ms = 0.0
    for tier in TIERS:  # below the pool: the leading run after the GPU hit, tier by tier, nearest first
        n = 0
        while gpu + n < usable and tiers[gpu + n] == tier:
            n += 1
        if not n:
            continue
        gbps = c.tier_gbps.get(tier) if c is not None else None
        cost = None if gbps is None or not c.bytes_per_token else n * bs * c.bytes_per_token / (gbps * 1e6)
        if cost is not None and cost >= n * bs * per_token:
            break  # slower than recomputing: the engine computes these and everything after them
        reload_ms += cost or 0.0
        cached[tier] = n * bs
        gpu += n
    uncached = prompt_tokens - sum(cached.values())
    ahead = sum(w.pending.values())
    load_ms = in_flight(w) * bs * per_token
    ttft = fixed + (ahead + uncached) * per_token + reload_ms + load_ms
    return Estimate(w, ttft, {t: n for t, n in cached.items() if n}, uncached, own is not None, per_token,
                    ahead * per_token, fixed)


def not_overloaded(workers: list) -> list:
    least = min(in_flight(w) for w in workers)
    return [w for w in workers if in_flight(w) <= OVERLOAD_FACTOR * least + OVERLOAD_SLACK]


def choose(workers: list, index: KVIndex, prompt_ids: list[int]) -> Estimate:
    """The cheapest of `workers` (not empty) for this prompt, by the load rule and price() above; prices
    within TIE of the cheapest are a tie (noise in measured speeds must not send every cold prompt to
    one worker), which goes to the one chosen less often, then to the less loaded."""
    candidates = not_overloaded(workers)
    fallback = prefill_line(workers)
    names: dict[tuple[bytes, int], list[bytes]] = {}  # per naming (root, block size): once per request
    estimates = []
    for w in candidates:
        key = (w.block_root, w.info.block_size)
        if w.block_root is None:
            tiers = []
        else:
            if key not in names:
                names[key] = block_names(prompt_ids, w.info.block_size, w.block_root)
            tiers = index.held(w.id, names[key])
        estimates.append(price(w, tiers, len(prompt_ids), fallback))
        estimates[-1].names = names.get(key, [])
    low = min(estimates, key=lambda e: e.ttft_ms)
    band = TIE * (low.ttft_ms - low.fixed_ms)  # noise scales with the work that differs, not the fixed part
    tied = [e for e in estimates if e.ttft_ms <= low.ttft_ms + band + e.worker.info.block_size * e.ms_per_token]
    return min(tied, key=lambda e: (e.worker.chosen, in_flight(e.worker), e.ttft_ms))


def reporting(workers: list, index: KVIndex) -> bool:
    """KV-aware choice applies once some worker reports its block names (else: least loaded)."""
    return any(index.reporting(w.id) for w in workers)


def auto_policy(co: bool, dis: bool, colocated: list, prefills: list, index: KVIndex, prompt_ids: list[int],
                threshold: int, priced: bool) -> tuple[Policy, str, str]:
    """Policy auto: (policy, reason, why). The one servable now, if only one is (only_servable). Unless the
    worker choice prices these workers from their reports (`priced`, server/worker_choice.py: not with
    --routing least-loaded, nor before some worker reports): colocated below `threshold` prompt tokens
    (threshold). Priced, from the measured costs: colocated when the prefix the best colocated worker holds
    leaves fewer than `threshold` tokens to compute (a small prefill: small_prefill), or when the queue ahead
    on the best prefill worker costs more than the one on the colocated worker plus the decode interference
    disaggregating saves (the colocated prefill's own compute, which the decodes there wait through: queue);
    disaggregated otherwise (disaggregate)."""
    if co != dis:
        policy = Policy.COLOCATED if co else Policy.DISAGGREGATED
        return policy, "only_servable", f"only {policy} is servable now"
    if not (priced and co):
        policy = Policy.COLOCATED if len(prompt_ids) < threshold else Policy.DISAGGREGATED
        return policy, "threshold", f"{len(prompt_ids)} prompt tokens against --auto-threshold {threshold}"
    c = choose(colocated, index, prompt_ids)
    if c.uncached_tokens < threshold:
        return (Policy.COLOCATED, "small_prefill",
                f"{c.worker.id} holds all but {c.uncached_tokens} tokens (< --auto-threshold {threshold})")
    p = choose(prefills, index, prompt_ids)
    saved = c.uncached_tokens * c.ms_per_token
    why = (f"queue ahead: prefill {p.queue_ms:.1f} ms ({p.worker.id}), colocated {c.queue_ms:.1f} ms "
           f"({c.worker.id}); interference saved {saved:.1f} ms; predicted TTFT {p.ttft_ms:.1f} ms "
           f"disaggregated, {c.ttft_ms:.1f} ms colocated")
    if p.queue_ms > c.queue_ms + saved:
        return Policy.COLOCATED, "queue", why
    return Policy.DISAGGREGATED, "disaggregate", why


def route_taken(worker: str, e: Estimate | None, auto: str | None) -> Route:
    """timings.route: the workers chosen, and what the KV-aware choice expected there (None: least loaded)."""
    if e is None:
        return Route(worker=worker, rule="least-loaded", auto=auto or "")
    c = e.cached
    expected = {"device": c.get("gpu", 0), **{t: c.get(t, 0) for t in TIERS}}
    return Route(worker=worker, rule="kv", expected_tokens=expected,
                 predicted_ttft_ms=round(e.ttft_ms, 3) if e.measured else None, auto=auto or "")
