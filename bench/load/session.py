"""The runs of one `pdserve-bench load` invocation: what each run sends, and in what order.

    LoadPoint                      a rate, a concurrency or a trace speed (multi-turn: of conversations)
    make_samples / plan            the prompts (lengths from --seed, text fresh per run) and their send times
                                   (arrivals from --seed too: every arm meets the same schedule, scaled by 1/rate)
    Session.measure(client, arm, point)   one run of one arm -> a result block (throughput over its own
                                   duration, saturation judged, SLO target checked; multi-turn: TTFT and
                                   cached tokens per turn, bench/load/multiturn.py)
    run_separate(session, arms, points)   each arm alone: its own server in turn, warm-up, then the given
                                   points or the capacity search and its sweep; an arm that fails (its
                                   server, its warm-up) is recorded with its error and the others go on
    run_interleaved(...)           the shared run: request i with policy i mod n (labelled in every block)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.load.capacity import (capacity_and_sweep, early_slowdown, meets_target, probe_passes, probe_requests,
                                    saturation, warmup_not_steady)
from pdserve.bench.load.arms import Arm, ArmError, ArmServer, default_server_command
from pdserve.bench.load.early_stop import SETTLE_TIMEOUT_S, EarlyStop, server_idle
from pdserve.bench.load.multiturn import conversations, run_conversations, warmup_samples
from pdserve.bench.load.runner import (Planned, SendOptions, WarmupFailed, run_closed_loop, run_open_loop,
                                       warmup_until_steady)
from pdserve.bench.load.metrics import summarize
from pdserve.bench.load.workload import (LengthDist, arrival_times, assign_policies, mooncake_samples, retext, sharegpt_samples,
                                    synthetic_samples)
from pdserve.client import ClientError
from pdserve.workers.engine.compiles import LOG_MARK


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # "rate" | "concurrency" | "trace"
    value: float | None
    conversations: bool = False  # multi-turn: the rate / concurrency counts conversations, not requests

    @property
    def label(self) -> str:
        if self.conversations:
            if self.kind == "rate":
                return "conversations at once" if math.isinf(self.value) else f"conversations {self.value:.4g}/s"
            return f"{int(self.value)} conversations at a time"
        if self.kind == "rate":
            return "rate inf" if math.isinf(self.value) else f"rate {self.value:.4g}/s"
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        return f"trace x{self.value:g}"

    @property
    def axis(self) -> str:
        if self.conversations:
            return "conversations started per second" if self.kind == "rate" else "conversations in flight"
        return {"rate": "offered request rate (req/s)", "concurrency": "requests in flight",
                "trace": "trace speedup"}[self.kind]


def make_conversations(args, builder, text_seed: int):
    return conversations(args.conversations, args.turns, LengthDist.parse(args.input_len),
                         LengthDist.parse(args.new_message_len), LengthDist.parse(args.output_len), builder,
                         seed=args.seed, text_seed=text_seed)


def make_samples(args, builder, copies: int, text_seed: int, n: int | None = None):
    """n prompts (default --num-prompts): a capacity probe sends as many as its window needs."""
    n = args.num_prompts if n is None else n
    if args.dataset == "multiturn":  # what warm-up sends: single prompts as long as each turn's
        return warmup_samples(make_conversations(args, builder, text_seed), builder, text_seed)
    if args.dataset == "synthetic":
        return synthetic_samples(n, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len),
                                 builder, seed=args.seed, text_seed=text_seed, long_fraction=args.long_fraction,
                                 long_input_len=LengthDist.parse(args.long_input_len), copies=copies)
    if args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "sharegpt":
        return sharegpt_samples(args.dataset_path, n, builder, seed=args.seed,
                                output_len=args.sharegpt_output_len, max_len=args.max_model_len, copies=copies)
    return mooncake_samples(args.dataset_path, builder, n=args.num_prompts, block_size=args.trace_block_size,
                            speedup=args.trace_speedup, seed=text_seed)


def plan(samples, policies, point: LoadPoint, args):
    """Every run's arrivals come from --seed: the same schedule for every arm, scaled by 1/rate."""
    assigned = assign_policies(len(samples), policies)
    if point.kind == "rate":
        times = arrival_times(len(samples), point.value, args.burstiness, seed=args.seed)
    elif point.kind == "trace":
        times = [s.arrival_s for s in samples]
    else:
        times = [None] * len(samples)
    return [Planned(i, s, pol, None if t is None else float(t)) for i, (s, pol, t) in
            enumerate(zip(samples, assigned, times))]


