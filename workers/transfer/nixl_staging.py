"""The staged path of the `nixl` transport: a fragmented request gathered, written whole, scattered.

staging.py has the bookkeeping and when a request is staged; nixl.py the agents, the Begin and Accept,
the per-run path. This module moves the bytes of the staged one:

    Staging        one side's staging region: a buffer on the pool's device, registered with the agent once
                   at start beside the pool, its bytes handed out by staging.Space (I/O thread only)
    StagedSend     sender, one transfer: its range of the sender's region (taken at the Begin, given back by
                   let_go) and the receiver's grant; gather(first, count) copies those layers of the request's
                   blocks into its range (block_copy.gather: on GPU one launch on the side stream, recorded by
                   an event; on CPU an index_select a layer, done on return); write_rows() the one descriptor
                   pair and the StagedNote of that span of layers
    Grants         receiver: the grant of each accepted Begin that asked for staging and found room (take),
                   each StagedNote checked against its grant and scattered into the reserved blocks
                   (unstage: block_copy.scatter, on GPU one launch on the receiver's scatter stream), whether a
                   grant's layers are all in and scattered (landed), and the grant given back when its request
                   ends on any path (release, from the receiver's _report: after its last scatter completed)

Layer mode keeps its overlap: a layer's gather runs once its K/V are in the pool (the base's queue posts it
after the compute stream's event), its write once the gather is done; each write's scatter runs when its note
comes, and the arrival (what lets the request's first decode step run) waits until the last one completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.protocol import kv as P
from pdserve.workers.engine.step_inputs import to_device
from pdserve.workers.transfer import block_copy, frames
from pdserve.workers.transfer.block_copy import words
from pdserve.workers.transfer.endpoint import log
from pdserve.workers.transfer.plan import Plan
from pdserve.workers.transfer.staging import Space, grant_refusal, note_layers, stages


@dataclass
class Staging:
    """One side's staging region: buffer [nbytes] uint8 on the pool's device, registered as its own region."""

    buffer: torch.Tensor
    base: int  # its address, as NIXL knows it
    device_id: int
    mem_type: str
    reg: object  # NIXL's registration (deregistered at close)
    space: Space

    @classmethod
    def register(cls, agent, pool: torch.Tensor, nbytes: int) -> "Staging | None":
        """A region of nbytes on the pool's device, registered with `agent`, its kernel warm; None for 0 bytes,
        or when it cannot be had (logged: the worker runs on, its fragmented requests run by run)."""
        if nbytes <= 0:
            return None
        cuda = pool.device.type == "cuda"
        device_id, mem_type = (pool.device.index if cuda else 0), ("VRAM" if cuda else "DRAM")
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)
            reg = agent.register_memory([(buffer.data_ptr(), nbytes, device_id, "")], mem_type)
        except Exception as e:  # out of memory, or NIXL refused the registration (its own exception types)
            log.warning("no KV staging region of %.2f GiB on %s (%r): requests of many short runs of blocks go run "
                        "by run; lower --kv-staging-gb, or 0 to go without", nbytes / 2**30, pool.device, e)
            return None
        staging = cls(buffer, buffer.data_ptr(), device_id, mem_type, reg, Space(nbytes))
        staging.warmup(pool)
        return staging

    def view(self, offset: int, layers: int, blocks: int, like: torch.Tensor) -> torch.Tensor:
        """Bytes from offset on as [layers, blocks, words] of like's dtype and block (like: a pool's words())."""
        nbytes = layers * blocks * like.shape[2] * like.element_size()
        return self.buffer[offset:offset + nbytes].view(like.dtype).view(layers, blocks, like.shape[2])

    def warmup(self, pool: torch.Tensor) -> None:
        """GPU with Triton: compile the block copy between the pool and this region now, not in a request."""
        pool_words = words(pool)
        block = pool_words.shape[0] * pool_words.shape[2] * pool_words.element_size()  # a block of every layer
        if not block_copy.kernel_ready(pool_words, self.buffer) or self.space.nbytes < block:
            return
        staged = self.view(0, pool_words.shape[0], 1, pool_words)
        block_copy.warmup(pool_words, staged)
        block_copy.warmup(staged, pool_words)


class StagedSend:
    """One transfer's staged path on the sender (I/O thread): its range, the receiver's grant, the gathers."""

    def __init__(self, staging: Staging, plan: Plan, pool: torch.Tensor, offset: int):
        self.staging, self.plan, self.pool = staging, plan, pool
        self.offset: int | None = offset  # our range of the sender's region (None once given back)
        self.grant: P.StagingGrant | None = None  # the receiver's range, once accepted and checked
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def ask(cls, staging: Staging | None, remote_bytes: int, plan: Plan, pool: torch.Tensor) -> "StagedSend | None":
        """A staged path for this plan, its range taken, if it stages (staging.stages), both sides have a region
        that can hold it and ours has room now; else None (run by run)."""
        if staging is None or remote_bytes < plan.num_bytes or not stages(plan.runs, plan.block_bytes,
                                                                          staging.mem_type):
            return None
        offset = staging.space.take(plan.num_bytes)
        return None if offset is None else cls(staging, plan, pool, offset)

    def refusal(self, grant: P.StagingGrant, remote_bytes: int) -> str | None:
        return grant_refusal(grant.offset, grant.nbytes, remote_bytes, self.plan.num_bytes)

    def give_back(self) -> None:
        if self.offset is not None:
            self.staging.space.give(self.offset)
            self.offset = None

    def gather(self, first: int, count: int) -> int:
        """Layers first..first+count-1 of the request's blocks into our range, on the current stream; the calls
        it issued (block_copy.gather's)."""
        src = words(self.pool)
        dst = self.staging.view(self.offset, self.plan.num_layers, self.plan.num_blocks, src)
        ids, arange = self._ids()
        return block_copy.gather(src[first:first + count], dst[first:first + count], ids, arange)

    def write_rows(self, first: int, count: int, remote_base: int, remote_device: int,
                   seq: int) -> tuple[np.ndarray, np.ndarray, P.StagedNote]:
        """The local and remote (addr, bytes, device) rows of one staged write of layers first..first+count-1,
        and its note."""
        at, nbytes = first * self.plan.layer_bytes, count * self.plan.layer_bytes
        local = np.array([[self.staging.base + self.offset + at, nbytes, self.staging.device_id]], dtype=np.uint64)
        remote = np.array([[remote_base + self.grant.offset + at, nbytes, remote_device]], dtype=np.uint64)
        return local, remote, P.StagedNote(self.plan.request_id, seq, self.grant.offset + at, nbytes)

    def _ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's source blocks in order, and arange over them, on the pool's device (once a transfer)."""
        if self._index is None:
            runs = self.plan.runs
            ids = frames.block_ids([s for s, _, _ in runs], [n for _, _, n in runs])
            self._index = (to_device(ids, self.pool.device), to_device(np.arange(len(ids)), self.pool.device))
        return self._index


@dataclass
class Grant:
    """Receiver: a request's range of the staging region, and what has been scattered from it."""

    exp: object  # the receiver's Expected it was granted to (a later one of the same id is another)
    offset: int
    nbytes: int
    layer_bytes: int  # one layer of the request: its blocks x the block's bytes
    seen: set[int] = field(default_factory=set)  # layers scattered (or being scattered, on GPU)
    event: torch.cuda.Event | None = None  # GPU: after its latest scatter
    index: tuple[torch.Tensor, torch.Tensor] | None = None  # its reserved blocks in order, and arange over them


class Grants:
    """Receiver (I/O thread): the staging grants of accepted requests, their notes checked and scattered."""

    def __init__(self, staging: Staging, pool: torch.Tensor, stream: torch.cuda.Stream | None):
        self.staging, self.pool, self.stream = staging, pool, stream
        self.pool_words = words(pool)
        self.by_request: dict[str, Grant] = {}

    def take(self, exp, nbytes: int, layer_bytes: int) -> P.StagingGrant | None:
        """A range for the request, or None: no room now (its sender goes run by run)."""
        offset = self.staging.space.take(nbytes)
        if offset is None:
            return None
        self.by_request[exp.request_id] = Grant(exp, offset, nbytes, layer_bytes)
        return P.StagingGrant(offset, nbytes)

    def of(self, exp) -> Grant | None:
        grant = self.by_request.get(exp.request_id)
        return grant if grant is not None and grant.exp is exp else None

    def unstage(self, exp, note: P.StagedNote) -> str | None:
        """Check a staged write's note against the request's grant and scatter its layers into the reserved
        blocks (on GPU queued on the scatter stream); why it is refused, or None."""
        grant = self.of(exp)
        if grant is None:
            return "a staged write for a request that has no staging grant"
        found = note_layers(grant.offset, grant.nbytes, note.offset, note.nbytes, grant.layer_bytes, grant.seen)
        if isinstance(found, str):
            return found
        first, count = found
        grant.seen.update(range(first, first + count))
        src = self.staging.view(note.offset, count, len(exp.dst_blocks), self.pool_words)
        dst = self.pool_words[first:first + count]
        try:
            if self.stream is None:
                block_copy.scatter(src, dst, *self._ids(grant))
                return None
            with torch.cuda.stream(self.stream):
                block_copy.scatter(src, dst, *self._ids(grant))
                grant.event = self.stream.record_event()
        except (RuntimeError, ValueError) as e:  # that request fails, not the receiver
            return f"its scatter failed: {e!r}"
        return None

    def landed(self, exp, num_layers: int) -> bool | str:
        """The Done's writes are all in: True once every layer of the grant was scattered and the scatters
        completed (False while one runs on the GPU); why not, when a layer never came."""
        grant = self.of(exp)
        if grant is None:
            return True
        if len(grant.seen) != num_layers:
            return f"its staged writes held {len(grant.seen)} of its {num_layers} layers"
        return grant.event is None or grant.event.query()

    def release(self, exp) -> None:
        """The request ended (any path): its range goes back once no scatter of it runs any more."""
        grant = self.of(exp)
        if grant is None:
            return
        if grant.event is not None:
            grant.event.synchronize()  # its blocks may go back to the pool once this returns
        del self.by_request[exp.request_id]
        self.staging.space.give(grant.offset)

    def _ids(self, grant: Grant) -> tuple[torch.Tensor, torch.Tensor]:
        """(the request's reserved blocks in order, arange over them): the scatter's ids, once a grant."""
        if grant.index is None:
            dst = np.asarray(grant.exp.dst_blocks, dtype=np.int64)
            grant.index = (to_device(dst, self.pool.device), to_device(np.arange(len(dst)), self.pool.device))
        return grant.index
