"""One projection for Q, K and V: a decode step at small batch reads each weight once, and three
small matrix-vector products (K and V are 8x smaller than Q in a 7B model) cost three launches,
three split-K reductions and a bandwidth the small ones never reach. One [hidden, q+k+v] product
does the same arithmetic in one kernel (measured on the H200 at batch 1: the q/k/v products and
their reductions were 0.7 ms of a 5.6 ms step).

`fuse_gate_up(model)` does the same for each MLP's gate and up projections (Llama and Qwen2 style:
gate_proj, up_proj, down_proj, act_fn): one [hidden, 2 x intermediate] product, split in two, instead
of two products of the same input. At batch 1 each is a large matrix-vector product already (qwen2.5-7b:
136 MB of weights each), so what it saves is one launch and its tail per layer, 28 a step; it is off
(EngineConfig.fuse_gate_up) until a GPU A/B of the decode step measures it.

`fuse_qkv(model)` replaces, in every attention module whose shape it knows (Llama and Qwen2 style:
q_proj, k_proj, v_proj, o_proj, rotary applied by the model module's `apply_rotary_pos_emb`, no
per-head norms, no sliding window), its three projections by one `qkv_proj` and its forward by
`forward_fused` below, which is transformers' own forward with the three products as one. The old
weights are freed. Modules of any other shape are left as they are; the count fused is returned.
"""

from __future__ import annotations

import importlib
import types

import torch
from torch import nn

from pdserve.workers.engine import attention


def _fusable(module: nn.Module) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return False
    if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
        return False
    if getattr(module, "sliding_window", None):
        return False
    rotary = getattr(importlib.import_module(type(module).__module__), "apply_rotary_pos_emb", None)
    return rotary is not None and hasattr(module, "head_dim") and hasattr(module, "scaling")


def forward_fused(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
    # hidden_states: [1, T, hidden] -> ([1, T, hidden], None), as the module's own forward
    shape = hidden_states.shape[:-1]
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    q = q.view(*shape, -1, self.head_dim).transpose(1, 2)  # [1, H, T, D]
    k = k.view(*shape, -1, self.head_dim).transpose(1, 2)  # [1, KVH, T, D]
    v = v.view(*shape, -1, self.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = self.apply_rotary(q, k, cos, sin)
    out, _ = attention.paged_attention(self, q, k, v, attention_mask, scaling=self.scaling)
    return self.o_proj(out.reshape(*shape, -1)), None


@torch.no_grad()
def _joined(projs: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the projections' outputs, in order (their weights, and biases if all
    have one, stacked along the output dimension)."""
    first = projs[0]
    out = nn.Linear(first.in_features, sum(p.out_features for p in projs), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    out.weight.copy_(torch.cat([p.weight for p in projs]))
    if out.bias is not None:
        out.bias.copy_(torch.cat([p.bias for p in projs]))
    return out


@torch.no_grad()
def fuse_qkv(model: nn.Module) -> int:
    fused = 0
    for module in model.modules():
        if not _fusable(module):
            continue
        projs = [module.q_proj, module.k_proj, module.v_proj]
        has_bias = [p.bias is not None for p in projs]
        if any(has_bias) and not all(has_bias):
            continue
        module.qkv_sizes = [p.out_features for p in projs]
        module.qkv_proj = _joined(projs)
        del module.q_proj, module.k_proj, module.v_proj
        module.apply_rotary = importlib.import_module(type(module).__module__).apply_rotary_pos_emb
        module.forward = types.MethodType(forward_fused, module)
        fused += 1
    return fused


def _mlp_fusable(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not all(isinstance(m, nn.Linear) for m in (gate, up, getattr(module, "down_proj", None))):
        return False
    return (callable(getattr(module, "act_fn", None)) and gate.in_features == up.in_features
            and gate.out_features == up.out_features and (gate.bias is None) == (up.bias is None))


def forward_gate_up(self, x):
    # transformers' LlamaMLP / Qwen2MLP forward, down(act(gate(x)) * up(x)), with one product for gate and up
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


@torch.no_grad()
def fuse_gate_up(model: nn.Module) -> int:
    fused = 0
    for module in model.modules():
        if not _mlp_fusable(module):
            continue
        module.gate_up_proj = _joined([module.gate_proj, module.up_proj])
        del module.gate_proj, module.up_proj
        module.forward = types.MethodType(forward_gate_up, module)
        fused += 1
    return fused
