"""The verdict of a load run with several arms, in words, for the top of summary.md (and results.json's
"verdict"):

    verdict_slos(run)      the SLOs it judges: --goodput's, else ASSUMED_SLOS_MS (and says it assumed them)
    judge(run)             per load point: each arm's share of requests within each SLO and within all, each
                           latency (TTFT, TPOT, ITL, E2E p99) compared, and the outcome: one arm met the SLOs
                           and another did not ("slos"), one arm lower on some latency and on none higher
                           ("better"), arms lower on different latencies ("split": no single winner), or
                           within EVEN of each other everywhere ("even")
    capacity_line(run)     which arm met the SLOs at the higher rate (capacity search), and by how much
    point_lines(run)       judge()'s points in words, with each arm's dominant TTFT phase (the largest part of
                           its mean TTFT split)
    cache_lines(run)       each arm's share of prompt tokens served from the server's cache, and a warning where
                           a run that should have been cold (fresh prompts) was served from a cache
    shared_host_lines(run) warnings where arms (or one arm's workers) shared a host's CPU or GPU, so the
                           comparison measures contention as much as the design
"""

from __future__ import annotations

from urllib.parse import urlparse

from pdserve.bench.load.metrics import request_within

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
# Judged when no --goodput is given: a chat-like service's limits (the atlas's loose pair: TTFT 2 s, TPOT
# 100 ms) and no stall in a stream over 500 ms. E2E depends on the output length: compared, never assumed.
ASSUMED_SLOS_MS = {"ttft": 2000.0, "tpot": 100.0, "itl": 500.0}
METRICS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}
SLO_WORDS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (longest gap of a request)", "e2el": "E2E"}
COMPARED_AT = "p99"  # the tail an SLO bounds
EVEN = 0.05  # two latencies within 5% of each other favour neither arm
COLD_CACHED_SHARE_MAX = 0.10  # a run of fresh prompts with more of its prompt tokens cached was not cold


def _arm(block: dict) -> str:
    return block.get("arm") or block.get("policy") or "default"


def _ms(value: float) -> str:
    return f"{value / 1e3:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def verdict_slos(run: dict) -> tuple[dict[str, float], bool]:
    """(the SLOs judged, whether they were assumed): the run's --goodput SLOs, else ASSUMED_SLOS_MS."""
    return (dict(run["slos_ms"]), False) if run.get("slos_ms") else (dict(ASSUMED_SLOS_MS), True)


def slos_text(slos: dict[str, float]) -> str:
    return ", ".join(f"{SLO_WORDS[m]} <= {v:g} ms" for m, v in slos.items())


def dominant_phase(block: dict) -> str | None:
    """'prefill (61% of TTFT)': the largest part of the mean TTFT split (server phases and the client's part)."""
    split = block.get("ttft_split_ms") or {}
    ttft = split.get("ttft")
    parts = {k: v for k, v in split.items() if k not in ("ttft", "server_ttft", "first_step") and v}
    if not ttft or not parts:
        return None
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} ({value / ttft:.0%} of TTFT)"


def capacity_line(run: dict) -> list[str]:
    caps = {a["label"]: a["capacity"]["capacity_rate"] for a in run.get("arms") or [] if a.get("capacity")}
    caps = {k: v for k, v in caps.items() if v is not None}
    if len(caps) < 2:
        return []
    (best, high), *rest = sorted(caps.items(), key=lambda kv: -kv[1])
    others = ", ".join(f"{a} {r:.3g}/s" for a, r in rest)
    if all(r == high for _, r in rest):
        return [f"- capacity: every arm met the SLOs up to the same rate, {high:.3g}/s"]
    low = rest[0][1]
    ratio = f"{high / low:.2f}x" if low > 0 else "where the other met them at no probed rate"
    return [f"- capacity: **{best}** met the SLOs at the higher rate, {high:.3g}/s against {others}: "
            f"{ratio}, +{high - low:.3g} req/s"]


# ---- judging one load point ----------------------------------------------------------------


def slo_shares(block: dict, slos: dict[str, float], given: bool) -> dict | None:
    """{"each": {metric: share within it}, "all": share within every one}, over the run's requests (a failed
    request meets none); from the block's goodput fraction alone where it kept no requests; None: unknown."""
    requests = block.get("requests")
    if requests:
        within = [request_within(r, slos) for r in requests]
        return {"each": {m: sum(w[m] for w in within) / len(within) for m in slos},
                "all": sum(all(w.values()) for w in within) / len(within)}
    if given and block.get("goodput_fraction") is not None:
        return {"each": None, "all": block["goodput_fraction"]}
    return None


def compare_latency(blocks: list[dict], metric: str) -> dict:
    """Each arm's p99 of one metric; `lower`: the arm below every other by more than EVEN, else None (even)."""
    values = {_arm(b): b.get(f"{COMPARED_AT}_{metric}_ms") for b in blocks}
    known = sorted((v, a) for a, v in values.items() if v is not None)
    out = {"metric": metric, "at": COMPARED_AT, "ms": values, "lower": None, "ratio": None}
    if len(known) < 2:
        return out
    (low, best), (second, _) = known[0], known[1]
    if second > low * (1 + EVEN):
        out.update(lower=best, ratio=None if low <= 0 else known[-1][0] / low)
    return out


