"""Weight layouts for the CPU's small-batch matrix products.

A decode step multiplies a few rows by every weight matrix. For x @ W.T with W [out, in] row-major,
MKL's product at batch 1 is `out` dot products of length `in`; when `in` is short and `out` long
they run well below the memory's bandwidth. Stored transposed (W.T contiguous, [in, out]; the
module's weight is the [out, in] view of it, so every caller sees the same values and shape), the
same product streams rows of `out` values instead. Measured on a 2-core AMD EPYC, one thread,
SmolLM2-135M's weights (float32, each read from memory as in a step), ms:

    product (count)                       batch 1           batch 2           batch 4
                                          as is  transposed as is  transposed as is  transposed
    LM head 576 -> 49152 (1)              9.5    4.2        20.8   8.7        15.9   19.6
    MLP gate, up 576 -> 1536 (60)         18.5   11.6       28.8   16.7       23.6   24.6
    MLP down 1536 -> 576 (30)             6.2    8.3        9.5    12.7       9.7    11.0

so only the products that widen (out > in) are re-laid: a SmolLM2 decode step at batch 1 goes
from 57 to 46 ms a token (transformers' generate(), the same weights as they load: 57 ms;
`pdserve-bench cpu`). Prefill-sized products (hundreds of rows) take the same time either way.

    transpose_wide(model) -> int   re-lay every nn.Linear whose out_features > in_features; a weight
                                   an embedding shares (a tied LM head) is re-laid for both (the
                                   embedding reads a step's rows of the strided view: microseconds).
                                   New parameters, same values; the old ones are not written (a model
                                   tree sharing them keeps them as they were). Returns the count.

CPU only: on CUDA the decode step's products run in compiled graphs with their own layouts.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def transpose_wide(model: nn.Module) -> int:
    # id(old weight) -> (old, re-laid): the old one held here so its id is not reused meanwhile
    relaid: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features > module.in_features:
            old = module.weight
            if id(old) not in relaid:
                relaid[id(old)] = (old, nn.Parameter(old.detach().t().contiguous().t(), requires_grad=False))
            module.weight = relaid[id(old)][1]
    for module in model.modules():  # an embedding tied to a re-laid head
        if isinstance(module, nn.Embedding) and id(module.weight) in relaid:
            module.weight = relaid[id(module.weight)][1]
    return len(relaid)
