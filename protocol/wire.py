"""What every pdserve frame shares: the one protocol version, the error a bad frame raises, msgpack.

Both vocabularies (protocol/control.py: router <-> workers; protocol/kv.py: KV sender <-> receiver)
carry this version in their handshakes (Register, Hello): a router and its workers, and two workers
exchanging KV, must run the same pdserve.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# 2: Timeline's inbox, pickup and emit stamps (the TTFT phases); 3: envelopes with the incarnation, bounds;
# 4: penalties, min_tokens, stop_token_ids, logprobs in Sampling; logprobs in TokenOut and PrefillDone;
# 5: one version for control and KV messages (the KV handshake had its own, 1); roles, transports, modes
# and failure kinds checked against their enums when a frame is decoded; 6: min_p, allowed_token_ids,
# bad_words_ids, logit_bias, include_stop_str_in_output, skip_special_tokens in Sampling; 7: Timeline carries
# the worker's stamps by name (the phases are rows: protocol/phases.py), PrefillDone no transfer_exposed_ms;
# 8: a zmq data frame's Chunk names a list of runs (layer, dst_start, num_blocks), not one run; 9: nixl staging
# (NixlInfo's staging region, Begin.stage, Accept.staging, StagedNote)
PROTOCOL_VERSION = 9


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol (or of this direction)."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def short(e: Exception) -> str:
    """An error's text cut to 200 characters (a frame's decode error quotes the frame)."""
    text = str(e)
    return text if len(text) <= 200 else text[:197] + "..."


# ---- bounds shared by every message: checked when a frame is decoded ----------------------------

MAX_INT32 = 2**31 - 1
MAX_COUNT = 2**40  # blocks, bytes of KV, free blocks: far above any pool
MAX_PROMPT_TOKENS = 1 << 21

Id = Annotated[str, msgspec.Meta(max_length=256)]  # worker and request ids
Address = Annotated[str, msgspec.Meta(max_length=512)]
Text = Annotated[str, msgspec.Meta(max_length=1 << 16)]  # error messages, reasons, token text
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
BlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
