"""The errors of a KV transfer. Each names the request, the peer and what to check or do.

Torch-free and importing nothing of the package, so every module of it can raise them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine.kv_cache import KVLayout


class TransferError(RuntimeError):
    """A transfer (or a handshake) failed: free the request's blocks on that side."""


class LayoutMismatch(TransferError):
    """The two workers' KV layouts differ in more than the number of blocks."""


class IllegalMove(RuntimeError):
    """A transfer was asked to move along its ladder (base.MOVES) from a state that does not lead there:
    a bug in the caller's order of calls (poll() before start_finish(), say), not a failed transfer."""


def layout_mismatch(prefill: KVLayout, decode: KVLayout, decode_address: str) -> LayoutMismatch:
    return LayoutMismatch(
        f"KV layouts differ: the prefill worker has {prefill.describe()}; the decode worker at {decode_address} "
        f"has {decode.describe()}. Both must serve the same model with the same KV dtype and block size "
        "(only the number of blocks may differ)"
    )
