"""Per-request records and the numbers made from them.

Definitions (those of `vllm bench serve`, so results compare):
    TTFT   send -> first token event                       (client clock)
    ITL    gap between consecutive token events; pooled over all requests
    TPOT   (E2E - TTFT) / (output_len - 1), per request with output_len > 1
    E2EL   send -> end of the stream
    throughput   completed requests (tokens) / duration of the whole run (first send -> last answer)
    goodput      requests meeting every given SLO / duration (a 1-token answer meets any TPOT or ITL SLO)
    SLOs         per request: ttft, tpot, e2el as above; itl its longest gap (the longest stall its reader saw)
    cached share prompt tokens the server reported served from its cache / prompt tokens, over the
                 requests that reported it
Percentiles interpolate linearly (numpy's default). Empty sets give None, not 0.

Server phases (from pdserve's `timings`, where present) are summarised the same way: queue, prefill,
transfer, transfer_exposed, first_decode_step, and the server's own ttft and e2e.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SERVER_PHASES = {  # summary name -> timings field
    "queue": "queue_ms",
    "prefill": "prefill_ms",
    "transfer": "transfer_ms",
    "transfer_exposed": "transfer_exposed_ms",
    "first_decode_step": "first_decode_step_ms",
    "server_ttft": "ttft_ms",
    "server_e2e": "e2e_ms",
}


@dataclass
class RequestRecord:
    index: int
    policy: str | None
    prompt_len: int  # the server's count when it reported usage, else the generator's
    expected_output_len: int  # max_tokens asked for
    planned_prompt_len: int | None = None  # the generator's count (exact with --tokenizer)
    output_len: int = 0  # tokens generated (usage, else token events)
    scheduled_s: float = 0.0  # when it was due, seconds after the run start
    start_s: float = 0.0  # when it went
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    success: bool = False
    error: str | None = None
    request_id: str | None = None
    timings: dict | None = None  # Timings.to_dict()
    kind: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, else timings; None: not reported
    conversation: int | None = None  # multi-turn: which conversation, and which turn of it (1 = the first)
    turn: int | None = None
    reply: str | None = None  # the text the server returned (the next turn's history); not written to JSON

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_len < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    def to_dict(self) -> dict:
        out = {**asdict(self), "tpot_s": self.tpot_s}
        out["reply_chars"] = None if out.pop("reply") is None else len(self.reply)
        return out


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO {name!r} in {item!r}; use {', '.join(m + ':MS' for m in SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise ValueError(f"SLO {item!r}: the limit must be a number of milliseconds") from e
        if slos[name] <= 0:
            raise ValueError(f"SLO {item!r}: the limit must be > 0 ms")
    return slos


def slo_values_ms(ttft_s: float | None, tpot_s: float | None, itls_s: list[float], e2e_s: float | None
                  ) -> dict[str, float | None]:
    """One request's value for each SLO metric, in ms; a one-token answer has no TPOT and no gap (0)."""
    return {"ttft": None if ttft_s is None else ttft_s * 1e3, "tpot": (tpot_s or 0.0) * 1e3,
            "itl": max(itls_s, default=0.0) * 1e3, "e2el": None if e2e_s is None else e2e_s * 1e3}


def within_each(values_ms: dict[str, float | None], slos: dict[str, float]) -> dict[str, bool]:
    """Per SLO: whether this value meets it (a missing value does not)."""
    return {m: values_ms[m] is not None and values_ms[m] <= limit for m, limit in slos.items()}


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    return r.success and all(within_each(slo_values_ms(r.ttft_s, r.tpot_s, r.itls_s, r.e2e_s), slos).values())


def request_within(request: dict, slos: dict[str, float]) -> dict[str, bool]:
    """A request as results.json holds it (RequestRecord.to_dict): per SLO, whether it met it; a failed
    request meets none."""
    if not request.get("success"):
        return dict.fromkeys(slos, False)
    return within_each(slo_values_ms(request.get("ttft_s"), request.get("tpot_s"), request.get("itls_s") or [],
                                     request.get("e2e_s")), slos)


def pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def stats_ms(name: str, values_ms: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean_/median_/std_/pXX_<name>_ms; None everywhere for an empty list."""
    arr = np.asarray(values_ms, dtype=float)
    empty = arr.size == 0
    out = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
        f"std_{name}_ms": None if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"{pct_name(p)}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    return out


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None,
              percentiles=DEFAULT_PERCENTILES) -> dict:
    """One result block in `vllm bench serve`'s field names (plus server phases and our records)."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(meets_slos(r, slos) for r in ok)) if slos else None,
        "goodput_fraction": (sum(meets_slos(r, slos) for r in ok) / len(records)) if slos and records else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    out.update(stats_ms("ttft", [r.ttft_s * 1e3 for r in ok], percentiles))
    out.update(stats_ms("tpot", [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None], percentiles))
    out.update(stats_ms("itl", [g * 1e3 for r in ok for g in r.itls_s], percentiles))
    out.update(stats_ms("e2el", [r.e2e_s * 1e3 for r in ok], percentiles))
    with_timings = [r.timings for r in ok if r.timings]
    out["timings_reported"] = len(with_timings)
    for name, key in SERVER_PHASES.items():
        values = [t[key] for t in with_timings if t.get(key) is not None]
        out.update(stats_ms(name, values, percentiles))
    out["ttft_split_ms"] = ttft_split_ms(records)
    out.update(peak_output(records))
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out["cached_tokens_reported"] = len(cached)
    out["total_cached_tokens"] = sum(cached) if cached else None
    out["cache_reported_prompt_tokens"] = sum(r.prompt_len for r in ok if r.cached_tokens is not None)
    out["cached_share"] = cached_share(ok)
    if any(r.turn is not None for r in records):
        out["per_turn"] = per_turn(records, percentiles)
    # per-request arrays, vllm's units: seconds for ttfts / itls
    out["input_lens"] = [r.prompt_len for r in records]
    out["output_lens"] = [r.output_len for r in records]
    out["ttfts"] = [r.ttft_s if r.success else 0.0 for r in records]
    out["itls"] = [r.itls_s for r in records]
    out["errors"] = [r.error or "" for r in records]
    out["requests"] = [r.to_dict() for r in records]
    return out


def cached_share(records: list[RequestRecord]) -> float | None:
    """Prompt tokens served from the server's cache / prompt tokens, over the requests that reported cached
    tokens; None when none did (a server without a prefix cache, or one that does not say)."""
    told = [r for r in records if r.cached_tokens is not None]
    return sum(r.cached_tokens for r in told) / max(1, sum(r.prompt_len for r in told)) if told else None


def ttft_split_ms(records: list[RequestRecord]) -> dict[str, float | None]:
    """Means over the successful requests with timings: the client's TTFT split into the server's
    TTFT phases (protocol/phases.py, from `ttft_phases_ms`; a phase a request's path lacks counts 0)
    and `client`: the client's TTFT less the server's (connecting, the request's way in, the first
    event's way out; a difference of two durations, each on its own clock). A server that reports no
    phases (another server, an older pdserve) has its prefill and the transfer it pays placed, and the
    rest of its TTFT in `unattributed`. The parts sum to `ttft` (the client's mean). The first decode
    step makes token 2, after the first token: beside the split (`first_step`), not in it. All None
    without timings."""
    from pdserve.protocol.phases import FIELD, NAMES, UNATTRIBUTED

    rows = [r for r in records if r.success and r.timings and r.ttft_s is not None]
    keys = (*NAMES, "client", "first_step", "ttft", "server_ttft")
    if not rows:
        return dict.fromkeys(keys)
    sums = dict.fromkeys(keys, 0.0)
    server_ttfts = []
    for r in rows:
        t, ttft = r.timings, r.ttft_s * 1e3
        server = t.get("ttft_ms")
        parts = dict.fromkeys(NAMES, 0.0)
        if t.get(FIELD):
            parts.update({k: v or 0.0 for k, v in t[FIELD].items() if k in parts})
            parts[UNATTRIBUTED] += sum(v or 0.0 for k, v in t[FIELD].items() if k not in parts)  # a newer server's
        else:
            exposed = t.get("transfer_exposed_ms")
            parts["prefill"] = t.get("prefill_ms") or 0.0
            parts["transfer_exposed"] = (t.get("transfer_ms") or 0.0) if exposed is None else exposed
            parts[UNATTRIBUTED] = (ttft if server is None else server) - parts["prefill"] - parts["transfer_exposed"]
        server_part = sum(parts.values())
        for k, v in parts.items():
            sums[k] += v
        sums["client"] += ttft - server_part
        sums["first_step"] += t.get("first_decode_step_ms") or 0.0
        sums["ttft"] += ttft
        if server is not None:
            server_ttfts.append(server)
    out = {k: v / len(rows) for k, v in sums.items()}
    out["server_ttft"] = float(np.mean(server_ttfts)) if server_ttfts else None
    return out


def peak_output(records: list[RequestRecord]) -> dict:
    """vllm bench serve's peak figures: output tokens in the busiest whole second of the run (a token at
    send + TTFT + the ITLs before it) and the most requests in flight during any one second (a request
    counts in every second it touched)."""
    ok = [r for r in records if r.success and r.ttft_s is not None and r.e2e_s is not None]
    if not ok:
        return {"max_output_tokens_per_s": None, "max_concurrent_requests": None}
    t0 = min(r.start_s for r in ok)
    seconds = int(np.ceil(max(r.start_s + r.e2e_s for r in ok) - t0)) + 1
    tokens, active = np.zeros(seconds), np.zeros(seconds)
    for r in ok:
        times = r.start_s - t0 + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itls_s)])
        np.add.at(tokens, np.clip(times.astype(int), 0, seconds - 1), 1)
        active[int(r.start_s - t0):int(r.start_s - t0 + r.e2e_s) + 1] += 1
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(active.max())}


