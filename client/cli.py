"""`pdserve-client "prompt"`: send one request, print the text, then the server's timeline.

    pdserve-client "Why is the sky blue?" --max-tokens 64 --stream --policy disaggregated
"""

from __future__ import annotations

import argparse
import sys
import time

from client.client import DEFAULT_BASE_URL, Client
from client.errors import ClientError
from client.wire import Completion
from protocol.enums import POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-client", description=__doc__.splitlines()[0])
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server address (default {DEFAULT_BASE_URL})")
    p.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="pdserve routing policy for this request (default: the server's own)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (the chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    return p


def _send(c: Client, args) -> tuple[Completion, float | None, float]:
    """The completion, the client-side TTFT (streaming only) and E2E, in seconds."""
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                   ignore_eos=True if args.ignore_eos else None)
    start = time.perf_counter()
    if not args.stream:
        out = c.chat(args.prompt, policy=args.policy, **options) if args.chat else \
            c.complete(args.prompt, policy=args.policy, **options)
        print(out.text)
        return out, None, time.perf_counter() - start
    stream = c.stream_chat(args.prompt, policy=args.policy, **options) if args.chat else \
        c.stream_complete(args.prompt, policy=args.policy, **options)
    first = None
    with stream:
        for delta in stream:
            if first is None and delta.is_token:
                first = delta.arrival - start
            print(delta.text, end="", flush=True)
    print()
    return stream.result, first, time.perf_counter() - start


def report(out: Completion, client_ttft_s: float | None, client_e2e_s: float) -> str:
    lines = ["", "-- request " + (out.id or "(no id)") + f" ({out.model or 'model ?'}), "
             f"finish_reason={out.finish_reason}"]
    if out.usage is not None:
        lines.append(f"usage: prompt_tokens={out.usage.prompt_tokens} completion_tokens={out.usage.completion_tokens}")
    client_side = f"client: e2e {client_e2e_s * 1e3:.2f} ms"
    if client_ttft_s is not None:
        client_side += f", ttft {client_ttft_s * 1e3:.2f} ms"
    lines.append(client_side)
    lines.append("server timings:")
    lines.append(out.timings.table() if out.timings is not None else "(the server reported no timings)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.base_url, model=args.model, timeout_s=args.timeout) as c:
            out, ttft, e2e = _send(c, args)
    except ClientError as e:
        print(f"pdserve-client: {e}", file=sys.stderr)
        return 1
    print(report(out, ttft, e2e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
