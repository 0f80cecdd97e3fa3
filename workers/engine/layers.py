"""A decoder cut at its attention calls, so the dense parts between them can be replayed as CUDA
graphs (graphs.py, MixedGraphs) while attention runs eagerly over any mix of decodes and prompt
chunks.

A step's forward becomes L + 1 segments around L attention calls:

    segment 0        embed the step's tokens, rotary cos/sin of their positions, layer 0 up to attention
    segment l        layer l - 1 after attention (output projection, residual, MLP), layer l up to attention
    segment L        the last layer after attention, the final norm, the LM head over the kept rows

Every segment reads and writes only the static buffers of `Cut` (rows [0, T) of each), so a
segment captured once for T rows replays for any step of at most T tokens: the residual stream
`h`, the projections `q`, `k`, `v` (rotary applied), the attention output `attn`, cos/sin, the
token ids and positions, the kept rows' indices and their logits.

The arithmetic is transformers' own, module by module (the same norms, projections, MLP, rotary
function, head), on a [T, hidden] sequence instead of [1, T, hidden]; only Llama-style decoders
(Llama, Qwen2, Mistral without a sliding window) are cut: `cuttable(model)` says whether this one is.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

KINDS = ("llama", "qwen2", "mistral")


def cuttable(model: nn.Module) -> bool:
    """A decoder whose layers are norm -> attention -> residual -> norm -> MLP -> residual, with
    rotary embeddings from the model and no per-head norms or sliding window."""
    cfg = model.config
    inner = getattr(model, "model", None)
    if cfg.model_type not in KINDS or getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "q_norm", None) is not None or not hasattr(attn, "o_proj"):
            return False
        if not (hasattr(attn, "qkv_proj") or all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))):
            return False
    return model.get_output_embeddings() is not None


class Cut:
    """The model's segments and the static buffers they share (rows up to `max_tokens`; logits of up
    to `max_keep` rows)."""

    def __init__(self, model: nn.Module, max_tokens: int, max_keep: int, device: torch.device,
                 compile: bool = False):
        if not cuttable(model):
            raise ValueError(f"{type(model).__name__}: not a Llama-style decoder; it cannot be cut at attention")
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.head = model.get_output_embeddings()
        self.rotary = importlib.import_module(type(self.layers[0].self_attn).__module__).apply_rotary_pos_emb
        attn0 = self.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = attn0.head_dim
        dtype = self.head.weight.dtype
        hidden = cfg.hidden_size
        # one row more than a step uses: a segment's rows are never its whole buffer. Dynamo guards a view's
        # base like a size, and duck sizing ties two equal sizes: segments compiled first over every row
        # would compile again at the next row count
        n, hd = max_tokens + 1, self.head_dim
        z = dict(dtype=dtype, device=device)
        self.max_tokens, self.max_keep = max_tokens, max_keep
        self.h = torch.zeros(n, hidden, **z)
        self.q = torch.zeros(n, self.num_heads, hd, **z)
        self.k = torch.zeros(n, self.kv_heads, hd, **z)
        self.v = torch.zeros(n, self.kv_heads, hd, **z)
        self.attn = torch.zeros(n, self.num_heads * hd, **z)
        self.cos = torch.zeros(n, hd, **z)
        self.sin = torch.zeros(n, hd, **z)
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.keep = torch.zeros(max_keep, dtype=torch.long, device=device)
        self.logits = torch.zeros(max_keep, cfg.vocab_size, dtype=torch.float32, device=device)
        # compiled (CUDA): one code for every layer and token count, its norms, rotary and MLP
        # activations fused; inside a CUDA graph that is most of what separates a segment from its GEMMs
        self.before, self.after = before_attention, after_attention
        if compile:
            self.before = torch.compile(before_attention, dynamic=True)
            self.after = torch.compile(after_attention, dynamic=True)

    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def segment(self, i: int, t: int, kept: int | None = None, *, inputs: tuple | None = None,
                keep: torch.Tensor | None = None) -> None:
        """Run segment i over rows [0, t) of the buffers; the last one's head over the first `kept`
        rows of `keep` (None: all of them, the static shape a graph needs). A decode graph gives its own
        `inputs` ((ids, positions), [>= t] each: segment 0 reads them instead of `ids` and `pos`) and its
        own `keep` (the rows whose logits it wants): the compiled code never sees either."""
        h = self.h[:t]
        if i == 0:
            ids, pos = inputs or (self.ids, self.pos)
            h[:] = self.inner.embed_tokens(ids[:t])
            cos, sin = self.inner.rotary_emb(h.unsqueeze(0), pos[:t].unsqueeze(0))
            self.cos[:t], self.sin[:t] = cos[0], sin[0]
        else:
            self.after(self.layers[i - 1], h, self.attn[:t])
        if i < len(self.layers):
            self.before(self.layers[i], h, self.cos[:t], self.sin[:t], self.q[:t], self.k[:t], self.v[:t], self.rotary)
        else:
            x = self.inner.norm(h)
            if keep is None:
                keep = self.keep if kept is None else self.keep[:kept]
            self.logits[:len(keep)].copy_(self.head(x[keep]).float())


def before_attention(layer: nn.Module, h, cos, sin, q_out, k_out, v_out, rotary) -> None:
    """Layer up to attention: norm, Q/K/V projections, rotary; into q_out, k_out, v_out ([t, heads, dim])."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k = rotary(q.view(q_out.shape), k.view(k_out.shape), cos, sin, unsqueeze_dim=1)
    q_out.copy_(q)
    k_out.copy_(k)
    v_out.copy_(v.view(v_out.shape))


def after_attention(layer: nn.Module, h, attn_out) -> None:
    """Layer after attention, in place on the residual stream h: output projection, residual, MLP, residual."""
    h += layer.self_attn.o_proj(attn_out)
    h += layer.mlp(layer.post_attention_layernorm(h))