def per_turn(records: list[RequestRecord], percentiles=DEFAULT_PERCENTILES) -> list[dict]:
    """Multi-turn runs: one row per turn index over every conversation: TTFT statistics, prompt and cached
    tokens (cached_share = cached / prompt tokens over the requests that reported both), and from the
    server's timings where it sent them: mean queue, prefill and reload time (so a TTFT change can be told
    from queueing) and the mean cached tokens per tier they came from (gpu, host, disk)."""
    rows = []
    for turn in sorted({r.turn for r in records if r.turn is not None}):
        mine = [r for r in records if r.turn == turn]
        ok = [r for r in mine if r.success]
        cached = [r for r in ok if r.cached_tokens is not None]
        timed = [r.timings for r in ok if r.timings]
        row = {"turn": turn, "requests": len(mine), "completed": len(ok),
               "mean_prompt_tokens": float(np.mean([r.prompt_len for r in ok])) if ok else None,
               "cached_tokens_reported": len(cached),
               "mean_cached_tokens": float(np.mean([r.cached_tokens for r in cached])) if cached else None,
               "cached_share": cached_share(cached)}
        ttfts = [r.ttft_s * 1e3 for r in ok]
        row.update(stats_ms("ttft", ttfts, percentiles))
        row["min_ttft_ms"], row["max_ttft_ms"] = (min(ttfts), max(ttfts)) if ttfts else (None, None)
        for name, key in (("queue", "queue_ms"), ("prefill", "prefill_ms"), ("reload", "reload_ms")):
            values = [t[key] for t in timed if t.get(key) is not None]
            row[f"mean_{name}_ms"] = float(np.mean(values)) if values else None
        # where pdserve's cached tokens came from: {"device": n, "host": n, "disk": n} in timings.reused_tokens
        tiers = [t["reused_tokens"] for t in timed if isinstance(t.get("reused_tokens"), dict)]
        row["mean_reused_tokens"] = {k: float(np.mean([d.get(k) or 0 for d in tiers]))
                                     for k in dict.fromkeys(k for d in tiers for k in d)} if tiers else None
        row.update(predicted_ttft(ok))
        rows.append(row)
    return rows


def predicted_ttft(records: list[RequestRecord]) -> dict:
    """The KV-aware router's predicted TTFT (timings.route.predicted_ttft_ms: the chosen worker's queue ahead,
    prefill, reload and load as priced from its measured costs) beside the TTFT the client measured, over the
    successful requests that carry a prediction (least-loaded routing and workers that had measured nothing
    yet carry none): how many, both means, the server's own queue + prefill for the same requests, the error
    of the mean (predicted / measured - 1) and the median of the per-request |predicted - measured| /
    measured. None where no request carried a prediction."""
    pairs = [(r.timings["route"]["predicted_ttft_ms"], r.ttft_s * 1e3, r.timings) for r in records
             if r.success and r.ttft_s and r.timings and isinstance(r.timings.get("route"), dict)
             and r.timings["route"].get("predicted_ttft_ms") is not None]
    out = {"predicted_reported": len(pairs), "mean_predicted_ttft_ms": None, "mean_measured_ttft_ms": None,
           "mean_server_queue_prefill_ms": None, "predicted_ttft_error": None,
           "median_predicted_ttft_abs_error": None}
    if not pairs:
        return out
    pred = np.array([p for p, _, _ in pairs], dtype=float)
    meas = np.array([m for _, m, _ in pairs], dtype=float)
    server = [(t.get("queue_ms") or 0.0) + (t.get("prefill_ms") or 0.0) for _, _, t in pairs
              if t.get("queue_ms") is not None or t.get("prefill_ms") is not None]
    out.update(mean_predicted_ttft_ms=float(pred.mean()), mean_measured_ttft_ms=float(meas.mean()),
               mean_server_queue_prefill_ms=float(np.mean(server)) if server else None,
               predicted_ttft_error=float(pred.mean() / meas.mean() - 1.0),
               median_predicted_ttft_abs_error=float(np.median(np.abs(pred - meas) / meas)))
    return out
