"""The served arm of `pdserve-bench cpu --served`: the round's prompts through a `pdserve` server.

    Served(model, threads, log_dir, server_args)   start `pdserve [server_args] --model M --threads T
                                      --port 0` (without server_args the CPU default: prefill, decode and
                                      colocated workers, a router; T torch threads each) and hold a client
                                      to it; close() stops both
    expected_text(tokenizer, tokens) -> str   the text the server answers for these tokens: special
                                      tokens left out (skip_special_tokens, the API's default)
    Served.round(prompts, new_tokens, tag) -> (ms, record)   every prompt sent at once as its token ids,
                                      streamed, by the load generator's own request (bench/load/runner.
                                      send_one, ignore_eos, max_tokens = new_tokens); ms: the requests'
                                      mean TPOT, (E2E - TTFT) / (tokens - 1) as `pdserve-bench load`
                                      reports it; record: every request's TPOT, text, gaps between
                                      tokens, TTFT and the worker that served it

A prompt of the bench's length (128) is below the router's --auto-threshold (256), so it is served
colocated: the path a short chat takes. The router, the client's event loop and the idle workers share
the cores with the worker that decodes, as they do for a user of the CPU default.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from pdserve.bench.load.arms import ArmServer, default_server_command
from pdserve.bench.load.runner import Planned, SendOptions, send_one
from pdserve.bench.load.workload import Sample


def expected_text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


class Served:
    def __init__(self, model: str, threads: int, log_dir: Path, server_args: list[str] | tuple[str, ...] = ()):
        from pdserve.client import AsyncClient

        # the bench's model and threads last: they win over the same flags in server_args
        self.command = default_server_command() + [*server_args, "--model", model, "--threads", str(threads)]
        self.log = log_dir / f"server-threads{threads}.log"
        self.loop = asyncio.new_event_loop()
        self.server = ArmServer(self.command, self.log, start_timeout_s=600, label=f"served-threads{threads}")
        try:
            self.url = self.loop.run_until_complete(self.server.__aenter__())
            self.client = AsyncClient(self.url, timeout_s=300)
        except BaseException:
            self.loop.run_until_complete(self.server.stop())  # a no-op when it never started
            self.loop.close()
            raise
        self.ready = next(line for line in self.log.read_text(errors="replace").splitlines() if "ready:" in line)

    def round(self, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, dict]:
        t0 = time.perf_counter()
        planned = [Planned(i, Sample(p, len(p), new_tokens, kind="cpu-bench"), None) for i, p in enumerate(prompts)]

        async def together():
            return await asyncio.gather(*(send_one(self.client, p, t0, SendOptions()) for p in planned))

        recs = self.loop.run_until_complete(together())
        for r in recs:
            if not r.success or r.output_len != new_tokens:
                raise RuntimeError(f"{tag}: a served request gave {r.output_len} of {new_tokens} tokens "
                                   f"({r.error or 'no error'}; server log {self.log})")
        tpot_ms = [r.tpot_s * 1e3 for r in recs]
        record = {"tpot_ms": tpot_ms, "texts": [r.reply for r in recs],
                  "itl_ms": [x * 1e3 for r in recs for x in r.itls_s], "ttft_ms": [r.ttft_s * 1e3 for r in recs],
                  "workers": sorted({((r.timings or {}).get("route") or {}).get("worker") or "?" for r in recs})}
        return statistics.fmean(tpot_ms), record

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.aclose())
        finally:
            self.loop.run_until_complete(self.server.stop())
            self.loop.close()
