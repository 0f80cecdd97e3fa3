"""Model loading: the real SmolLM2 (from its converted cache), the seeded tiny model, the
Qwen2.5-7B shape (on the meta device), checkpoint directories, and the cache's atomicity."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.settings import models as model_files
from pdserve.workers.engine import models
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.models import build_meta, kv_bytes_per_token, load_model

REPO = Path(__file__).resolve().parents[1]
HASH_SNIPPET = """
import hashlib
from pdserve.workers.engine.models import load_model
m = load_model("tiny").model
h = hashlib.sha256()
for name, t in sorted(m.state_dict().items()):
    h.update(name.encode()); h.update(t.detach().cpu().contiguous().numpy().tobytes())
print(h.hexdigest())
"""


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu")


def test_tiny_same_weights_in_every_process():
    a, b = load_model("tiny"), load_model("tiny")
    assert weights_hash(a.model) == weights_hash(b.model)
    other = subprocess.run([sys.executable, "-c", HASH_SNIPPET], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip().splitlines()[-1] == weights_hash(a.model)


def test_tiny_shape_and_logits_depend_on_context():
    tiny = load_model("tiny")
    cfg = tiny.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (2, 64, 4, 2, 16, 128)
    assert cfg.vocab_size == len(tiny.tokenizer) == models.SMOLLM2_VOCAB_SIZE
    assert tiny.max_model_len == 2048 and not tiny.model.training
    assert tiny.model.config._attn_implementation == "sdpa"
    ids = torch.tensor([tiny.tokenizer.encode("one two three four five six seven eight")])
    changed = ids.clone()
    changed[0, 0] = 1000
    with torch.no_grad():
        a, b = tiny.model(ids).logits[0], tiny.model(changed).logits[0]
    # the last position's logits must see the first token (attention is not washed out)
    assert (a[-1] - b[-1]).abs().max() > 0.1
    # greedy tokens vary from position to position (not one token everywhere)
    assert len(set(a.argmax(-1).tolist())) > len(ids[0]) // 2


def test_smollm2_loads_from_cache(smollm2):
    cache = model_files.smollm2_cache_dir()
    assert (cache / "model.safetensors").is_file() and (cache / model_files.CACHE_MANIFEST).is_file()
    assert smollm2.name == "smollm2-135m" and smollm2.max_model_len == 8192
    assert next(smollm2.model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in smollm2.model.parameters()) == 134_515_008
    tok = smollm2.tokenizer
    assert smollm2.eos_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") in smollm2.eos_token_ids


def test_smollm2_tokenizer_round_trip_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    text = "Paged KV caches move in blocks of 16 tokens: ünïcödé, 数字 42!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert smollm2.chat_template_available
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi there<|im_end|>\n" in chat
    assert chat.endswith("<|im_start|>assistant\n")


def test_smollm2_greedy_answer_is_real_text(smollm2):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = smollm2.model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=smollm2.eos_token_ids)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_qwen25_7b_shape_on_meta():
    model = build_meta("qwen2.5-7b")
    cfg = model.config
    assert next(model.parameters()).device.type == "meta"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (
        3584, 28, 28, 4, 18944, 152064, 32768)
    assert cfg.rms_norm_eps == 1e-6 and not cfg.tie_word_embeddings
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 57_344
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                      "bfloat16", 16, 1)
    assert layout.bytes_per_token == 57_344
    # Qwen2.5-7B-Instruct's published size: 7.62B parameters (untied lm_head, q/k/v biases)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512


def test_randomize_is_seeded_and_not_degenerate():
    a, b = build_meta("tiny"), build_meta("tiny")
    a.to_empty(device="cpu")
    b.to_empty(device="cpu")
    models.randomize(a, 0.02, seed=7)
    models.randomize(b, 0.02, seed=7)
    assert weights_hash(a) == weights_hash(b)
    w = a.model.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


def test_local_checkpoint_directory(tmp_path):
    tiny = load_model("tiny")
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert again.name == str(tmp_path) and again.eos_token_ids == tiny.eos_token_ids
    ids = torch.tensor([[1, 2, 3, 400, 5000]])
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, tiny.model(ids).logits)


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError) as err:
        load_model("gpt-9")
    for name in models.MODEL_NAMES:
        assert name in str(err.value)


def test_dtype_defaults():
    assert models.resolve_dtype(None, "cpu") == torch.float32
    assert models.resolve_dtype(None, "cuda:0") == torch.bfloat16
    assert models.resolve_dtype(None, "cpu", "qwen2.5-7b") == torch.bfloat16
    assert models.resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert load_model("tiny", "bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        models.resolve_dtype("int3", "cpu")


def test_killed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))

    def dies_halfway(dest: Path):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the conversion is killed after writing part of the files

    monkeypatch.setattr(model_files, "_convert_smollm2", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        model_files.ensure_smollm2_cache()
    models_dir = tmp_path / "models"
    assert not (models_dir / "smollm2-135m").exists()
    assert not list(models_dir.glob("smollm2-135m.tmp-*"))
    # a leftover from a process killed with SIGKILL is swept by the next conversion
    (models_dir / "smollm2-135m.tmp-999-dead").mkdir()

    def completes(dest: Path):
        dest.mkdir(parents=True)
        (dest / model_files.CACHE_MANIFEST).write_text(json.dumps(model_files.manifest_expected(None)))

    monkeypatch.setattr(model_files, "_convert_smollm2", completes)
    assert model_files.ensure_smollm2_cache() == models_dir / "smollm2-135m"
    assert not list(models_dir.glob("smollm2-135m.tmp-*"))


def test_qwen25_7b_loader_path_on_a_shrunk_config(monkeypatch):
    """The real loader (built under the target device, seeded normal init, SmolLM2 tokenizer),
    run on the CPU with the 7B config cut down to two narrow layers."""
    full = models.qwen25_7b_config

    def shrunk():
        cfg = full()
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 512, 2
        cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:2]
        return cfg

    monkeypatch.setattr(models, "qwen25_7b_config", shrunk)
    loaded = load_model("qwen2.5-7b", device="cpu")
    model = loaded.model
    assert loaded.max_model_len == 32768 and model.dtype == torch.bfloat16
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 152064
    assert loaded.eos_token_ids[0] == loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    w = model.lm_head.weight.float()
    assert abs(w.std().item() - models.RANDOM_INIT_STD) < 0.002 and w.abs().max() > 0
    ids = torch.tensor([loaded.tokenizer.encode("The capital of France")])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_a_worker_keeps_inductors_compiled_code_in_pdserves_cache(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from pdserve.workers.cli import keep_compiled_code

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    want = tmp_path / "compile" / "inductor"
    assert keep_compiled_code() == str(want)
    assert cache_dir() == str(want) and want.is_dir()  # where Inductor writes (its Triton kernels beneath)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert keep_compiled_code() == str(tmp_path / "mine") and cache_dir() == str(tmp_path / "mine")