def warmup_batch(samples, k: int):
    """k samples whose lengths span the workload's, shortest to longest."""
    ordered = sorted(samples, key=lambda s: s.prompt_len)
    k = min(k, len(ordered))
    return [ordered[round(i * (len(ordered) - 1) / max(1, k - 1))] for i in range(k)]


def _rate(value):
    return None if value is None else ("inf" if math.isinf(value) else value)


def result_block(records, duration: float, point: LoadPoint, args, slos, percentiles, *, arm: str | None,
                 policy: str | None, policy_runs: str, phase: str = "point", factor: float | None = None,
                 n_policies: int = 1) -> dict:
    rate = point.value if point.kind == "rate" and not point.conversations else None
    block = {
        "arm": arm,
        "policy": policy,
        "policy_runs": policy_runs,
        "phase": phase,  # "point" (a given load point), "probe" (capacity search) or "sweep"
        "point": point.label if phase == "point" else ("probe" if phase == "probe" else f"{factor:g}x capacity"),
        "sweep_factor": factor,
        "load_kind": point.axis + (", all policies" if n_policies > 1 else ""),
        "load_label": point.label,
        "request_rate": _rate(rate),
        "policy_request_rate": _rate(None if rate is None else rate / n_policies),
        "burstiness": args.burstiness if point.kind == "rate" else None,
        "max_concurrency": int(point.value) if point.kind == "concurrency" and not point.conversations else
        args.max_concurrency,
        "conversation_rate": _rate(point.value) if point.conversations and point.kind == "rate" else None,
        "conversations_in_flight": int(point.value) if point.conversations and point.kind == "concurrency" else None,
        "trace_speedup": point.value if point.kind == "trace" else None,
        "duration_basis": "own run" if policy_runs == "separate" else "own requests' span in the shared run",
    }
    block.update(summarize(records, duration, slos, percentiles))
    block["goodput_target"] = args.goodput_target if slos else None
    block["meets_goodput_target"] = meets_target(block["goodput_fraction"], args.goodput_target) if slos else None
    sat_rate = None if rate is None else rate / n_policies
    block["saturation"] = saturation(records, duration, sat_rate) if sat_rate is not None else None
    block["cold_check"] = early_slowdown(records)
    reasons = block["cold_check"]["reasons"]
    block["cold"] = bool(reasons)
    block["cold_reason"] = "; ".join(reasons) or None
    return block


def mark_cold(block: dict, reason: str | None) -> None:
    """Adds a cold reason found outside the run's records (its arm's warm-up) to the block."""
    if reason:
        block["cold"] = True
        block["cold_warmup"] = True
        block["cold_reason"] = "; ".join(r for r in (reason, block.get("cold_reason")) if r)


def own_span(records) -> float:
    """First scheduled send -> last answer over these records (a policy's duration inside a shared run)."""
    if not records:
        return 0.0
    return max(r.start_s + (r.e2e_s or 0.0) for r in records) - min(r.scheduled_s for r in records)


