"""What the ipc transport asks of CUDA for one request, counted on the CPU.

The sender's GPU path (a side stream, events, the copies) runs here against a recording stand-in
for torch.cuda: every stream wait, event record and copy is logged in order with its size, so the
sequence one transfer issues is checked without a GPU. The qwen2.5-7b shape at 32k tokens (28
layers, 4 KV heads, head dim 128, bf16, block size 16: 2,048 blocks of 32 KiB per layer) lives on
the meta device (no bytes); exactness is checked on real CPU tensors through the same path.

On the H200 (bench/results/transfer-house-nvidia-h200-2026-12-02-c3da930.md) one cudaMemcpy2DAsync
for all 28 layers moved 1,792 MiB at 1,310 GB/s (65% of a 1 GiB device copy), where one 1-D copy
per layer had moved it at 1,622 GB/s (79%, 2800d5f): the 2-D memcpy itself ran at 1,556 GB/s
inside one pool against 1,858 GB/s for one copy_ per layer in the same run. A large bulk request
goes as one contiguous copy per run and layer.

A fragmented request (more than ipc.INDEX_RUNS runs) goes through block_copy.py's kernel on a GPU: the
stand-in counts its launches with their bytes and, on real CPU tensors, runs the kernel itself through
Triton's interpreter, so the exactness checks cover it.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.settings.worker import TransferConfig
from pdserve.workers.transfer import block_copy, ipc
from pdserve.workers.transfer.plan import Plan
from pdserve.workers.transfer.sender_transfer import SenderTransfer

MiB = 2**20
# qwen2.5-7b: [layers, blocks, 2, block_size, kv_heads, head_dim]; the bench's pools hold 2 x 2,050 + 8 blocks
QWEN = (28, 4108, 2, 16, 4, 128)
POISON = 0x7FC1  # a NaN pattern: a block never written keeps it


class Recorder(TorchDispatchMode):
    """Logs every aten copy (and gather / scatter) with its bytes, on the stream current at the time."""

    def __init__(self, log: list, cuda: "FakeCuda"):
        super().__init__()
        self.log, self.cuda = log, cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name == "copy_":  # (op, stream, bytes, both sides contiguous, bytes per element moved)
            self.log.append((name, self.cuda.current, args[1].numel() * args[1].element_size(),
                             args[0].is_contiguous() and args[1].is_contiguous(), args[1].element_size()))
        elif name in ("index_select", "index_copy_"):  # by block index: the gathered bytes
            moved = out if name == "index_select" else args[3]
            self.log.append((name, self.cuda.current, moved.numel() * moved.element_size(), False,
                             moved.element_size()))
        return out


class FakeCuda:
    """torch.cuda's stream context and events, and the CUDA runtime's 2-D memcpy, as a log."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = "compute"
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.timing = enable_timing

            def record(self, stream=None):
                cuda.log.append(("event_record", getattr(stream, "name", cuda.current)))

            def query(self):
                cuda.log.append(("event_query",))
                return True

        class Stream:
            def __init__(self, name: str):
                self.name, self.cuda_stream = name, 7

            def wait_event(self, event):
                cuda.log.append(("stream_wait_event", self.name))

            def record_event(self, event=None):
                event = event or Event()
                event.record(self)
                return event

            def synchronize(self):
                cuda.log.append(("stream_synchronize", self.name))

        self.Event, self.Stream = Event, Stream

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s.name
        try:
            yield
        finally:
            self.current = before

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        self.log.append(("cudaMemcpy2DAsync", self.current, width * height, False, 1))
        return 0

    def copy_blocks(self, src, dst, src_ids, dst_ids, launch=block_copy.launch):
        nbytes = src.shape[0] * src_ids.numel() * src.shape[2] * src.element_size()
        self.log.append(("copy_blocks", self.current, nbytes, False, src.element_size()))
        if src.device.type != "meta":
            launch(src, dst, src_ids, dst_ids)

    def mark(self):  # SenderTransfer.mark on a CUDA pool: an event on the compute stream
        event = self.Event()
        event.record()
        return event


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: fake.log.append(("device_synchronize",)))
    monkeypatch.setattr(SenderTransfer, "mark", lambda transfer: fake.mark())
    # the code before this fix copied a large bulk request with cudaMemcpy2DAsync, looked up here
    monkeypatch.setattr(ipc, "cuda_memcpy2d", lambda: fake.memcpy2d, raising=False)
    # pools on one device count as one GPU's: the block-copy kernel is launched, logged, and run on real
    # CPU tensors through Triton's interpreter
    monkeypatch.setattr(block_copy, "kernel_ready", lambda src, dst: src.device == dst.device)
    monkeypatch.setattr(block_copy, "launch", fake.copy_blocks)
    return fake


