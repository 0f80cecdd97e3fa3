"""Copy blocks by index between two KV pools in one pass: block src_ids[i] -> block dst_ids[i], every layer given.

    words(pool)                         a pool [layers, blocks, ...] as [layers, blocks, words], what launch takes
    copy(src, dst, src_ids, dst_ids)    what the transports call: launch() where kernel_ready(), else the index
                                        ops layer by layer (the same bytes moved); returns the calls it issued
    gather(src, dst, ids, arange)       dst[:, k] <- src[:, ids[k]]: blocks into a staging buffer (nixl's staged
                                        path); scatter(src, dst, ids, arange) dst[:, ids[k]] <- src[:, k] back out
                                        of one. launch() with arange as the buffer's ids where kernel_ready(), else
                                        one index op a layer straight into / out of the buffer (no temporary)
    kernel_ready(src, dst)              whether the kernel can run on these two tensors: both on one CUDA device,
                                        Triton installed
    launch(src, dst, src_ids, dst_ids)  src, dst: [layers, blocks, words] (words()), the same layers of two
                                        pools (one layer: a [1, blocks, words] slice); ids [n] int64 on their
                                        device, in range (plan.make_plan checks; the kernel does not), no
                                        destination twice. On the current stream; nothing waits for it
    warmup(src, dst)                    compile the variant for these pools without running it (a compile takes
                                        about a second: at the handshake, not in a prefill's layer hook)

What a fragmented request (many short runs of blocks) costs, per layer of n blocks of B bytes:
    index ops   dst.index_copy_(ids, src.index_select(ids)): a gather into a temporary and a scatter from it,
                4 n B bytes of memory traffic and two launches per layer. copy() without the kernel runs them
                one layer at a time: the temporary is one layer's blocks, never a whole request's, and on the
                CPU a real pool's layer goes faster than a pair over every layer at once, which reads the
                blocks through the pool's strided [layers, blocks] view (28 layers of 32 KiB blocks, a
                quarter of them moved: 29 ms against 180 ms on two cores)
    this kernel each program copies one block of one layer, straight from source to destination in chunks
                of CHUNK_WORDS: 2 n B bytes (each byte read once and written once, as a contiguous copy
                does) and one launch for all the layers asked for
The destination may be another process's pool (CUDA IPC) on the same device; ipc.py copies pools on two
devices run by run, where torch's copy_ takes care of the peer access.

ipc copies pool to pool by block index; zmq gathers a frame's runs into a staging buffer on the sender and
scatters it into the reserved blocks on the receiver (frames.py), each with one launch per frame; all three
through copy(). nixl's staged path (nixl_staging.py) gathers a fragmented request's blocks into a registered
staging range and scatters them out of the receiver's through gather() and scatter(): on the CPU one pass
each (index_select into the range, index_copy_ out of it: 17 and 51 us for 0.5 MiB of 4 KiB blocks in two
layers on one thread of this 2-core machine, where copy()'s pair through a temporary took 73 and 68 us).

One compiled variant per pool layout: the block and layer counts are the grid, never arguments, and the
strides, the block's words and the chunk depend only on the layout. Tests run the kernel on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: copy() runs the index ops
    triton = None

CHUNK_WORDS = 1024  # words one program moves per step (8 KiB of 8-byte words: 64 bytes a thread of 4 warps)
WORD = torch.int64  # what the copies move: 8-byte words of a block's bytes
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # the bytes as they are, never as floats


if triton is not None:

    @triton.jit
    def _copy_blocks(src_ptr, dst_ptr, src_ids, dst_ids, src_layer, src_block, dst_layer, dst_block, block_words,
                     CHUNK: tl.constexpr):
        i = tl.program_id(0)  # which pair of blocks
        layer = tl.program_id(1).to(tl.int64)
        s = tl.load(src_ids + i).to(tl.int64)
        d = tl.load(dst_ids + i).to(tl.int64)
        src = src_ptr + layer * src_layer + s * src_block  # int64 offsets: a pool may pass 2^31 words
        dst = dst_ptr + layer * dst_layer + d * dst_block
        for w0 in range(0, block_words, CHUNK):
            w = w0 + tl.arange(0, CHUNK)
            ok = w < block_words
            tl.store(dst + w, tl.load(src + w, mask=ok), mask=ok)


def words(pool: torch.Tensor) -> torch.Tensor:
    """A pool [layers, blocks, ...] as [layers, blocks, words]: its bytes as 8-byte words where a block's
    bytes divide by 8, else as [layers, blocks, elements] of its own dtype. The same bytes either way."""
    blocks = pool.view(pool.shape[0], pool.shape[1], -1)
    if blocks.shape[-1] * blocks.element_size() % WORD.itemsize:
        return blocks
    return blocks.view(WORD)


def copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> int:
    """dst[:, dst_ids[i]] <- src[:, src_ids[i]] for every layer of two [layers, blocks, words] views (words()),
    on the current stream: the kernel, one launch for all the layers, where it can run (kernel_ready); else a
    gather into a temporary and a scatter from it per layer. Returns the calls it issued (a transfer counts
    them as its copies): 1, or 2 a layer."""
    if kernel_ready(src, dst):
        launch(src, dst, src_ids, dst_ids)
        return 1
    _check(src, dst, src_ids, dst_ids)
    for s, d in zip(src, dst):
        d.index_copy_(0, dst_ids, s.index_select(0, src_ids))
    return 2 * src.shape[0]


def gather(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, arange: torch.Tensor) -> int:
    """dst[:, k] <- src[:, ids[k]] for k < len(ids), every layer of two [layers, blocks, words] views, dst's blocks
    contiguous (a staging buffer); arange: 0, 1, ... on the device, at least len(ids) long. Returns the calls."""
    if kernel_ready(src, dst):
        launch(src, dst, ids, arange[:ids.shape[0]])
        return 1
    _check(src, dst, ids, arange[:ids.shape[0]])
    for s, d in zip(src, dst):
        torch.index_select(s, 0, ids, out=d[:ids.shape[0]])
    return src.shape[0]


def scatter(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, arange: torch.Tensor) -> int:
    """dst[:, ids[k]] <- src[:, k] for k < len(ids), every layer: a staging buffer's blocks back into a pool (no id
    twice). As gather(), the other way. Returns the calls."""
    if kernel_ready(src, dst):
        launch(src, dst, arange[:ids.shape[0]], ids)
        return 1
    _check(src, dst, arange[:ids.shape[0]], ids)
    for s, d in zip(src, dst):
        d.index_copy_(0, ids, s[:ids.shape[0]])
    return src.shape[0]


def kernel_ready(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return src.device.type == "cuda" and src.device == dst.device and triton is not None


def launch(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """The kernel itself, on any device Triton runs on (a GPU, or the CPU under its interpreter)."""
    grid, args, kwargs = launch_args(src, dst, src_ids, dst_ids)
    if not grid[0] or not grid[1]:
        return
    # Triton launches on the current device's current stream
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        _copy_blocks[grid](*args, **kwargs)


def warmup(src: torch.Tensor, dst: torch.Tensor) -> None:
    ids = torch.zeros(1, dtype=torch.int64, device=src.device)
    grid, args, kwargs = launch_args(src, dst, ids, ids)
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        _copy_blocks.warmup(*args, grid=grid, **kwargs)


def launch_args(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor):
    """(grid, args, kwargs) of the kernel's launch: checked, and the words seen as integers of their size."""
    _check(src, dst, src_ids, dst_ids)
    words = src.shape[2]
    chunk = min(CHUNK_WORDS, 1 << max(words - 1, 0).bit_length())  # a power of two, at most one block
    as_int = INTS[src.element_size()]
    args = (src.view(as_int), dst.view(as_int), src_ids, dst_ids, src.stride(0), src.stride(1), dst.stride(0),
            dst.stride(1), words)
    return (src_ids.shape[0], src.shape[0]), args, {"CHUNK": chunk}


def _check(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Raise ValueError unless both are [layers, blocks, words] views of the same layers, dtype and block size,
    each block's words contiguous, with as many source as destination ids."""
    if src.dim() != 3 or dst.dim() != 3 or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"the block copy needs [layers, blocks, words] views of the same layers and block size, got "
                         f"{tuple(src.shape)} and {tuple(dst.shape)}")
    if src.dtype != dst.dtype or src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("the block copy needs both pools in one dtype with each block's words contiguous")
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(f"the block copy needs as many source as destination ids, got {tuple(src_ids.shape)} and "
                         f"{tuple(dst_ids.shape)}")

