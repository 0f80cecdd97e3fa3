"""Checksums of transferred KV blocks (--kv-checksum, a debug and test option).

The sender stamps each block it moved (the Done notice carries one 63-bit digest per destination
block, in the order of the reservation); the receiver digests the same blocks of its own pool once
every byte landed and refuses to hand the request to the engine on any difference. It catches what
a transfer test cannot see once the request runs: a block another request's late write landed in, a
byte that went astray. Cost: one pass over the request's KV on each side (on GPU the blocks are read
back to the host first), so it is off by default.
"""

from __future__ import annotations

import hashlib

import torch

MASK = 2**63 - 1
# [layers, blocks, 2, block_size, kv_heads, head_dim]: a block is pool[:, b], every layer of it


def block_checksums(pool: torch.Tensor, blocks: list[int]) -> list[int]:
    """One digest per block (blake2b, 63 bits: msgpack carries it as a signed int) of `blocks`, in that order, over all its layers' K and V bytes."""
    if not blocks:
        return []
    data = pool[:, blocks].transpose(0, 1).contiguous().cpu()  # [n, layers, 2, block_size, heads, dim]
    raw = data.view(torch.uint8).reshape(len(blocks), -1).numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") & MASK for row in raw]


def first_mismatch(pool: torch.Tensor, blocks: list[int], stamped: list[int]) -> str | None:
    """None when the blocks hold what the sender stamped; else what differs, in words."""
    if len(stamped) != len(blocks):
        return f"the sender stamped {len(stamped)} blocks, {len(blocks)} were reserved (is --kv-checksum on both sides?)"
    bad = [b for b, mine, theirs in zip(blocks, block_checksums(pool, blocks), stamped) if mine != theirs]
    if bad:
        return f"{len(bad)} of {len(blocks)} blocks differ from what the sender stamped (first: block {bad[0]})"
    return None
