"""`pdserve-client "prompt"`: send one request, print the text, then the server's timeline.

    pdserve-client "Why is the sky blue?" --max-tokens 64 --stream --policy disaggregated
    pdserve-client "Hello" --host 10.0.0.1 --port 8000 --api-key KEY     (or --base-url http://10.0.0.1:8000)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pdserve.client.client import DEFAULT_BASE_URL, Client
from pdserve.client.errors import ClientError
from pdserve.client.wire import Completion
from pdserve.settings.cli import HelpFormatter
from pdserve.protocol.enums import POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-client", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--base-url", default=None, help=f"server address (default: {DEFAULT_BASE_URL}, or the one "
                   "--host and --port make)")
    p.add_argument("--host", default=None, help="server host (default: 127.0.0.1), as `pdserve --host` took it")
    p.add_argument("--port", type=int, default=None, help="server port (default: 8000)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $PDSERVE_API_KEY, then "
                   "$OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="pdserve routing policy for this request (default: the server's own)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (the chat template)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=None, help="0..2 (default: the server's, greedy)")
    p.add_argument("--seed", type=int, default=None, help="seeds the sampling (with --temperature)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    return p


def base_url(args) -> str:
    """--base-url, or http://HOST:PORT from --host and --port (either alone keeps the other's default)."""
    if args.base_url is not None:
        if args.host is not None or args.port is not None:
            raise SystemExit("pdserve-client: give --base-url or --host/--port, not both")
        return args.base_url
    if args.host is None and args.port is None:
        return DEFAULT_BASE_URL
    host = args.host or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{args.port or 8000}"


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
        key = args.api_key or os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        with Client(base_url(args), model=args.model, timeout_s=args.timeout, api_key=key) as c:
            out, ttft, e2e = _send(c, args)
    except ClientError as e:
        print(f"pdserve-client: {e}", file=sys.stderr)
        return 1
    print(report(out, ttft, e2e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