class Session:
    """One benchmark invocation: the arguments, the prompt builder, and a counter that gives every
    run fresh prompt text (lengths and arrivals stay those of --seed; the words those of args.text_seed)."""

    def __init__(self, args, builder, slos, percentiles, out: Path):
        self.args, self.builder, self.slos, self.percentiles, self.out = args, builder, slos, percentiles, out
        self.opts = SendOptions(ignore_eos=not args.no_ignore_eos, stream_usage=args.stream_usage,
                                extra_body=args.extra_body, chat=args.chat)
        self.runs = 0
        self.warmups: dict[str, dict | None] = {}  # arm label -> its warm-up report
        self.measured: set[str] = set()  # arms with a run measured

    def first_run_cold(self, label: str, block: dict) -> None:
        """An arm's first run after a warm-up that never got steady is cold (bench/load/capacity.py)."""
        if label not in self.measured:
            self.measured.add(label)
            mark_cold(block, warmup_not_steady(self.warmups.get(label)))

    def samples(self, copies: int = 1, n: int | None = None):
        return make_samples(self.args, self.builder, copies, text_seed=self.next_text_seed(), n=n)

    def next_text_seed(self) -> int:
        """The next run's words: from the invocation's text seed (a fresh nonce unless asked otherwise,
        workload.prompt_text), new per run unless --reuse-prompts."""
        self.runs += 1
        return self.args.text_seed + (0 if self.args.reuse_prompts else 1000 * self.runs)

    def probe_size(self, rate: float) -> int:
        """Requests of a capacity-search run at `rate`: --probe-seconds of arrivals, >= --probe-min-requests."""
        a = self.args
        return probe_requests(rate, a.probe_seconds, a.probe_min_requests or a.num_prompts)

    def conversations(self):
        return make_conversations(self.args, self.builder, text_seed=self.next_text_seed())

    async def send(self, client, planned, point: LoadPoint, label: str, watch: EarlyStop | None = None):
        from tqdm import tqdm

        bar = tqdm(total=len(planned), desc=label, disable=self.args.no_progress, file=sys.stderr)
        try:
            if point.kind == "concurrency":
                return await run_closed_loop(client, planned, int(point.value), self.opts, lambda r: bar.update())
            return await run_open_loop(client, planned, self.opts, lambda r: bar.update(),
                                       max_concurrency=self.args.max_concurrency, watch=watch)
        finally:
            bar.close()

    async def converse(self, client, policy: str | None, point: LoadPoint, label: str):
        from tqdm import tqdm

        a = self.args
        convs = self.conversations()
        bar = tqdm(total=len(convs) * a.turns, desc=label, disable=a.no_progress, file=sys.stderr)
        try:
            return await run_conversations(
                client, convs, policy, self.opts, think_s=a.think_time,
                rate=point.value if point.kind == "rate" else None,
                concurrency=int(point.value) if point.kind == "concurrency" else None,
                burstiness=a.burstiness, seed=a.seed, on_done=lambda r: bar.update())
        finally:
            bar.close()

    async def warmup(self, client, policy: str | None, samples, label: str | None = None) -> dict | None:
        a = self.args
        if a.warmup_batch <= 0:
            return None
        report = await self._warmup(client, policy, samples)
        self.warmups[label or policy or "default"] = report
        return report

    async def _warmup(self, client, policy: str | None, samples) -> dict:
        a = self.args
        batch = warmup_batch(samples, a.warmup_batch)
        fresh = (lambda k: retext(batch, self.builder, a.text_seed + 7919 * (k + 1))) \
            if a.dataset in ("synthetic", "multiturn") \
            else (lambda k: batch)
        report = await warmup_until_steady(client, fresh, policy, self.opts, max_batches=a.warmup_max_batches,
                                           tolerance=a.warmup_tolerance)
        medians = ", ".join(f"{m:.1f}" for m in report.median_ttft_ms)
        print(f"warm-up {policy or 'default'}: {report.batches} batch(es) of {report.batch_size}, median TTFT "
              f"{medians} ms, {'steady' if report.steady else 'NOT steady within the bound'}", file=sys.stderr)
        return report.to_dict()

    async def measure(self, client, arm, point: LoadPoint, phase: str = "point", factor: float | None = None) -> dict:
        started = time.time()  # wall clock: a server's step trace (bench/load/trace.py --results) is split by it
        if point.conversations:
            records, duration = await self.converse(client, arm.policy, point, f"{arm.label} {point.label}")
        else:
            searched = phase in ("probe", "sweep") and point.kind == "rate"
            timed = point.kind == "rate" and math.isfinite(point.value) and self.args.run_seconds
            samples = self.samples(n=self.probe_size(point.value) if searched else
                                   probe_requests(point.value, self.args.run_seconds, self.args.num_prompts) if timed
                                   else None)
            planned = plan(samples, [arm.policy] if arm.policy else None, point, self.args)
            watch = EarlyStop(self.slos, self.args.goodput_target, len(planned)) \
                if phase == "probe" and self.slos and self.args.probe_early_stop else None
            records, duration = await self.send(client, planned, point, f"{arm.label} {point.label}", watch)
            if watch is not None and watch.stopped:
                watch.settle_s = await settle(client)
        block = result_block(records, duration, point, self.args, self.slos, self.percentiles, arm=arm.label,
                             policy=arm.policy, policy_runs="separate", phase=phase, factor=factor)
        block["wall_s"] = [started, time.time()]
        if not point.conversations and point.kind == "rate":
            sends = [p.send_at_s for p in planned if p.send_at_s is not None]
            block["arrival_window_s"] = max(sends) - min(sends) if sends else None
            if searched:
                block["probe_seconds"] = self.args.probe_seconds
                block["probe_min_requests"] = self.args.probe_min_requests or self.args.num_prompts
        if not point.conversations and point.kind == "rate" and searched:
            block["stopped_early"] = watch.to_dict() if watch is not None and watch.stopped else None
            if block["stopped_early"]:  # what the partial run proved, not the share of what it sent
                block["goodput_fraction"] = watch.bound()
                block["meets_goodput_target"] = False
        self.first_run_cold(arm.label, block)
        sat = block["saturation"] or {}
        verdict = "" if block["meets_goodput_target"] is None else \
            f", goodput {block['goodput_fraction']:.2f} ({'pass' if block['meets_goodput_target'] else 'fail'})"
        if phase == "probe" and block["meets_goodput_target"] is not None:
            block["probe_passed"] = probe_passes(block, self.args.goodput_target,
                                                 self.args.probe_judge == "goodput+queue")
            verdict += f", probe {'passed' if block['probe_passed'] else 'failed'} ({self.args.probe_judge})"
        window = f" ({block['arrival_window_s']:.1f} s of arrivals)" if block.get("arrival_window_s") else ""
        stop = block.get("stopped_early")
        window += f", STOPPED EARLY ({stop['reason']}; server idle {stop['settle_s']:.1f} s later)" if stop else ""
        print(f"{arm.label} {phase} {point.label}: {block['completed']}/{block['num_prompts']} done in "
              f"{duration:.1f} s{window}{verdict}{', SATURATED' if sat.get('saturated') else ''}"
              f"{', COLD: ' + block['cold_reason'] if block['cold'] else ''}", file=sys.stderr)
        return block


