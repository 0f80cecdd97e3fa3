"""`ipc`: both workers on one host; the prefill process writes straight into the decode pool.

The decode pool is mapped ONCE per peer into the prefill process, at the handshake:
    GPU   the receiver exports it with torch's UntypedStorage._share_cuda_() (a CUDA IPC handle, the
          same call torch.multiprocessing uses, present from torch 2.6 to 2.13); the sender opens it with
          UntypedStorage._new_shared_cuda() and views it as [layers, blocks, 2, block_size, heads, dim].
          CUDA IPC only works between two processes (a process cannot open its own handle); the
          decode GPU may differ from the prefill GPU (peer access: the copies then go over NVLink).
    CPU   the decode engine keeps its pool in a /dev/shm file (kv_shared=True, KVCache.shm_path); the
          sender maps it (mmap, MAP_SHARED) only after checking it is one: named as pdserve names its
          pools (protocol/shm.py's POOL_NAME: /dev/shm/pdserve-kv-<pid>-<8 hex>), opened without
          following links, a regular file with one link, owned by this user, exactly the size the
          handshake's layout needs. Anything else is refused and never opened for writing, so a
          handshake cannot point the sender's writes at another file.

Copies, per paired run of blocks (plan.Plan.runs), never per block, on both pools viewed as
[layers, blocks, words] of 8-byte words (`words()`: the bytes as they are, four bf16 values a word, so a
copy kernel moves a quarter of the elements; the dtype itself where a block's bytes do not divide by 8):
    bulk   finish(): one strided copy_ per run for all layers, dst[:, d:d+n] <- src[:, s:s+n]; on GPU
           from PER_LAYER_COPY_BYTES up, one contiguous copy_ (a 1-D cudaMemcpyAsync) per run and layer
           instead. Not one cudaMemcpy2DAsync for all layers (rows = layers, pitch = layer stride): on the
           H200 that moved 32k tokens (1,792 MiB) at 65% of a device copy where the 28 1-D copies had
           moved them at 79%; the 2-D memcpy ran at 1,556 GB/s inside one pool against 1,858 GB/s for
           one copy_ per layer in the same run (bench/results/transfer-house-nvidia-h200-2026-12-02-c3da930.md)
    layer  layer_done(l): the same copies for layer l, as soon as its K/V are in the pool
    Either way the copies' views are made when the transfer opens (before the K/V are ready), so the host
    issues nothing but the copies once they are.
    many runs  (more than INDEX_RUNS: a fragmented pool) by block index instead, where a copy per run costs a
           launch and a gap each (block_copy.copy, per span of layers ready together): on GPU block_copy.py's
           kernel, each block read once and written once (the bytes of a contiguous copy), one launch for all
           layers in bulk and one per layer in layer mode; on CPU (or without Triton) a gather into a
           temporary and a scatter from it per layer (four passes over the bytes). Pools on two GPUs: one
           copy_ per run and layer, as for few runs (the index ops and the kernel need both pools on one
           device; copy_ takes the peer path)

On GPU the copies run on a side stream: layer_done(l) records an event on the current (compute)
stream, the side stream waits for it and copies; the compute stream never waits and the host
never synchronises per layer. finish() polls the side stream's last event against the deadline.
On CPU the copies are plain synchronous copy_ calls on the caller's thread.

Nothing but the handshake, Begin/Accept and the done notice crosses the socket.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import time

import torch

from pdserve.protocol import kv as P
from pdserve.protocol.shm import POOL_NAME, SHM_PREFIX
from pdserve.workers.engine.step_inputs import to_device
from pdserve.workers.transfer import block_copy, frames
from pdserve.workers.transfer.block_copy import words
from pdserve.workers.transfer.base import WRITING, TransferState
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan
from pdserve.workers.transfer.receiver import ChannelReceiver
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer

PER_LAYER_COPY_BYTES = 512 * 2**20  # bulk on GPU: one copy per run and layer from this request size up
INDEX_RUNS = 8  # more runs than this (a fragmented pool): copy by block index
SPIN_S = 2e-3  # finish(): spin this long on the side stream's event before napping between queries


class Receiver(ChannelReceiver):
    transport = "ipc"

    def _setup_transport(self) -> None:
        if self.kv.pool.device.type == "cpu" and self.kv.shm_path is None:
            raise TransferError("the ipc transport on CPU needs the decode pool in shared memory: create the decode "
                                "engine with kv_shared=True")

    def _transport_info(self, hello: P.Hello) -> P.TransportInfo:
        if hello.host != self.host:
            raise TransferError(f"the ipc transport needs both workers on one host: the prefill worker {hello.sender} "
                                f"runs on {hello.host}, the decode worker {self.address} on {self.host}; use nixl or zmq")
        pool = self.kv.pool
        if pool.device.type == "cuda":
            return P.CudaIpcInfo(*pool.untyped_storage()._share_cuda_())
        return P.ShmInfo(self.kv.shm_path, self.layout.pool_bytes)


def map_shm(info: P.ShmInfo, shape: tuple[int, ...], dtype: torch.dtype, address: str) -> torch.Tensor:
    """Map the KV pool another pdserve process keeps in a /dev/shm file, once it is verified as one."""
    nbytes = math.prod(shape) * dtype.itemsize
    refused = f"decode worker at {address} named {info.path!r} as its KV pool; refused: "
    if not POOL_NAME.fullmatch(info.path):
        raise TransferError(refused + f"not a pdserve pool name ({SHM_PREFIX}<pid>-<8 hex digits>)")
    if info.nbytes != nbytes:
        raise TransferError(refused + f"it says {info.nbytes} bytes, the layout it sent needs {nbytes}")
    try:  # O_NOFOLLOW: a link planted under a pool's name is refused, not followed
        fd = os.open(info.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TransferError(refused + "this process cannot see it; the workers must share /dev/shm (containers: "
                            "--ipc=host or a shared volume)") from None
    except OSError as e:
        raise TransferError(refused + f"it cannot be opened as a plain file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise TransferError(refused + "not a regular file with a single name")
        if st.st_uid != os.getuid():
            raise TransferError(refused + f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_size != nbytes:
            raise TransferError(refused + f"it holds {st.st_size} bytes, the layout needs {nbytes}")
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file; the tensor keeps the mapping
    return torch.frombuffer(mapped, dtype=dtype, count=math.prod(shape)).view(shape)


def map_cuda(info: P.CudaIpcInfo, shape: tuple[int, ...], dtype: torch.dtype, address: str) -> torch.Tensor:
    """Open a CUDA allocation another process exported with _share_cuda_(), as a tensor of `shape`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if info.size_bytes != nbytes:
        raise TransferError(f"decode worker at {address} exported {info.size_bytes} bytes, its layout needs {nbytes}; "
                            "refused")
    torch.cuda.init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            info.device, info.handle, info.size_bytes, info.offset_bytes, info.ref_counter_handle,
            info.ref_counter_offset, info.event_handle, info.event_sync_required)
    except RuntimeError as e:
        raise TransferError(f"could not open the CUDA IPC handle of the decode worker at {address}: {e}; both "
                            "workers must be separate processes on one host that see the same GPU") from None
    empty = torch.empty(0, dtype=dtype, device=torch.device("cuda", info.device))
    return empty.set_(storage, 0, shape, contiguous_strides(shape))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class IpcTransfer(SenderTransfer):
    def __init__(self, sender: Sender, peer: Peer, plan: Plan):
        super().__init__(sender, peer, plan)
        self.dst: torch.Tensor = peer.remote
        self.stream: torch.cuda.Stream | None = sender.stream
        self.pending: list[tuple[int | slice, torch.cuda.Event | None]] = []  # waiting for the Accept
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # the block ids, for many runs
        # many runs on one device: by block index (block_copy); else a copy per run
        self._by_index = len(plan.runs) > INDEX_RUNS and self.src.device == self.dst.device
        # Bulk. Measured on an H200 (bench/results/transfer-*.json): a contiguous copy_ between two
        # processes' pools costs ~40 us of fixed latency (copy engine) but streams at ~1.9 TB/s;
        # one strided copy_ of pool[:, a:b] for all layers is a single kernel with no such
        # latency but ran at ~0.9 TB/s (bf16 elements). So: one strided copy for small requests, one
        # copy per layer for large ones (crossover between 224 MiB and 896 MiB of KV).
        self._all_at_once = not self.layered and (self.stream is None or plan.num_bytes < PER_LAYER_COPY_BYTES)
        # (destination, source) views of each run, by layer (-1: all layers, one strided copy), made here,
        # before the K/V are ready: on the H200 the views of a 32k transfer's 28 per-layer copies, made between
        # the ready event and the copies, held the side stream idle ~0.3 ms of the 1.3 ms it took
        self._views = {} if self._by_index else self._run_views()

    def _move(self, layers: list[int]) -> None:
        ready = self.mark()
        if self._all_at_once:
            self.pending.append((slice(None), ready))
        else:
            self.pending += [(layer, ready) for layer in layers]
        if self.state is not TransferState.OPENED:
            self._flush()

    def _landed(self, deadline: float) -> None:
        self._flush()  # layers done before the Accept
        if self.last_event is not None:
            wait_event(self.last_event, deadline, self.request_id, self.peer)
        self.finished_at = time.time()

    def _flush(self) -> None:
        with self.lock:  # a Cancel (I/O thread) takes the lock too: no copy starts after it
            if self.state in WRITING:
                self.mark_started()
                # layers that became ready at the same event go out in one batch (bulk: all 28)
                batch: list[int | slice] = []
                for i, (layer, ready) in enumerate(self.pending):
                    batch.append(layer)
                    if i + 1 == len(self.pending) or self.pending[i + 1][1] is not ready:
                        self._copy(batch, ready)
                        batch = []
            self.pending.clear()

    def _copy(self, layers: list[int | slice], ready: torch.cuda.Event | None) -> None:
        if self.stream is None:
            self._copies(layers)
            return
        self.stream.wait_event(ready)
        if self.start_event is None:  # the copies' start on the GPU's clock: after the KV is ready
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record(self.stream)
        with torch.cuda.stream(self.stream):
            self._copies(layers)
        self.last_event = torch.cuda.Event(enable_timing=True)
        self.last_event.record(self.stream)

    def _copies(self, layers: list[int | slice]) -> None:
        """One copy_ per run and layer (their views made beforehand, _run_views), or by block index when the runs
        are many (on the current stream)."""
        if self._by_index:
            src, dst = words(self.src), words(self.dst)
            src_ids, dst_ids = self._block_index()
            for first, count in layer_spans(layers, src.shape[0]):  # the layers ready together
                self.copies += block_copy.copy(src[first:first + count], dst[first:first + count], src_ids, dst_ids)
            return
        for layer in layers:
            for d, s in self._views[-1 if isinstance(layer, slice) else layer]:
                d.copy_(s, non_blocking=True)
        self.copies += len(layers) * len(self.plan.runs)

    def _run_views(self) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(destination, source) of each run, as 8-byte words, for every layer _copies will be asked for: all of
        them at once (key -1; a slice is no dict key before Python 3.12) or each layer. Made outside inference
        mode: a view made inside it (the transfer opens in a layer hook of the prefill's forward) is an inference
        tensor that copy_ outside it may not write."""
        with torch.inference_mode(False):
            src, dst = words(self.src), words(self.dst)
            layers = [(-1, slice(None))] if self._all_at_once else [(i, i) for i in range(self.plan.num_layers)]
            return {key: [(dst[at, d:d + n], src[at, s:s + n]) for s, d, n in self.plan.runs] for key, at in layers}

    def _block_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's source and destination block ids, once per transfer, on the pool's device: built in NumPy
        and uploaded through pinned memory on the current (side) stream, ordered before the copy that reads
        them. (torch.tensor(list, device=cuda) copies from pageable memory, which waits for the stream first:
        the host stood still until the prefill it follows was done, and a Python list of 1,000s of ids
        cost more host time besides.)"""
        if self._index is None:
            runs = self.plan.runs
            counts = [n for _, _, n in runs]
            src = frames.block_ids([s for s, _, _ in runs], counts)
            dst = frames.block_ids([d for _, d, _ in runs], counts)
            self._index = (to_device(src, self.src.device), to_device(dst, self.dst.device))
        return self._index


def layer_spans(layers: list[int | slice], num_layers: int) -> list[tuple[int, int]]:
    """(first, count) per span of consecutive layers; slice(None) is all of them."""
    spans: list[tuple[int, int]] = []
    for layer in layers:
        first, count = (0, num_layers) if isinstance(layer, slice) else (layer, 1)
        if spans and spans[-1][0] + spans[-1][1] == first:
            first, count = spans[-1][0], spans.pop()[1] + count
        spans.append((first, count))
    return spans


class Sender(ChannelSender):
    transport = "ipc"
    info = (P.ShmInfo, P.CudaIpcInfo)
    transfer_class = IpcTransfer

    def _attach(self, peer: Peer, welcome: P.Welcome) -> torch.Tensor:
        info = welcome.info
        if welcome.host != self.host:
            raise TransferError(f"the ipc transport needs both workers on one host; the decode worker at "
                                f"{peer.address} runs on {welcome.host}, this one on {self.host}; use nixl or zmq")
        layout = peer.layout
        if isinstance(info, P.ShmInfo):
            return map_shm(info, layout.shape, layout.torch_dtype, peer.address)
        remote = map_cuda(info, layout.shape, layout.torch_dtype, peer.address)
        if block_copy.kernel_ready(self.kv.pool, remote):  # its compile now, not in a fragmented request's copies
            block_copy.warmup(words(self.kv.pool), words(remote))
        return remote


def wait_event(event: torch.cuda.Event, deadline: float, request_id: str, peer: str) -> None:
    """Poll a CUDA event until it completes or the deadline passes (CUDA has no timed wait)."""
    spin_until = time.monotonic() + SPIN_S
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TransferError(f"request {request_id}: the copies into the decode pool ({peer}) did not complete "
                                "within the deadline; the GPU may be hung or overloaded")
        time.sleep(0 if now < spin_until else 50e-6)
