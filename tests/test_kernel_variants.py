"""How many Triton variants of the paged-attention kernels a CUDA worker compiles, keyed on the CPU as
Triton keys them for an NVIDIA GPU (bench/engine/kernel_variants.py): each variant is a compile of
about a second at a worker's start, or in the middle of serving."""

from __future__ import annotations

import pytest

from pdserve.bench.engine import kernel_variants as kv


@pytest.mark.parametrize("sms", [132, 108])  # H100 / H200, A100
def test_every_decode_bucket_and_mixed_step_runs_one_variant_per_kernel(sms):
    # qwen2.5-7b at max_model_len 32768, max_num_seqs 64: 64 decode graphs (8 batch x 8 table buckets).
    # Before, a bucket's batch and split count were specialised (== 1, % 16 == 0, neither), _combine's
    # padded split count was compile-time, and one split passed bf16 partial pointers: on an H100 the
    # decode graphs compiled 6 variants of the attention kernel and 20 of _combine, and mixed steps
    # (any decode count, table width and context) 17 and 27 in all
    shape = kv.Shape(sms=sms)
    decode = kv.decode_graph_launches(shape)
    assert len(decode.batches) * len(decode.blocks) == 64
    graphs = kv.launch_keys(decode)
    mixed = kv.launch_keys(kv.mixed_step_launches(shape))
    for name in kv.KERNELS:
        labels = [label for keys in graphs[name].values() for label in keys]
        assert name != "_paged_attention" or len(labels) == 64  # each bucket launches it once a layer
        assert len(graphs[name]) == 1, (name, {k: v[:4] for k, v in graphs[name].items()})
        assert set(mixed[name]) == set(graphs[name]), name  # serving compiles nothing the start did not


def test_the_keys_tell_specialisations_apart():
    # the keying itself can fail: a kernel whose batch is specialised shows one key per kind of batch
    import triton
    import triton.language as tl

    def scale(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    import torch

    x = torch.zeros(64)
    plain = triton.runtime.jit.JITFunction(scale)
    loose = triton.runtime.jit.JITFunction(scale, do_not_specialize=["n"])
    keys = {kv.key_of(plain, (x, n), {"BLOCK": 64}) for n in (1, 2, 3, 16, 32)}
    assert len(keys) == 3  # n == 1, n % 16 == 0, neither
    assert len({kv.key_of(loose, (x, n), {"BLOCK": 64}) for n in (1, 2, 3, 16, 32)}) == 1
    assert kv.key_of(loose, (x, 1), {"BLOCK": 32}) != kv.key_of(loose, (x, 1), {"BLOCK": 64})