def judge_point(label: str, blocks: list[dict], slos: dict[str, float], given: bool, target: float) -> dict:
    arms = [_arm(b) for b in blocks]
    shares = {_arm(b): slo_shares(b, slos, given) for b in blocks}
    latency = [compare_latency(blocks, m) for m in METRICS]
    favours = {a: [c["metric"] for c in latency if c["lower"] == a] for a in arms}
    favours = {a: ms for a, ms in favours.items() if ms}
    known = all(s is not None for s in shares.values())
    met = [a for a in arms if known and shares[a]["all"] >= target]
    if met and len(met) < len(arms):
        outcome, winner = "slos", met[0] if len(met) == 1 else None
    elif len(favours) > 1:
        outcome, winner = "split", None
    elif favours:
        outcome, winner = "better", next(iter(favours))
    else:
        outcome, winner = "even", None
    return {"point": label, "slos_ms": slos, "target": target, "shares": shares, "met": met if known else None,
            "latency": latency, "favours": favours, "outcome": outcome, "winner": winner}


def _points(run: dict) -> dict[str, list[dict]]:
    points: dict[str, list[dict]] = {}
    for b in run["results"]:
        if b.get("completed"):
            points.setdefault(b["load_label"] + (f" ({b['phase']})" if b.get("phase") not in (None, "point") else ""),
                              []).append(b)
    return {p: blocks for p, blocks in points.items() if len({_arm(b) for b in blocks}) >= 2}


def judge(run: dict) -> dict:
    """The verdict as data (results.json's "verdict"): the SLOs judged, whether assumed, every point, and each
    arm's share of prompt tokens served from the server's cache over its runs (None: the server said nothing)."""
    slos, assumed = verdict_slos(run)
    target = run.get("goodput_target") or 0.9
    told: dict[str, list[dict]] = {}
    for b in run["results"]:
        if b.get("completed") and b.get("cached_share") is not None:
            told.setdefault(_arm(b), []).append(b)
    return {"slos_ms": slos, "assumed": assumed, "goodput_target": target, "compared_at": COMPARED_AT,
            "even_within": EVEN, "points": [judge_point(p, blocks, slos, not assumed, target)
                                            for p, blocks in _points(run).items()],
            "cached_share": {arm: _pooled_share(mine) for arm, mine in told.items()}}


# ---- in words ------------------------------------------------------------------------------


def _latency_words(c: dict) -> str:
    name = f"{METRICS[c['metric']]} {c['at']}"
    values = sorted((v, a) for a, v in c["ms"].items() if v is not None)
    if c["lower"] is None:
        return name
    others = " and ".join(_ms(v) for v, a in values if a != c["lower"])
    ratio = f"{c['ratio']:.2f}x, " if c["ratio"] else ""
    return f"{name} ({ratio}{_ms(c['ms'][c['lower']])} against {others})"


def _missed_words(point: dict) -> str:
    """Which SLO each arm that did not meet the target missed, with its share within it."""
    out = []
    for arm, share in point["shares"].items():
        if share is None or share["each"] is None or share["all"] >= point["target"]:
            continue
        missed = [f"{SLO_WORDS[m]} <= {point['slos_ms'][m]:g} ms ({s:.0%} within)"
                  for m, s in share["each"].items() if s < point["target"]]
        if missed:
            out.append(f"{arm} missed " + ", ".join(missed))
    return f" ({'; '.join(out)})" if out else ""


def point_words(point: dict) -> str:
    shares = ", ".join(f"{a} {s['all']:.0%}" for a, s in point["shares"].items() if s is not None)
    even = [_latency_words(c) for c in point["latency"] if c["lower"] is None and any(v is not None for v in
                                                                                        c["ms"].values())]
    even_text = f"; within {EVEN:.0%} on {', '.join(even)}" if even else ""
    if point["outcome"] == "slos":
        met = point["met"]
        others = [a for a in point["shares"] if a not in met]
        return (f"**{', '.join(met)}** met the SLOs and {', '.join(others)} did not (requests within them: {shares})"
                + _missed_words(point))
    if point["met"] is None:
        head = "SLOs not judged (no per-request records)"
    else:
        head = ("every arm met the SLOs" if point["met"] else "no arm met the SLOs") + f" ({shares})" \
            + _missed_words(point)
    if point["outcome"] == "split":
        sides = "; ".join(f"**{a}** lower on " + ", ".join(_latency_words(c) for c in point["latency"]
                                                            if c["lower"] == a) for a in point["favours"])
        return f"{head}; **split, no single winner**: {sides}{even_text}"
    if point["outcome"] == "better":
        arm = point["winner"]
        lower = ", ".join(_latency_words(c) for c in point["latency"] if c["lower"] == arm)
        return f"{head}; **{arm}** lower on {lower}, higher on none{even_text}"
    return f"{head}; the arms are within {EVEN:.0%} of each other on every latency compared"


