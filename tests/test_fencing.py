"""Fenced block reuse and the integrity check, on every transport: the decode and prefill roles driven
in one process (tests/role_shell.py) with --kv-checksum on both sides, under mixed traffic with
aborts and deadlines at every phase, every completed request's tokens compared with a colocated run of
the same prompt (greedy, so bitwise: the same kernels on the same KV bytes).

The fault that matters is a late write: a transfer the decode worker gave up on (the router's abort,
its deadline) whose writes were already in flight and land afterwards (the fake sender's `late`
fault holds them until the test lets them land, workers/transfer/fake.py). Each round: request A is
accepted, its writes held; A is aborted or misses its deadline; request B reserves next (with A's
blocks, if they went back); B's KV arrives and B starts decoding; then A's writes land; B finishes.
The fenced receiver keeps A's blocks until A's sender confirms it stopped (zero mismatches, every
block back at the end); the unfenced one (make_unfenced_receiver: the peers' 2026 behaviour) hands
them to B, and B's tokens or its checksum show it. Kills of a sender: test_transfer.py (its death
is the fence) and test_chaos.py (whole workers under load)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.protocol import control as P
from pdserve.settings.worker import EngineConfig, TransferConfig
from pdserve.protocol.enums import TRANSPORTS
from role_shell import Shell, pump, tokens_of
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.kv_cache import KVCache, KVLayout
from pdserve.workers.engine.request import SamplingParams
from pdserve.workers.transfer import fake
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.registry import make_receiver, make_sender

pytestmark = pytest.mark.timeout(240)

DECODE_BLOCKS = 12  # small: a block that goes back is the next reservation's
PROMPT_TOKENS = 40  # 3 blocks of 16
ROUNDS = 2
SAMPLING = P.Sampling(max_tokens=6, ignore_eos=True)


def tiny(num_blocks: int, shared: bool = False) -> Engine:
    return Engine(EngineConfig(model="tiny", num_blocks=num_blocks, kv_shared=shared, prefix_cache=False))


@pytest.fixture(scope="module")
def colocated():
    eng = tiny(64)
    cache: dict[tuple, list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            [r] = eng.generate([prompt], SamplingParams(max_tokens=SAMPLING.max_tokens, ignore_eos=True))
            cache[tuple(prompt)] = r.output_ids
        return cache[tuple(prompt)]

    return reference


class Cluster:
    """A decode and a prefill role over one transport; the router's part played by the methods."""

    def __init__(self, transport: str, fenced: bool):
        cfg = TransferConfig(transport=transport, deadline_s=10.0, cancel_grace_s=30.0, checksum=True)
        self.d = Shell("decode", tiny(DECODE_BLOCKS, shared=True), cfg)
        if not fenced:
            self.d.role.receiver.close()
            self.d.role.receiver = fake.make_unfenced_receiver(self.d.engine.kv, cfg)
            self.d.role.kv_address = self.d.role.receiver.address
        self.p = Shell("prefill", tiny(64), cfg)
        self.p.role.sender.close()
        self.p.role.sender = fake.make_sender(self.p.engine.kv, cfg, "late")
        self.failed: dict[str, str] = {}

    def pump(self, until, timeout_s: float = 20.0) -> None:
        def seen() -> bool:
            for shell in (self.p, self.d):
                for m in shell.take(P.RequestFailed):
                    self.failed.setdefault(m.request_id, m.error)
            return until()
        pump([self.p, self.d], seen, timeout_s)

    def reserve(self, rid: str, prompt: list[int], deadline_s: float = 10.0) -> P.Reserved:
        self.d.role.handle(P.Reserve(rid, prompt, SAMPLING, deadline_s=deadline_s))
        got: list[P.Reserved] = []
        self.pump(lambda: got.extend(m for m in self.d.take(P.Reserved) if m.request_id == rid) or got)
        return got[0]

    def prefill(self, rid: str, prompt: list[int], reserved: P.Reserved) -> None:
        self.p.role.handle(P.Prefill(rid, prompt, SAMPLING, self.d.worker_id, reserved.kv_address,
                                     reserved.dst_blocks, 8.0))

    def status(self, rid: str):
        req = self.d.engine.requests.get(rid)
        return None if req is None else req.status.value

    def tokens(self, rid: str) -> list[int]:
        return [o.token_id for o in tokens_of(self.d, rid)]

    def ended(self, rid: str) -> bool:
        return rid in self.failed or any(o.finished for o in tokens_of(self.d, rid))

    def close(self) -> None:
        self.p.role.close(), self.d.role.close(), self.d.engine.kv.close()


