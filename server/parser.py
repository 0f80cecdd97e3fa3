"""`pdserve`'s argument parser: argparse, with a bad flag answered in one line instead of the usage
block, and that line saying what to type instead:

    pdserve: unrecognized arguments: --gpu-memory-utilization 0.9 (vLLM's flag; pdserve sizes the KV pool
             in GiB: --kv-memory-gb, or in blocks: --num-blocks); `pdserve --help` lists every flag
    pdserve: unrecognized arguments: --chunk-token 64 (did you mean --chunk-tokens?); ...

VLLM_SPELLINGS maps vLLM's server flags (and `vllm serve MODEL`) to pdserve's way of saying the same,
or why there is none; any other unknown flag gets the closest of the parser's own.
"""

from __future__ import annotations

import argparse
import difflib
import re

from pdserve.settings.cli import HelpFormatter

VLLM_SPELLINGS = {
    "serve": "vLLM's `vllm serve MODEL`; pdserve's is `pdserve --model MODEL`",
    "--gpu-memory-utilization": "vLLM's flag; pdserve sizes the KV pool in GiB: --kv-memory-gb, or in blocks: "
                                "--num-blocks",
    "--max-model-length": "pdserve's (and vLLM's) is --max-model-len",
    "--tensor-parallel-size": "pdserve runs each worker on one device; --devices deals workers to GPUs",
    "-tp": "pdserve runs each worker on one device; --devices deals workers to GPUs",
    "--pipeline-parallel-size": "pdserve runs each worker on one device; --devices deals workers to GPUs",
    "--max-num-batched-tokens": "pdserve's are --chunk-tokens (chunked prefill) and --max-batched-tokens "
                                "(a prefill worker's batch, and with --no-chunked-prefill a colocated step)",
    "--enable-chunked-prefill": "chunked prefill is pdserve's default (--no-chunked-prefill turns it off)",
    "--enable-prefix-caching": "the prefix cache is pdserve's default (--no-prefix-cache turns it off)",
    "--no-enable-prefix-caching": "pdserve's is --no-prefix-cache",
    "--kv-cache-dtype": "the KV cache takes the model's --dtype",
    "--swap-space": "pdserve's host-memory KV tier is --host-cache-gb",
    "--cpu-offload-gb": "pdserve's host-memory KV tier is --host-cache-gb",
    "--enforce-eager": "pdserve's is --no-compile (CUDA)",
    "--disable-log-stats": "pdserve's is --stats-interval 0",
    "--disable-log-requests": "pdserve logs no request unless --access-log",
    "--uvicorn-log-level": "pdserve's is --log-level",
    "--kv-transfer-config": "pdserve's KV transfer is --transport and --mode",
    "--trust-remote-code": "pdserve runs transformers' model code for a local checkpoint; no flag needed",
    "--download-dir": "pdserve reaches no model hub: give --model a local checkpoint directory",
    "--quantization": "pdserve serves float32, float16 or bfloat16 weights (--dtype)",
    "--seed": "a seed is per request (the `seed` field)",
    "--max-logprobs": "pdserve's bound is 20 top logprobs per token",
}


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}{hint(message, list(self._option_string_actions))}; "
                     f"`{self.prog} --help` lists every flag\n")


def hint(message: str, options: list[str]) -> str:
    """" (what to type instead)" for the first unknown word of argparse's message, or ""."""
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown is None:
        return ""
    word = unknown.group(1).split("=")[0]
    if word in VLLM_SPELLINGS:
        return f" ({VLLM_SPELLINGS[word]})"
    if not word.startswith("-"):
        return f" (pdserve takes no positional argument: the model is --model {word})"
    close = difflib.get_close_matches(word, [o for o in options if o.startswith("--")], n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""
