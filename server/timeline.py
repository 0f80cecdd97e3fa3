"""One request's timeline, assembled from durations each process measured on its own clock.

No timestamp crosses a process boundary, so clock offsets between hosts cannot bend the numbers:

    queue_ms             router: arrival (before parsing and tokenizing) -> Generate/Prefill sent
                         + worker: message received -> prefill start
    prefill_ms           prefill (or colocated) worker, one forward over the prompt
    transfer_ms          prefill worker: first copy issued -> last copy complete
    transfer_exposed_ms  prefill worker: prefill end -> last copy complete, before "kv done" is sent (what TTFT pays)
    first_decode_step_ms decode (or colocated) worker: the step that makes token 2
    ttft_ms, e2e_ms      router: arrival -> first token received, -> last token received
    decode_tokens_per_s  router: tokens after the first / (last token - first token)

queue + prefill + exposed transfer are disjoint, ordered stretches of the time before the first
token reaches the router, so their sum is at most ttft_ms. The first decode step makes token 2;
it comes after token 1 and is inside e2e_ms (never inside ttft_ms: token 1 comes from prefill).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers import protocol as P
from workers.roles.base import ms


@dataclass
class Clock:
    """Router-side stamps of one request, time.monotonic() seconds."""

    arrival: float
    dispatched: float | None = None  # Generate (colocated) or Prefill (disaggregated) sent
    first_token: float | None = None
    last_token: float | None = None

    @classmethod
    def start(cls) -> "Clock":
        return cls(time.monotonic())


def timings(*, policy: str, clock: Clock, prompt_tokens: int, completion_tokens: int, worker: str,
            prefilled_by: P.Timeline | None, decoded_by: P.Timeline | None,
            prefill: P.PrefillDone | None = None, prefill_worker: str | None = None,
            transport: str | None = None, mode: str | None = None) -> dict:
    """The `timings` object (field names fixed by the API; ms unless named otherwise)."""
    wait = prefilled_by.wait_ms if prefilled_by is not None else None
    routed = ms(clock.arrival, clock.dispatched)
    queue = routed + wait if routed is not None and wait is not None else routed
    decode_s = None if clock.first_token is None or clock.last_token is None else clock.last_token - clock.first_token
    tps = (completion_tokens - 1) / decode_s if completion_tokens > 1 and decode_s else None
    disaggregated = prefill is not None
    return {
        "policy": policy,
        "queue_ms": _r(queue),
        "prefill_ms": _r(prefilled_by.prefill_ms if prefilled_by is not None else None),
        "transfer_ms": _r(prefill.transfer_ms) if disaggregated else None,
        "transfer_exposed_ms": _r(prefill.transfer_exposed_ms) if disaggregated else None,
        "first_decode_step_ms": _r(decoded_by.first_step_ms if decoded_by is not None else None),
        "ttft_ms": _r(ms(clock.arrival, clock.first_token)),
        "e2e_ms": _r(ms(clock.arrival, clock.last_token)),
        "decode_tokens_per_s": _r(tps),
        "kv_bytes": prefill.kv_bytes if disaggregated else 0,
        "transport": transport if disaggregated else None,
        "mode": mode if disaggregated else None,
        "prefill_worker": prefill_worker if disaggregated else None,
        "decode_worker": worker if disaggregated else None,
        "worker": worker,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
