"""The phases of a request's time to first token, defined once: the router computes them, the
`timings` object carries them (`ttft_phases_ms`), /metrics histograms them, the client reads them,
the load bench averages and plots them.

Every millisecond from the router's arrival stamp to token 1 handed to the response lands in
exactly one phase, in this order, so the phases of a request sum to its `ttft_ms`. Each is a
duration on one process's clock (hosts need no clock sync). `hops` is the one that spans
processes: the router's round trip (request sent -> token 1 read back) minus the time spent
inside the workers, each on its own clock. A phase a request's path does not have is None
(colocated: `transfer_exposed`, `decode_pickup`); `unattributed` is what could not be split
because a worker did not report a stamp, 0 when every process did.

Standard library only: the router (torch-free) and the client import this module.
"""

from __future__ import annotations

from typing import NamedTuple


class Phase(NamedTuple):
    name: str
    clock: str  # whose clock measures it
    meaning: str  # one line: docs, plot legends, metric help


PHASES: tuple[Phase, ...] = (
    Phase("parse", "router",
          "arrival (before the body is read) -> body parsed, prompt tokenized"),
    Phase("route", "router",
          "policy resolved, workers picked; disaggregated: KV blocks reserved on the decode worker (a round trip) "
          "-> request sent to the worker that prefills it"),
    Phase("inbox", "prefilling worker",
          "request in the worker's socket (stamped on arrival by its inbox thread) -> its loop takes it "
          "(waits while a step or a prefill runs)"),
    Phase("prefill_queue", "prefilling worker", "taken -> prefill starts (behind other prefills)"),
    Phase("prefill", "prefilling worker", "the forward over the prompt and sampling token 1"),
    Phase("transfer_exposed", "prefill worker",
          "prefill end -> KV in the decode worker's blocks as the prefill worker sees it "
          "(ipc, nixl: last copy complete; zmq: the decode worker's ack)"),
    Phase("decode_pickup", "decode worker",
          "its KV receiver reported the KV in -> the decode loop adopted the request (waits for a running step)"),
    Phase("hops", "router minus workers",
          "messages in flight on token 1's path (router -> worker, the prefill worker's done notice, "
          "worker -> router): the router's round trip less the time inside the workers"),
    Phase("first_token_send", "worker + router",
          "token 1 made -> its message sent (worker); read off the router's socket (stamped on arrival by "
          "its reader thread) -> handed to the response"),
    Phase("unattributed", "", "what could not be split (a worker that reported no stamp for a part); "
          "0 when every process did"),
)

NAMES: tuple[str, ...] = tuple(p.name for p in PHASES)
# docs/api.md's table of phases is these rows (a test holds it to them)
MEANING: dict[str, str] = {p.name: p.meaning for p in PHASES}
UNATTRIBUTED = "unattributed"
FIELD = "ttft_phases_ms"  # the key of the split in the `timings` object


def total_ms(phases: dict[str, float | None]) -> float:
    """The sum of a split (None counts as 0): equals the request's ttft_ms."""
    return sum(v for v in phases.values() if v is not None)


def ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds between two time.monotonic() stamps; None if either is missing."""
    if start is None or end is None:
        return None
    return (end - start) * 1e3
