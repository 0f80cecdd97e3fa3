"""pdserve: disaggregated prefill/decode LLM serving. The one name pdserve takes when installed.

The repository keeps its folders at the top (protocol/, settings/, server/, workers/, client/, bench/);
pyproject.toml maps each to `pdserve.<folder>` when installed. A checkout run without installing (the
GPU machine's PYTHONPATH) finds them through this package's path, which then reaches the folder above.
"""

from pathlib import Path as _Path

_HERE = _Path(__file__).resolve().parent
if not (_HERE / "protocol").is_dir() and (_HERE.parent / "protocol" / "wire.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (a package's own __path__)