def gpu_transfer(cuda: FakeCuda, src: torch.Tensor, dst: torch.Tensor, runs, mode: str = "bulk"):
    """An accepted ipc transfer between two pools, on the GPU path (a side stream), without sockets."""
    sender = SimpleNamespace(cfg=TransferConfig(transport="ipc", mode=mode), kv=SimpleNamespace(pool=src),
                             stream=cuda.Stream("side"), send=None, _submit=lambda fn, *args: None)
    plan = Plan("r", tuple(runs), src.shape[0], src[0, 0].numel() * src.element_size())
    t = ipc.IpcTransfer(sender, SimpleNamespace(address="tcp://decode", remote=dst), plan)
    t.on_accept()
    return t


def issued(cuda: FakeCuda, t, layered: bool = False) -> list[tuple]:
    """Every CUDA operation the transfer issues from its first layer handed over to its ack being due."""
    with Recorder(cuda.log, cuda):
        if layered:
            for layer in range(t.plan.num_layers):
                t.layer_done(layer)
        t.start_finish(first_token=1, deadline_s=5)
        assert t.poll() is None  # the Done is out; the decode worker's ack is due
    return cuda.log


def test_a_32k_bulk_request_is_one_contiguous_copy_per_layer_on_the_side_stream(cuda):
    src = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    dst = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    t = gpu_transfer(cuda, src, dst, [(0, 2050, 2048)])
    assert t.plan.num_bytes == 1792 * MiB >= ipc.PER_LAYER_COPY_BYTES
    ops = issued(cuda, t)
    print("\n".join(map(str, ops)))
    copies = [op for op in ops if op[0] in ("copy_", "cudaMemcpy2DAsync", "index_copy_", "index_select")]
    assert copies == [("copy_", "side", 64 * MiB, True, 8)] * 28, copies  # one 1-D memcpy per layer
    assert [op for op in ops if op[0] != "event_query"] == [
        ("event_record", "compute"),  # the K/V are in the pool
        ("stream_wait_event", "side"),  # the side stream waits for that, the compute stream never waits
        ("event_record", "side"),  # the copies' start on the GPU's clock (TransferStats.start_event)
        *copies,
        ("event_record", "side"),  # the last copy done: finish() polls it (event_query), no synchronize
    ]
    assert t.copies == 28


class Views(TorchDispatchMode):
    """Counts the views (slice, select, view) a piece of code makes."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in ("slice", "select", "view")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, tokens", [("bulk", 32768), ("bulk", 4096), ("layer", 32768)])
def test_the_copies_views_are_made_when_the_transfer_opens_not_when_the_kv_is_ready(cuda, mode, tokens):
    """On the H200 a 32k bulk transfer's side stream sat idle ~0.3 ms of its 1.3 ms between the ready event and
    its first copy while the host made each layer's views: they are made when the transfer opens (at the
    prefill's first layer, before its K/V are ready), and moving the K/V makes none."""
    blocks = tokens // 16
    src = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    dst = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    with Views() as opening:
        t = gpu_transfer(cuda, src, dst, [(0, 2050, blocks)], mode)
    assert opening.count > 0
    with Views() as moving:
        ops = issued(cuda, t, layered=mode == "layer")
    assert moving.count == 0
    assert sum(op[0] == "copy_" for op in ops) == (1 if tokens == 4096 and mode == "bulk" else 28)


