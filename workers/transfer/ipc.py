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

Copies, per paired run of blocks (plan.Plan.runs), never per block:
    bulk   finish(): one strided copy_ per run for all layers, dst[:, d:d+n] <- src[:, s:s+n]; on GPU
           from 512 MiB up, one 2D memcpy per run for all layers instead (cudaMemcpy2DAsync: rows = layers,
           pitch = each pool's layer stride; one copy-engine operation where copy_ per layer paid a gap of
           ~6-8 us per copy into the other process's memory), or one copy_ per run and layer where the CUDA
           runtime cannot be reached or refuses it
    layer  layer_done(l): the same copies for layer l, as soon as its K/V are in the pool
    many runs  (more than INDEX_RUNS: a fragmented pool) by block index instead, one gather and one
           scatter per layer (or for all layers at once in bulk below 512 MiB): four passes over the bytes
           instead of two, but a handful of kernels where a copy per run costs a launch and a gap each

On GPU the copies run on a side stream: layer_done(l) records an event on the current (compute)
stream, the side stream waits for it and copies; the compute stream never waits and the host
never synchronises per layer. finish() polls the side stream's last event against the deadline.
On CPU the copies are plain synchronous copy_ calls on the caller's thread.

Nothing but the handshake, Begin/Accept and the done notice crosses the socket.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import stat
import time

import torch

from pdserve.protocol import kv as P
from pdserve.protocol.shm import POOL_NAME, SHM_PREFIX
from pdserve.workers.transfer.base import WRITING, TransferState
from pdserve.workers.transfer.errors import TransferError
from pdserve.workers.transfer.peers import Peer
from pdserve.workers.transfer.plan import Plan
from pdserve.workers.transfer.receiver import ChannelReceiver
from pdserve.workers.transfer.sender import ChannelSender
from pdserve.workers.transfer.sender_transfer import SenderTransfer

PER_LAYER_COPY_BYTES = 512 * 2**20  # bulk on GPU: 2D (else per-layer) copies from this request size up
INDEX_RUNS = 8  # more runs than this (a fragmented pool): copy by block index
log = logging.getLogger("pdserve.transfer")
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

    def _move(self, layers: list[int]) -> None:
        ready = self.mark()
        if not self.layered and (self.stream is None or self.plan.num_bytes < PER_LAYER_COPY_BYTES):
            # Bulk. Measured on an H200 (bench/results/transfer-*.json): a contiguous copy_ between two
            # processes' pools costs ~40 us of fixed latency (copy engine) but streams at ~1.9 TB/s;
            # one strided copy_ of pool[:, a:b] for all layers is a single kernel with no such
            # latency but runs at ~0.9 TB/s. So: one strided copy for small requests, one copy per
            # layer for large ones (crossover between 224 MiB and 896 MiB of KV).
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
        with torch.cuda.stream(self.stream):
            if self.layered or len(layers) != self.plan.num_layers or len(self.plan.runs) > INDEX_RUNS \
                    or not self._copies_2d():
                self._copies(layers)
        self.last_event = torch.cuda.Event(enable_timing=True)
        self.last_event.record(self.stream)

    def _copies(self, layers: list[int | slice]) -> None:
        """One copy_ per run and layer, or by block index when the runs are many (on the current stream)."""
        src, dst, runs = self.src, self.dst, self.plan.runs
        if len(runs) > INDEX_RUNS:
            src_ids, dst_ids = self._block_index()
            for layer in layers:
                dim = 0 if isinstance(layer, int) else 1  # a layer's [blocks, ...], or all layers' [L, blocks, ...]
                dst[layer].index_copy_(dim, dst_ids, src[layer].index_select(dim, src_ids))
            self.copies += 2 * len(layers)
            return
        for layer in layers:
            for s, d, n in runs:
                dst[layer, d:d + n].copy_(src[layer, s:s + n], non_blocking=True)
        self.copies += len(layers) * len(runs)

    def _block_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's source and destination block ids, once per transfer, on the pool's device."""
        if self._index is None:
            src = [s + i for s, _, n in self.plan.runs for i in range(n)]
            dst = [d + i for _, d, n in self.plan.runs for i in range(n)]
            self._index = (torch.tensor(src, device=self.src.device), torch.tensor(dst, device=self.dst.device))
        return self._index

    def _copies_2d(self) -> bool:
        """Every layer of each run as one cudaMemcpy2DAsync on the side stream; False (nothing issued)
        where the CUDA runtime is out of reach or refuses the first (then copy_ per layer, from now on)."""
        memcpy2d = cuda_memcpy2d()
        if memcpy2d is None:
            return False
        src, dst = self.src, self.dst
        elem = src.element_size()
        spitch, dpitch = src.stride(0) * elem, dst.stride(0) * elem
        block = self.plan.block_bytes
        for i, (s, d, n) in enumerate(self.plan.runs):
            err = memcpy2d(dst.data_ptr() + d * block, dpitch, src.data_ptr() + s * block, spitch, n * block,
                           src.shape[0], CUDA_MEMCPY_DEVICE_TO_DEVICE, self.stream.cuda_stream)
            if err != 0:
                if i:  # some runs went out: the rest cannot wait for a fallback decision
                    raise TransferError(f"request {self.request_id}: cudaMemcpy2DAsync failed with CUDA error {err}")
                log.warning("cudaMemcpy2DAsync refused a KV copy (CUDA error %d); copying layer by layer from now on",
                            err)
                _CUDART[0] = None
                return False
            self.copies += 1
        return True


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
        return map_cuda(info, layout.shape, layout.torch_dtype, peer.address)


CUDA_MEMCPY_DEVICE_TO_DEVICE = 3
_CUDART: list = []  # [cudaMemcpy2DAsync or None], looked up once


def cuda_memcpy2d():
    """The CUDA runtime's cudaMemcpy2DAsync (the libcudart torch loaded), or None where it cannot be found."""
    if not _CUDART:
        fn = None
        for name in (f"libcudart.so.{(torch.version.cuda or '0').split('.')[0]}", "libcudart.so"):
            try:
                fn = ctypes.CDLL(name).cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            break
        if fn is None:
            log.info("no CUDA runtime library found for cudaMemcpy2DAsync; large ipc copies go layer by layer")
        _CUDART.append(fn)
    return _CUDART[0]


def wait_event(event: torch.cuda.Event, deadline: float, request_id: str, peer: str) -> None:
    """Poll a CUDA event until it completes or the deadline passes (CUDA has no timed wait)."""
    spin_until = time.monotonic() + SPIN_S
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TransferError(f"request {request_id}: the copies into the decode pool ({peer}) did not complete "
                                "within the deadline; the GPU may be hung or overloaded")
        time.sleep(0 if now < spin_until else 50e-6)
