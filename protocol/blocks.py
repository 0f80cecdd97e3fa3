"""Block names: a full KV block is named by a hash chained over its tokens and its parent's name.

The one definition of a name, shared by the engine's prefix cache (workers/engine/prefix_cache.py),
which keeps KV under these names, and the router (server/kv_index.py), which computes them from a
prompt's tokens to look up which worker holds which of its blocks. Standard library only.

    name(block i) = H(name(block i-1) + tokens of block i)      name(block -1) = root (model + layout)

Two prompts that begin alike have the same leading names, so the leading run of a prompt's names
held somewhere is the prefix whose KV is there.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

NAME_BYTES = 16


def root_name(*identity: str) -> bytes:
    """The parent name of every first block: what makes KV comparable (model, layout, dtype)."""
    return hashlib.blake2b("\0".join(identity).encode(), digest_size=NAME_BYTES).digest()


def extend_names(names: list[bytes], tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Append the names of the full blocks in `tokens`, which continue the sequence right after the
    len(names) blocks already named (a trailing partial block is left out); returns `names`."""
    parent = names[-1] if names else root
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.blake2b(parent + array("q", block).tobytes(), digest_size=NAME_BYTES).digest()
        names.append(parent)
    return names


def block_names(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The names of every full block of `tokens` from the start."""
    return extend_names([], tokens[:len(tokens) // block_size * block_size], block_size, root)