def test_small_bulk_and_layer_mode_keep_their_copies(cuda):
    shape = (28, 1032, 2, 16, 4, 128)  # 4k tokens: 256 blocks, 224 MiB, under PER_LAYER_COPY_BYTES
    src = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    dst = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    ops = issued(cuda, gpu_transfer(cuda, src, dst, [(0, 300, 256)]))
    # one strided copy kernel for all layers, moving 8-byte words (a quarter of the bf16 elements)
    assert [op for op in ops if op[0] == "copy_"] == [("copy_", "side", 224 * MiB, False, 8)]
    cuda.log.clear()
    ops = issued(cuda, gpu_transfer(cuda, src, dst, [(0, 300, 256)], mode="layer"), layered=True)
    copies = [op for op in ops if op[0] == "copy_"]
    assert copies == [("copy_", "side", 8 * MiB, True, 8)] * 28
    assert sum(op[0] == "stream_wait_event" for op in ops) == 28  # each layer waits for its own event
    assert not [op for op in ops if "synchronize" in op[0]]


@pytest.mark.parametrize("runs", [[(1, 2, 5), (9, 20, 3)], [(2 * i, 3 * i + 1, 1) for i in range(12)]])
@pytest.mark.parametrize("mode", ["bulk", "layer"])
def test_the_gpu_path_moves_exactly_the_runs(cuda, monkeypatch, runs, mode):
    monkeypatch.setattr(ipc, "PER_LAYER_COPY_BYTES", 0)  # the large-request path on small pools
    shape = (3, 40, 2, 4, 2, 8)
    src = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=torch.Generator().manual_seed(5))
    src = src.view(torch.bfloat16)
    dst = torch.full(shape, 0x7FC1, dtype=torch.int16).view(torch.bfloat16)  # NaN: a block never written keeps it
    t = gpu_transfer(cuda, src, dst, runs, mode)
    ops = issued(cuda, t, layered=mode == "layer")
    kernel = [op for op in ops if op[0] == "copy_blocks"]  # the fragmented case: the kernel, interpreted
    assert len(kernel) == (0 if len(runs) <= ipc.INDEX_RUNS else 1 if mode == "bulk" else shape[0])
    written = set()
    for s, d, n in runs:
        assert torch.equal(dst[:, d:d + n].view(torch.int16), src[:, s:s + n].view(torch.int16))
        written.update(range(d, d + n))
    rest = [b for b in range(shape[1]) if b not in written]
    assert (dst[:, rest].view(torch.int16) == 0x7FC1).all(), "a block outside the runs was written"


COPY_OPS = ("copy_", "index_copy_", "index_select", "copy_blocks")


def test_a_fragmented_32k_request_is_one_block_copy_launch_in_bulk_and_one_per_layer_in_layer_mode(cuda):
    # before: one index_select and one index_copy_ of 64 MiB per layer (a gather into a temporary and a
    # scatter from it: 4 x 1,792 MiB of memory traffic); now the kernel reads and writes each byte once
    src = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    dst = torch.empty(QWEN, dtype=torch.bfloat16, device="meta")
    runs = [(2 * i, 4100 - 2 * i, 2) for i in range(1024)]  # 1,024 runs of 2 blocks: 2,048 blocks
    t = gpu_transfer(cuda, src, dst, runs)
    ops = issued(cuda, t)
    copies = [op for op in ops if op[0] in COPY_OPS]
    assert copies == [("copy_blocks", "side", 1792 * MiB, False, 8)], copies
    assert sum(op[0] == "stream_wait_event" for op in ops) == 1 and t.copies == 1
    cuda.log.clear()
    t = gpu_transfer(cuda, src, dst, runs, mode="layer")
    ops = issued(cuda, t, layered=True)
    copies = [op for op in ops if op[0] in COPY_OPS]
    assert copies == [("copy_blocks", "side", 64 * MiB, False, 8)] * 28, copies
    assert sum(op[0] == "stream_wait_event" for op in ops) == 28 and t.copies == 28
    assert not [op for op in ops if "synchronize" in op[0]]


def test_a_small_fragmented_bulk_request_is_one_launch_too(cuda):
    shape = (28, 1032, 2, 16, 4, 128)  # 4k tokens in 256 runs of one block: 224 MiB, under PER_LAYER_COPY_BYTES
    src = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    dst = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    ops = issued(cuda, gpu_transfer(cuda, src, dst, [(i, 1031 - i, 1) for i in range(256)]))
    assert [op for op in ops if op[0] in COPY_OPS] == [("copy_blocks", "side", 224 * MiB, False, 8)]


