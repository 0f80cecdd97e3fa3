"""Prefill role: build a request's KV, push it into a decode worker's reserved blocks, report.

Life cycle of a request:
    Prefill   -> [pending] (FIFO, one prefill at a time; Abort removes it -> RequestFailed aborted)
              -> engine.prefill_only(req, on_layer)     layer mode: transfer.layer_done(i) after each layer
                                                        (the transfer opens at the first layer, once the
                                                        request's source blocks exist)
              -> transfer.finish(first_token)           bulk mode: everything moves now; then the decode
                                                        worker is told "kv done" with the first token
              -> engine.release()                       our blocks go back at once
              -> PrefillDone (timeline: inbox, queue, prefill; exposed transfer = last copy complete -
                                                prefill end; all on this process's clock)
                 or RequestFailed (invalid | capacity | transfer | timeout | internal; the transfer is
                                                aborted, the blocks released)

Deadline: the router gives each Prefill a deadline shorter than the decode worker's reservation;
past it the request fails with `timeout` before (or instead of) transferring, rather than sending
KV the decode worker no longer waits for (its receiver would refuse it anyway).

Connect (from the router, when a decode worker with our transport registers) shakes hands with its
KV receiver at once, so the first request to it does not pay the handshake in its TTFT.

Queues: `pending` only (each entry: the message, when it reached our socket, when the loop took it);
the engine holds a request's blocks just for the duration of one prefill.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from workers import protocol as P
from workers.engine.block_pool import OutOfBlocks
from workers.engine.request import InvalidRequest, Request
from workers.roles.base import Role, Tracked, now
from workers.transfer.base import State, TransferError, make_sender

log = logging.getLogger("pdserve.worker")


class PrefillDeadline(TransferError):
    pass


class PrefillRole(Role):
    def __init__(self, worker):
        super().__init__(worker)
        self.mode = worker.cfg.transfer.mode
        self.sender = make_sender(self.engine.kv, worker.cfg.transfer)
        self.pending: deque[tuple[P.Prefill, float, float]] = deque()  # (message, arrived, taken)

    def handle(self, msg, arrived: float | None = None) -> None:
        if isinstance(msg, P.Prefill):
            taken = now()
            self.pending.append((msg, taken if arrived is None else arrived, taken))
        elif isinstance(msg, P.Connect):
            try:
                self.sender.connect(msg.kv_address)
            except TransferError as e:  # not fatal: open() shakes hands again on first use
                log.warning("%s: early handshake with %s (%s) failed: %s", self.worker_id, msg.decode_worker,
                            msg.kv_address, e)
        elif isinstance(msg, P.Abort):
            for item in self.pending:
                if item[0].request_id == msg.request_id:
                    self.pending.remove(item)
                    self.fail(msg.request_id, "aborted", f"aborted before prefill: {msg.reason}")
                    return
        else:
            log.error("%s: prefill worker got %s; only Prefill, Connect and Abort go to prefill workers",
                      self.worker_id, type(msg).__name__)

    def tick(self) -> None:
        if self.pending:
            self._run(*self.pending.popleft())

    def poll_timeout_ms(self, idle_ms: int) -> int:
        return 0 if self.pending else idle_ms

    def queue_depth(self) -> int:
        return len(self.pending)

    def running(self) -> int:
        return 0

    def close(self) -> None:
        self.sender.close()

    def _run(self, msg: P.Prefill, received: float, taken: float) -> None:
        rid = msg.request_id
        deadline = received + msg.deadline_s
        req = Request(rid, list(msg.prompt_ids), msg.sampling.to_params())
        transfer = None

        def open_transfer(src_blocks: list[int]):
            return self.sender.open(rid, msg.kv_address, list(src_blocks), list(msg.dst_blocks), len(req.prompt_ids))

        def on_layer(layer: int) -> None:
            nonlocal transfer
            if now() >= deadline:
                raise PrefillDeadline(f"request {rid}: deadline of {msg.deadline_s:.1f}s passed during prefill "
                                      f"(layer {layer}); nothing more is sent to {msg.decode_worker}")
            if transfer is None:
                transfer = open_transfer(req.block_ids)
            transfer.layer_done(layer)

        try:
            if now() >= deadline:
                raise PrefillDeadline(f"request {rid}: waited {now() - received:.1f}s in the prefill queue, past "
                                      f"its deadline of {msg.deadline_s:.1f}s; add prefill workers or raise "
                                      f"the router's --kv-deadline")
            result = self.engine.prefill_only(req, on_layer if self.mode == "layer" else None)
            if transfer is None:
                transfer = open_transfer(result.block_ids)
            remaining = deadline - now()
            if remaining <= 0:
                raise PrefillDeadline(f"request {rid}: deadline of {msg.deadline_s:.1f}s passed before the "
                                      f"transfer to {msg.decode_worker} could start")
            stats = transfer.finish(result.first_token, remaining)
        except Exception as e:
            if transfer is not None and transfer.state is not State.DONE:
                transfer.abort(f"{type(e).__name__}: {e}")
            self.engine.release(rid)
            self.fail(rid, _failure_kind(e), _failure_text(e, self.worker_id, msg.decode_worker))
            return
        self.engine.release(rid)
        self.worker.send(P.PrefillDone(
            worker_id=self.worker_id, request_id=rid, first_token=result.first_token,
            timeline=Tracked(req, arrived=received, taken=taken).timeline(),
            transfer_ms=(stats.finished_at - stats.started_at) * 1e3,
            transfer_exposed_ms=max(0.0, (stats.finished_at - wall_clock(req.prefill_end)) * 1e3),
            kv_bytes=stats.num_bytes, copies=stats.copies,
        ))


def wall_clock(mono: float) -> float:
    """A time.monotonic() stamp of this process as time.time(), to compare with the transport's stamps."""
    return mono + (time.time() - time.monotonic())


def _failure_kind(e: Exception) -> str:
    if isinstance(e, PrefillDeadline):
        return "timeout"
    if isinstance(e, InvalidRequest):
        return "invalid"
    if isinstance(e, OutOfBlocks):
        return "capacity"
    if isinstance(e, TransferError):
        return "transfer"
    log.exception("prefill failed unexpectedly")
    return "internal"


def _failure_text(e: Exception, worker_id: str, decode_worker: str) -> str:
    if isinstance(e, (InvalidRequest, PrefillDeadline)):
        return str(e)
    if isinstance(e, TransferError):
        return f"KV transfer {worker_id} -> {decode_worker} failed: {e}"
    return f"prefill on {worker_id} failed: {type(e).__name__}: {e}"