async def settle(client, timeout_s: float = SETTLE_TIMEOUT_S, every_s: float = 0.25) -> float:
    """After a run stopped early: wait until the server reports nothing queued, running or in flight (the
    dropped streams' requests aborted), so the next probe meets an empty server. Seconds it took; raises
    ClientError's kin if the server never gets there."""
    t0 = time.monotonic()
    while True:
        if server_idle(await client.health()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the server still had requests in flight {timeout_s:.0f} s after a probe stopped "
                               "early: the next probe would not meet an empty server")
        await asyncio.sleep(every_s)


def serving_work(session: Session, info: dict) -> None:
    """The workers' warnings of start-up work after ready (a compile, a graph capture: each held a step),
    read from the arm's server log once the server stopped, into info["server"]: a cold run's likely cause."""
    server = info.get("server")
    if not server or not server.get("log"):
        return
    path = session.out / server["log"]
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if LOG_MARK in line] \
        if path.exists() else []
    server["serving_work_count"] = len(lines)
    server["serving_work"] = lines[:20]


async def _arm_client(session: Session, arm, stack):
    """A client for the arm's server, starting the server first when the arm has its own."""
    from pdserve.client import AsyncClient
    a = session.args
    info = {"label": arm.label, "policy": arm.policy}
    url = a.base_url
    if arm.server_args is not None:
        head = shlex.split(a.server_command) if a.server_command else default_server_command()
        command = head + shlex.split(a.server_args) + list(arm.server_args)
        log = session.out / f"server-{arm.label}.log"
        server = ArmServer(command, log, start_timeout_s=a.server_timeout, label=arm.label)
        print(f"arm {arm.label}: starting {shlex.join(command)} (log {log})", file=sys.stderr)
        url = await stack.enter_async_context(server)
        info.update(server={"command": shlex.join(command), "log": log.name, "startup_s": server.startup_s})
    client = await stack.enter_async_context(AsyncClient(url, model=a.model, timeout_s=a.request_timeout,
                                                         headers=a.headers or None))
    info.update(base_url=url, model=await client.resolve_model())
    return client, info


async def run_separate(session: Session, arms, points) -> tuple[list[dict], list[dict]]:
    """Each arm alone. Arms with their own servers go one after another (search or points); arms sharing
    the --base-url server take each given point in turn, order flipped every point (ABBA...)."""
    a = session.args
    infos, blocks = [], []
    shared = all(arm.server_args is None for arm in arms) and not a.capacity_search and len(arms) > 1
    if shared:
        async with contextlib.AsyncExitStack() as stack:
            clients = []
            for arm in arms:
                client, info = await _arm_client(session, arm, stack)
                info["warmup"] = await session.warmup(client, arm.policy, session.samples(), arm.label)
                clients.append(client)
                infos.append(info)
            for k, point in enumerate(points):
                order = list(range(len(arms))) if k % 2 == 0 else list(range(len(arms)))[::-1]
                for i in order:
                    blocks.append(await session.measure(clients[i], arms[i], point))
        return infos, blocks
    for arm in arms:
        try:
            info, mine = await _run_arm(session, arm, points)
        except (ArmError, WarmupFailed, ClientError) as e:
            if len(arms) == 1:
                raise
            # one arm's broken server should not cost the others' runs (minutes of GPU each): recorded, and
            # the invocation still exits 1
            print(f"pdserve-bench load: arm {arm.label} failed, the other arms go on: {e}", file=sys.stderr)
            info, mine = {"label": arm.label, "policy": arm.policy, "error": str(e)}, []
        infos.append(info)
        blocks += mine
    if all("error" in info for info in infos):
        raise ArmError("every arm failed: " + "; ".join(f"{i['label']}: {i['error']}" for i in infos))
    return infos, blocks