def prompt_of(rng: random.Random, n: int = PROMPT_TOKENS) -> list[int]:
    return [rng.randrange(5, 300) for _ in range(n)]


def run_round(c: Cluster, rng: random.Random, i: int, reference) -> tuple[int, int, list[str]]:
    """One round; (completed requests compared, mismatches, what happened)."""
    log = []
    a, b = f"late-{i}", f"b-{i}"
    pa, pb = prompt_of(rng), prompt_of(rng)
    how = rng.choice(["abort", "deadline"])
    ra = c.reserve(a, pa, deadline_s=1.0 if how == "deadline" else 10.0)
    c.prefill(a, pa, ra)
    c.pump(lambda: c.status(a) in ("receiving", None) or a in c.failed)  # accepted: its writes are in flight
    if how == "abort":
        c.d.role.handle(P.Abort(a, "the router gave up"))
    c.pump(lambda: a in c.failed or c.status(a) != "receiving", timeout_s=5)
    settle = time.monotonic() + 0.3  # the receiver's report reaches the role: A's blocks go back, or stay fenced
    c.pump(lambda: c.status(a) is None or time.monotonic() > settle)
    log.append(f"{a} {how}: {c.status(a)}, blocks {ra.dst_blocks}")
    rb = c.reserve(b, pb)
    c.prefill(b, pb, rb)
    c.pump(lambda: c.tokens(b) or c.ended(b))  # B's KV arrived (and passed its checksum), it decodes
    c.p.role.sender.release(a)  # A's writes land now
    log.append(f"{b}: blocks {rb.dst_blocks}")
    # noise: requests aborted at each phase, or left to finish
    noise = []
    for j, phase in enumerate(rng.sample(["before_prefill", "after_prefill", "running", "none"], 3)):
        rid, prompt = f"n-{i}-{j}", prompt_of(rng, rng.randrange(5, 40))
        r = c.reserve(rid, prompt)
        if phase == "before_prefill":
            c.d.role.handle(P.Abort(rid, "the router gave up"))
            continue
        c.prefill(rid, prompt, r)
        if phase == "after_prefill":
            c.d.role.handle(P.Abort(rid, "the router gave up"))
            c.p.role.handle(P.Abort(rid, "the router gave up"))
        elif phase == "running":
            c.pump(lambda: c.tokens(rid) or c.ended(rid))
            c.d.role.handle(P.Abort(rid, "the router gave up"))
        noise.append((rid, prompt))
    c.pump(lambda: c.ended(b) and all(c.ended(rid) or c.status(rid) is None for rid, _ in noise))
    compared = mismatches = 0
    for rid, prompt in [(b, pb)] + noise:
        if any(o.finished for o in tokens_of(c.d, rid)):
            compared += 1
            if c.tokens(rid) != reference(prompt):
                mismatches += 1
                log.append(f"{rid}: MISMATCH {c.tokens(rid)} vs colocated {reference(prompt)}")
    if b in c.failed:
        log.append(f"{b} failed: {c.failed[b]}")
    return compared, mismatches, log