@pytest.mark.parametrize("layers", [[slice(None)], [0, 1, 2]])  # bulk; layer mode's layers ready together
def test_without_the_kernel_a_fragmented_request_is_a_gather_and_a_scatter_a_layer(layers):
    # the CPU (a GPU without Triton): block_copy.copy's index ops, one layer at a time, so the temporary holds
    # one layer's blocks, never the whole request's (before: one gather and one scatter over every layer at
    # once for a bulk request, through the pool's strided [layers, blocks] view)
    shape = (3, 30, 2, 4, 2, 8)  # 256-byte blocks
    src = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=torch.Generator().manual_seed(8))
    src, dst = src.view(torch.bfloat16), torch.full(shape, POISON, dtype=torch.int16).view(torch.bfloat16)
    sender = SimpleNamespace(cfg=TransferConfig(transport="ipc", mode="bulk"), kv=SimpleNamespace(pool=src),
                             stream=None, send=None, _submit=lambda fn, *args: None)
    runs = tuple((2 * i, 29 - i, 1) for i in range(12))
    t = ipc.IpcTransfer(sender, SimpleNamespace(address="tcp://decode", remote=dst),
                        Plan("r", runs, 3, src[0, 0].numel() * 2))
    log: list = []
    with Recorder(log, SimpleNamespace(current="caller")):
        t._copies(layers)
    assert log == [("index_select", "caller", 12 * 256, False, 8), ("index_copy_", "caller", 12 * 256, False, 8)] * 3
    assert t.copies == 2 * 3
    for s, d, _ in runs:
        assert torch.equal(dst[:, d].view(torch.int16), src[:, s].view(torch.int16))
    rest = [b for b in range(30) if b not in {d for _, d, _ in runs}]
    assert (dst[:, rest].view(torch.int16) == POISON).all()


def test_fragmented_pools_on_two_devices_go_run_by_run():
    # the index ops and the kernel need both pools on one device (index_copy_ refuses a source on
    # another); two GPUs' pools are copied with copy_, which takes the peer path. Here: CPU -> meta
    shape = (2, 30, 2, 4, 2, 8)
    src, dst = torch.zeros(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16, device="meta")
    sender = SimpleNamespace(cfg=TransferConfig(transport="ipc", mode="bulk"), kv=SimpleNamespace(pool=src),
                             stream=None, send=None, _submit=lambda fn, *args: None)
    runs = tuple((i, 29 - i, 1) for i in range(12))
    t = ipc.IpcTransfer(sender, SimpleNamespace(address="tcp://decode", remote=dst),
                        Plan("r", runs, 2, src[0, 0].numel() * 2))
    log: list = []
    with Recorder(log, SimpleNamespace(current="caller")):
        t._copies([slice(None)])
    assert [op[0] for op in log] == ["copy_"] * 12 and t.copies == 12


def test_layer_spans():
    assert ipc.layer_spans([slice(None)], 28) == [(0, 28)]
    assert ipc.layer_spans(list(range(28)), 28) == [(0, 28)]
    assert ipc.layer_spans([3], 28) == [(3, 1)]
    assert ipc.layer_spans([0, 1, 2, 5, 6, 9], 28) == [(0, 3), (5, 2), (9, 1)]


def test_the_handshake_compiles_the_block_copy_kernel(monkeypatch):
    # a compile takes about a second: at the handshake, not inside a prefill's layer hook at the first
    # fragmented request
    shape = (2, 30, 2, 4, 2, 8)  # 256-byte blocks: 32 words
    local, remote = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(2))
    warmed = []
    monkeypatch.setattr(ipc, "map_cuda", lambda info, shape, dtype, address: remote)
    monkeypatch.setattr(block_copy, "kernel_ready", lambda src, dst: src.device == dst.device)
    monkeypatch.setattr(block_copy, "warmup", lambda src, dst: warmed.append((src.shape, dst.shape)))
    sender = SimpleNamespace(host="h", kv=SimpleNamespace(pool=local))
    peer = SimpleNamespace(address="tcp://decode", layout=SimpleNamespace(shape=shape, torch_dtype=torch.bfloat16))
    assert ipc.Sender._attach(sender, peer, SimpleNamespace(info=object(), host="h")) is remote
    assert warmed == [((2, 30, 32), (2, 30, 32))]