async def _run_arm(session: Session, arm, points) -> tuple[dict, list[dict]]:
    """One arm alone (its own server when it has one): warm-up, then the points or the capacity search."""
    a = session.args
    blocks = []
    async with contextlib.AsyncExitStack() as stack:
        client, info = await _arm_client(session, arm, stack)
        info["warmup"] = await session.warmup(client, arm.policy, session.samples(), arm.label)
        if a.capacity_search:
            deadline = time.monotonic() + a.arm_budget
            cap, mine = await capacity_and_sweep(
                lambda rate, phase, factor: session.measure(client, arm, LoadPoint("rate", rate), phase, factor),
                start_rate=a.search_start_rate, max_probes=a.search_max_probes, precision=a.search_precision,
                target=a.goodput_target, factors=a.sweep_factors, out_of_time=lambda: time.monotonic() > deadline,
                fits=lambda rate: time.monotonic() + session.probe_size(rate) / rate <= deadline,
                queue=a.probe_judge == "goodput+queue")
            info["capacity"] = cap.to_dict()
            info["capacity"].update(probe_judge=a.probe_judge, probe_seconds=a.probe_seconds,
                                    probe_min_requests=a.probe_min_requests or a.num_prompts)
            info["capacity"]["rests_on_cold"] = rests_on_cold(cap, mine)
            found = "below the lowest probe" if cap.rate is None else \
                f"{cap.rate:.4g} req/s" + (f" (first fail {cap.first_fail:.4g})" if cap.first_fail else
                                           " at least (no probe failed)")
            print(f"arm {arm.label}: capacity {found}, {len(cap.probes)} probes"
                  + (", stopped by --arm-budget" if cap.out_of_time else ""), file=sys.stderr)
            blocks += mine
        else:
            for point in points:
                blocks.append(await session.measure(client, arm, point))
    serving_work(session, info)
    return info, blocks


async def run_interleaved(session: Session, arms, points) -> tuple[list[dict], list[dict]]:
    """The shared run: request i with policy i mod n, each prompt length once per policy."""
    a = session.args
    policies = [arm.policy for arm in arms]
    copies = len(policies) if not a.no_pair and a.dataset != "mooncake" else 1
    blocks = []
    async with contextlib.AsyncExitStack() as stack:
        client, info = await _arm_client(session, Arm("interleaved", None), stack)
        infos = [{**info, "label": arm.label, "policy": arm.policy,
                  "warmup": await session.warmup(client, arm.policy, session.samples(), arm.label)} for arm in arms]
        for point in points:
            planned = plan(session.samples(copies), policies if policies != [None] else None, point, a)
            started = time.time()
            records, _ = await session.send(client, planned, point, point.label)
            for arm in arms:
                mine = [r for r in records if r.policy == arm.policy]
                blocks.append(result_block(mine, own_span(mine), point, a, session.slos, session.percentiles,
                                           arm=arm.label, policy=arm.policy, policy_runs="interleaved",
                                           n_policies=len(arms)))
                blocks[-1]["wall_s"] = [started, time.time()]
                session.first_run_cold(arm.label, blocks[-1])
    return infos, blocks


def rests_on_cold(cap, blocks: list[dict]) -> list[dict]:
    """The probes the capacity answer rests on (its passing run at the capacity, its first failing run) that
    were cold. Start-up only slows a run, so a cold pass still passes; a cold first fail may have failed on
    start-up alone, and then the capacity found is a lower bound."""
    out = []
    for role, rate in (("capacity", cap.rate), ("first failing", cap.first_fail)):
        for b in blocks:
            if rate is not None and b.get("phase") == "probe" and b["request_rate"] == rate and b.get("cold") \
                    and not b.get("repeated_warm"):
                out.append({"run": role, "rate": rate, "reason": b["cold_reason"]})
    return out
