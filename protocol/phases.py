"""The phases of a request's time to first token, defined once, one row each: the router computes them,
the `timings` object carries them (`ttft_phases_ms`), /metrics histograms them, the client reads them,
the load bench averages and plots them.

Every millisecond from the router's arrival stamp to token 1 handed to the response lands in
exactly one phase, in this order, so the phases of a request sum to its `ttft_ms`. Each is a
duration on one process's clock (hosts need no clock sync). A row names its stretches (`Span`):
a side, whose stamps they are, and two of that side's stamps, start and end; the phase is their sum.
The stamps are the router's (server/timeline.py's Clock) and each worker's (workers/engine/request.py's
Stamps, on the wire by name in Timeline.stamps): a duration is only ever one process's stamp less
another of its own. Two phases are what is left: `hops`, the router's round trip (request sent ->
token 1 read back) less every worker stretch of the other rows, is the messages' flight; `unattributed`
is what could not be split because a process did not report a stamp, 0 when every process did. A phase
a request's path does not have is None (colocated: `transfer_exposed`, `decode_pickup`).

Adding a phase: a row here; a stamp in workers/engine/request.py's Stamps if it needs a new one; the
line that stamps it; docs/api.md's table lists the rows (a test holds it to them).

Standard library only: the router (torch-free) and the client import this module.
"""

from __future__ import annotations

from typing import NamedTuple

# the sides whose stamps a span subtracts
ROUTER = "router"  # the router's stamps (server/timeline.py: Clock)
PREFILLING = "prefilling worker"  # the worker that prefilled: colocated, or the prefill worker
TOKEN1 = "token 1's worker"  # the worker that sent token 1: colocated, or the decode worker


class Span(NamedTuple):
    """The time between two stamps of one side."""

    side: str
    start: str
    end: str


class Phase(NamedTuple):
    name: str
    clock: str  # whose clock measures it (docs/api.md's column)
    meaning: str  # one line: docs, plot legends, metric help
    spans: tuple[Span, ...] = ()  # the phase is their sum (those stamped); none: the rest of TTFT
    disaggregated_only: bool = False  # a colocated request's path does not have it (None there)
    less_workers: bool = False  # its span less every worker span of the other phases (the messages' flight)


PHASES: tuple[Phase, ...] = (
    Phase("parse", "router",
          "arrival (before the body is read) -> body parsed, prompt tokenized",
          (Span(ROUTER, "arrival", "prepared"),)),
    Phase("route", "router",
          "policy resolved, workers picked; disaggregated: KV blocks reserved on the decode worker (a round trip) "
          "-> request sent to the worker that prefills it",
          (Span(ROUTER, "prepared", "dispatched"),)),
    Phase("inbox", "prefilling worker",
          "request in the worker's socket (stamped on arrival by its inbox thread) -> its loop takes it "
          "(waits while a step or a prefill runs)",
          (Span(PREFILLING, "arrived", "taken"),)),
    Phase("prefill_queue", "prefilling worker", "taken -> prefill starts (behind other prefills)",
          (Span(PREFILLING, "taken", "prefill_start"),)),
    Phase("prefill", "prefilling worker", "the forward over the prompt and sampling token 1",
          (Span(PREFILLING, "prefill_start", "prefill_end"),)),
    Phase("transfer_exposed", "prefill worker",
          "prefill end -> KV in the decode worker's blocks as the prefill worker sees it "
          "(ipc, nixl: last copy complete; zmq: the decode worker's ack)",
          (Span(PREFILLING, "prefill_end", "kv_delivered"),), disaggregated_only=True),
    Phase("decode_pickup", "decode worker",
          "its KV receiver reported the KV in -> the decode loop adopted the request (waits for a running step)",
          (Span(TOKEN1, "kv_received", "token1"),), disaggregated_only=True),
    Phase("hops", "router minus workers",
          "messages in flight on token 1's path (router -> worker, the prefill worker's done notice, "
          "worker -> router): the router's round trip less the time inside the workers",
          (Span(ROUTER, "dispatched", "token1_landed"),), less_workers=True),
    Phase("first_token_send", "worker + router",
          "token 1 made -> its message sent (worker); read off the router's socket (stamped on arrival by "
          "its reader thread) -> handed to the response",
          (Span(TOKEN1, "token1", "token1_sent"), Span(ROUTER, "token1_landed", "first_token"))),
    Phase("unattributed", "", "what could not be split (a worker that reported no stamp for a part); "
          "0 when every process did"),
)

NAMES: tuple[str, ...] = tuple(p.name for p in PHASES)
# docs/api.md's table of phases is these rows (a test holds it to them)
MEANING: dict[str, str] = {p.name: p.meaning for p in PHASES}
UNATTRIBUTED = "unattributed"
FIELD = "ttft_phases_ms"  # the key of the split in the `timings` object
QUEUE: tuple[str, ...] = NAMES[:NAMES.index("prefill")]  # queue_ms: arrival -> prefill start
# beside the phases
TTFT = Span(ROUTER, "arrival", "first_token")
E2E = Span(ROUTER, "arrival", "last_token")
FIRST_STEP = Span(TOKEN1, "first_step_start", "first_step_end")  # the decode step that makes token 2


def total_ms(phases: dict[str, float | None]) -> float:
    """The sum of a split (None counts as 0): equals the request's ttft_ms."""
    return sum(v for v in phases.values() if v is not None)


def ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds between two time.monotonic() stamps; None if either is missing."""
    if start is None or end is None:
        return None
    return (end - start) * 1e3
