"""What the engine hands back to the roles: a step's output per request, a prefill's result.

    StepOutput                  one request's token of one step (or its error), its text, and whether it finished
    PrefillResult               prefill_only(): token 1, its logits and the request's blocks (kept for the transfer)
    with_logprobs(out, lp)      a step's output with the logprobs its request asked for
    prompt_logprobs_complete(req, token)   token 1, or the error of a request whose prompt logprobs have a gap
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.protocol.control import TokenLogprobs
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.sampler import SamplingError


@dataclass
class StepOutput:
    request_id: str
    token_id: int  # -1 when error is set
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    logits: torch.Tensor | None = None  # [vocab] float32 on CPU, when the request asked for it
    logprobs: TokenLogprobs | None = None  # this token's, when the request asked (params.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # with token 1, when it asked (params.prompt_logprobs)
    error: str | None = None  # the request failed (finish_reason "error"): what went wrong
    request: Request | None = field(default=None, repr=False)  # the request itself (its timeline)


@dataclass
class PrefillResult:
    first_token: int
    logits: torch.Tensor  # [vocab] float32, on the engine's device
    block_ids: list[int]


def with_logprobs(out: StepOutput, logprobs: TokenLogprobs | None) -> StepOutput:
    """A step's output with the logprobs its request asked for (token 1 brings the prompt's)."""
    req = out.request
    if out.error is None:
        out.logprobs = logprobs
        if req.params.prompt_logprobs is not None and len(req.output_ids) == 1:
            out.prompt_logprobs = req.prompt_logprobs
    return out


def prompt_logprobs_complete(req: Request, token: int | SamplingError) -> int | SamplingError:
    """Token 1 of a request that asked for prompt logprobs: all of them must be there (positions
    skipped, e.g. a cached prefix, have none: the request fails rather than report a gap)."""
    if (req.params.prompt_logprobs is None or req.output_ids or isinstance(token, SamplingError)
            or len(req.prompt_logprobs) == len(req.prompt_ids) - 1):
        return token
    return SamplingError(f"request {req.request_id}: {len(req.prompt_logprobs)} of its "
                         f"{len(req.prompt_ids) - 1} prompt logprobs were computed (positions skipped); "
                         f"retry it")