def point_lines(run: dict) -> list[str]:
    by_label = _points(run)
    lines = []
    for point in judge(run)["points"]:
        blocks = by_label[point["point"]]
        lines.append(f"- {point['point']}: {point_words(point)}; dominant TTFT phase: "
                     + ", ".join(f"{_arm(b)} {dominant_phase(b) or '- (no timings)'}" for b in blocks))
    return lines


def slo_line(run: dict) -> list[str]:
    slos, assumed = verdict_slos(run)
    if not _points(run):
        return []
    head = "- SLOs judged: " + slos_text(slos)
    if assumed:
        head += (" (**assumed**: no --goodput was given; give yours, e.g. --goodput ttft:MS tpot:MS itl:MS)")
    unjudged = [METRICS[m] for m in METRICS if m not in slos]
    return [head + f"; latencies compared at {COMPARED_AT}, within {EVEN:.0%} counted even"
            + (f"; {', '.join(unjudged)} compared, not judged (no SLO)" if unjudged else "")]


# ---- what the runs reused, and where they ran ------------------------------------------------


def expected_cold(run: dict) -> bool:
    """Whether the runs' prompts were meant to find nothing cached: fresh text per run and invocation
    (synthetic prompts, multi-turn first turns) unless --reuse-prompts asked otherwise; dataset prompts too,
    which repeat across runs; a trace's shared prefixes are meant to be reused."""
    args = run.get("args") or {}
    return not (run.get("prompt_text") or {}).get("reused") and args.get("dataset", "synthetic") != "mooncake"


def _cold_share(block: dict) -> float | None:
    """The cached share of the prompts that should have been cold: a multi-turn run's first turns, else all."""
    turns = block.get("per_turn")
    if turns:
        first = next((t for t in turns if t["turn"] == 1), None)
        return None if first is None else first.get("cached_share")
    return block.get("cached_share")


def _pooled_share(blocks: list[dict]) -> float:
    cached = sum(b.get("total_cached_tokens") or 0 for b in blocks)
    told = sum(b.get("cache_reported_prompt_tokens") or b.get("total_input_tokens") or 0 for b in blocks)
    return cached / max(1, told)


def cache_lines(run: dict) -> list[str]:
    told = [b for b in run["results"] if b.get("completed") and b.get("cached_share") is not None]
    if not told:
        return []
    runs = {arm: sum(_arm(b) == arm for b in told) for arm in dict.fromkeys(_arm(b) for b in told)}
    note = (run.get("prompt_text") or {}).get("note")
    lines = ["- prompt tokens served from the server's cache: "
             + ", ".join(f"{arm} {share:.0%} over {runs[arm]} run(s)"
                         for arm, share in judge(run)["cached_share"].items())
             + (f" ({note})" if note else "")]
    if expected_cold(run):
        warm = [(b, s) for b in told for s in [_cold_share(b)] if s is not None and s > COLD_CACHED_SHARE_MAX]
        for b, share in warm:
            lines.append(f"- **served from a cache**: {_arm(b)} at {b['load_label']} ({b.get('phase', 'point')}) "
                         f"had {share:.0%} of its {'first turns' if b.get('per_turn') else 'prompt'} tokens cached "
                         "though its prompts should have been new to the server: its TTFT measures the cache, not "
                         "a cold prefill (a server that saw these prompts before, or a dataset's prompts sent "
                         "again; restart the server or use fresh prompts)")
    return lines


def shared_host_lines(run: dict) -> list[str]:
    arms = run.get("arms") or []
    machine = run["environment"]["machine"]
    gpus = [g for g in (machine.get("gpus") or "").splitlines() if g.strip()]
    own_servers = [a for a in arms if a.get("server")]
    lines = []
    if run.get("policy_runs") == "interleaved" and len(run.get("policies") or []) > 1:
        lines.append("- **shared at once**: the policies' requests ran interleaved on one server, so each arm's "
                     "latency includes the other arms' load on the same host")
    elif len(arms) > 1 and not own_servers:
        lines.append("- **one server for every arm**: the arms ran one after another on the same server, whose "
                     "workers for the other policies stayed up beside them on the same host (CPU, memory, GPU)")
    local = bool(own_servers) or urlparse(run.get("base_url") or "").hostname in LOOPBACK
    if local and not gpus:
        lines.append(f"- **one CPU for everything**: no GPU seen; the workers and this load generator share this "
                     f"host's {machine.get('cpu_count') or '?'} CPU cores, so the arms compete for cores: a "
                     "CPU run compares contention, not the designs as they would run on GPUs")
    elif local and len(gpus) == 1:
        lines.append("- **one GPU**: every worker of an arm ran on this host's one GPU (a disaggregated arm's "
                     "prefill and decode workers time-slice it)")
    return lines


def verdict_lines(run: dict) -> list[str]:
    body = slo_line(run) + capacity_line(run) + point_lines(run) + cache_lines(run) + shared_host_lines(run)
    return ["", "**Verdict** (from the tables below):", "", *body] if body else []