def chaos(transport: str, fenced: bool, reference) -> dict:
    rng = random.Random(f"{transport}-{fenced}")
    c = Cluster(transport, fenced)
    out = {"compared": 0, "mismatches": 0, "log": []}
    try:
        for i in range(ROUNDS):
            compared, mismatches, log = run_round(c, rng, i, reference)
            out["compared"] += compared
            out["mismatches"] += mismatches
            out["log"] += log
        # every request ended and the fences passed: every block back
        c.pump(lambda: not c.d.engine.requests or all(r.status.value == "finished" for r in
                                                      c.d.engine.requests.values()), timeout_s=15)
        out["free"] = c.d.engine.blocks.num_free == c.d.engine.blocks.num_blocks
        out["waits"], out["held"], out["integrity"] = c.d.role.receiver.figures()
        out["integrity_failed"] = sum("integrity check" in e for e in c.failed.values())
    finally:
        c.close()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fenced_reuse_under_chaos_matches_colocated(transport, colocated):
    start = time.monotonic()
    got = chaos(transport, True, colocated)
    print(f"\n{transport} fenced: {got['compared']} compared, {got['mismatches']} mismatches, fenced waits "
          f"{got['waits']}, integrity failures {got['integrity']} ({time.monotonic() - start:.1f} s)")
    assert got["mismatches"] == 0 and got["integrity"] == 0, "\n".join(got["log"])
    assert got["compared"] >= ROUNDS  # every B at least
    assert got["free"] and got["held"] == 0, "\n".join(got["log"])
    if transport != "zmq":  # one-sided: an accepted late request's blocks waited for their fence (one whose
        assert got["waits"] >= 1, got  # deadline passed before its Begin was refused: nothing could write)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unfenced_reuse_under_the_same_chaos_corrupts(transport, colocated):
    """The check can fail: without the fence, the late writes land in B's blocks."""
    got = chaos(transport, False, colocated)
    print(f"\n{transport} unfenced: {got['compared']} compared, {got['mismatches']} mismatches, integrity "
          f"failures {got['integrity']}")
    assert got["mismatches"] + got["integrity"] > 0, "\n".join(got["log"])


# ---- the integrity check on its own ---------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_checksum_passes_exact_kv_and_refuses_blocks_that_differ(transport):
    """Exact KV passes; KV whose source changed after it was copied (a source block reused before the
    transfer finished) is refused before the request could run, and counted."""
    layout = KVLayout(4, 2, 8, "float32", 16, 32)
    dst, src = KVCache(layout, "cpu", shared=True), KVCache(layout, "cpu")
    cfg = TransferConfig(transport=transport, mode="layer", deadline_s=5.0, checksum=True)
    recv, send = make_receiver(dst, cfg), make_sender(src, cfg)
    try:
        src.pool.copy_(torch.randn(src.pool.shape))
        for rid, corrupt in (("exact", False), ("changed", True)):
            recv.expect(rid, [4, 5, 6], deadline_s=5)
            t = send.open(rid, recv.address, [1, 2, 3], [4, 5, 6], 40)
            assert t.wait_accepted(5)
            for layer in range(layout.num_layers):  # moved as each layer is done
                t.layer_done(layer)
            if corrupt:  # after the copies are on their way, before the done notice is stamped
                time.sleep(0.2)
                src.pool[:, 2] += 1.0
            try:
                t.finish(first_token=1, deadline_s=5)
            except TransferError:
                assert corrupt
            arrival = next(a for a in wait_all(recv) if a.request_id == rid)
            assert arrival.ok is not corrupt, arrival
            if corrupt:
                assert "integrity check" in arrival.error and "block 5" in arrival.error
            else:
                assert torch.equal(dst.pool[:, [4, 5, 6]], src.pool[:, [1, 2, 3]])
        assert recv.figures()[2] == 1
    finally:
        send.close(), recv.close(), dst.close()


def wait_all(recv, timeout_s: float = 5.0) -> list:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = recv.poll()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("no arrival")
