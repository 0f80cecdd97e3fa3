"""block_copy.py's kernel against a block-by-block reference, on the CPU through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1; the same kernel source the GPU compiles). The bytes are moved,
not computed, so the check is bitwise: every block asked for equals its source, every other block of the
destination keeps its seeded garbage."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.bench.engine import kernel_variants as kv
from pdserve.workers.transfer import block_copy
from pdserve.workers.transfer.ipc import words


def pools(shape_src, shape_dst, dtype, seed):
    """Two distinct pools of seeded garbage bytes, as [layers, blocks, words] views (ipc.words)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**15, 2**15, shape_src, dtype=torch.int16, generator=g).view(dtype)
    dst = torch.randint(-2**15, 2**15, shape_dst, dtype=torch.int16, generator=g).view(dtype)
    return words(src), words(dst)


def fragmented_ids(seed: int, n: int, src_blocks: int, dst_blocks: int):
    rng = random.Random(seed)
    return (torch.tensor(rng.sample(range(src_blocks), n)), torch.tensor(rng.sample(range(dst_blocks), n)))


def reference(src, dst, src_ids, dst_ids, layers):
    want = dst.clone()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        want[layers, d] = src[layers, s]
    return want


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(block_copy.INTS[t.element_size()])


# [layers, blocks, 2, block_size, heads, dim]: bf16 blocks of 80 bytes (10 words) and of 30 bytes (15 bf16
# elements: words() keeps the dtype)
@pytest.mark.parametrize("block,dtype", [((2, 4, 1, 5), torch.bfloat16), ((1, 3, 1, 5), torch.bfloat16)])
@pytest.mark.parametrize("chunk", [4, 1024])  # several chunks with a masked tail; one chunk past the block
@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_moves_exactly_the_blocks_asked_for(monkeypatch, block, dtype, chunk, seed):
    monkeypatch.setattr(block_copy, "CHUNK_WORDS", chunk)
    src, dst = pools((3, 21, *block), (3, 17, *block), dtype, seed)
    if chunk == 4:
        assert src.shape[2] % 4  # 10 words or 15 elements: the last chunk is partial
    src_ids, dst_ids = fragmented_ids(seed, 9, 21, 17)
    for layers in (slice(None), slice(1, 2)):  # all layers in one launch, one layer (layer mode)
        want = reference(src, dst, src_ids, dst_ids, layers)
        got = dst.clone()
        block_copy.launch(src[layers], got[layers], src_ids, dst_ids)
        assert torch.equal(as_bits(got), as_bits(want)), f"layers {layers}"
        untouched = [b for b in range(17) if b not in dst_ids.tolist()]
        assert torch.equal(as_bits(got[:, untouched]), as_bits(dst[:, untouched]))


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_is_one_launch_with_the_kernel_and_a_gather_and_a_scatter_a_layer_without(monkeypatch, kernel):
    """block_copy.copy, what the transports call: the kernel where it can run (here the interpreter stands in
    for a GPU), else the index ops one layer at a time (a temporary of one layer's blocks); the same bytes
    either way, and it says how many calls it issued (a transfer's `copies`)."""
    monkeypatch.setattr(block_copy, "kernel_ready", lambda src, dst: kernel)
    src, dst = pools((3, 21, 2, 4, 1, 5), (3, 17, 2, 4, 1, 5), torch.bfloat16, 5)
    src_ids, dst_ids = fragmented_ids(5, 9, 21, 17)
    for layers, calls in ((slice(None), 1 if kernel else 6), (slice(1, 2), 1 if kernel else 2)):
        want = reference(src, dst, src_ids, dst_ids, layers)
        got = dst.clone()
        assert block_copy.copy(src[layers], got[layers], src_ids, dst_ids) == calls
        assert torch.equal(as_bits(got), as_bits(want)), f"layers {layers}"
    with pytest.raises(ValueError, match="same layers"):
        block_copy.copy(src, dst[:1], src_ids, dst_ids)


def test_the_bytes_are_copied_as_integers_not_floats():
    # a bf16 NaN with a payload, a negative zero, a denormal: a float load/store on a GPU may canonicalise
    # them (the interpreter does not, so the kernel is also checked to be handed integers)
    src, dst = pools((2, 4, 1, 2, 1, 3), (2, 4, 1, 2, 1, 3), torch.bfloat16, 7)  # 12 bytes a block: bf16 elements
    assert src.dtype == torch.bfloat16
    src.view(torch.int16)[:, 1] = torch.tensor([0x7FC1, -32768, 0x0001, -0x3F, 0x7F81, 5], dtype=torch.int16)
    _, args, _ = block_copy.launch_args(src, dst, torch.tensor([1]), torch.tensor([3]))
    assert args[0].dtype == args[1].dtype == torch.int16
    block_copy.launch(src, dst, torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(dst[:, 3].view(torch.int16), src[:, 1].view(torch.int16))


def test_the_kernel_runs_only_with_both_pools_on_one_gpu():
    cpu = torch.empty(2, 4, 8, dtype=torch.int64)
    meta = torch.empty(2, 4, 8, dtype=torch.int64, device="meta")
    assert not block_copy.kernel_ready(cpu, cpu) and not block_copy.kernel_ready(meta, cpu)


def test_mismatched_pools_are_refused():
    src, dst = pools((2, 12, 2, 4, 1, 8), (2, 9, 2, 4, 1, 8), torch.bfloat16, 3)
    with pytest.raises(ValueError, match="same layers"):
        block_copy.launch(src, dst[:1], torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="as many"):
        block_copy.launch(src, dst, torch.tensor([1, 2]), torch.tensor([2]))


def test_one_compiled_variant_for_any_block_count_and_layer_span():
    # Triton compiles a kernel once per specialisation of its arguments: the block count and the layers are
    # the grid, so a request of 1 block or 2,048, in bulk or one layer at a time, runs the variant compiled
    # for its pool layout (the qwen2.5-7b block: 32 KiB, 4,096 words)
    src, dst = torch.empty(4, 40, 4096, dtype=torch.int64), torch.empty(4, 50, 4096, dtype=torch.int64)
    jit = kv.jit_of(block_copy._copy_blocks)
    keys = set()
    for layers, n in ((slice(None), 37), (slice(0, 1), 1), (slice(3, 4), 16), (slice(1, 3), 5)):
        ids = torch.arange(n)
        grid, args, kwargs = block_copy.launch_args(src[layers], dst[layers], ids, ids + 1)
        assert grid == (n, src[layers].shape[0])
        keys.add(kv.key_of(jit, args, kwargs))
    assert len(keys) == 1, keys
    # the keying can tell variants apart: a block of another size is another variant
    small = torch.empty(4, 40, 24, dtype=torch.int64)
    ids = torch.arange(3)
    assert kv.key_of(jit, *block_copy.launch_args(small, small, ids, ids)[1:]) not in keys


def test_warmup_compiles_without_copying():
    src, dst = pools((2, 12, 2, 4, 1, 8), (2, 9, 2, 4, 1, 8), torch.bfloat16, 4)
    before = dst.clone()
    block_copy.warmup(src, dst)  # the interpreter compiles nothing; a GPU compiles the launch's variant
    assert torch.equal(as_bits(dst), as_bits(before))
