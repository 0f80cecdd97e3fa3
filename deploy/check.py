"""Check a deployment end to end, transport by transport: start `pdserve`, send the same greedy
requests through the colocated and the disaggregated policy, require identical tokens, print
each request's timeline, stop pdserve and require that no worker outlives it.

    python deploy/check.py                                   # smollm2-135m on every GPU (or CPU)
    python deploy/check.py --model qwen2.5-7b --devices cuda:0,cuda:1 --prompt-tokens 1024,8192,32000
    python deploy/check.py --model tiny --device cpu --transports zmq --modes layer

Exit status 0 when every pair matched and every timeline was causal
(queue + prefill + exposed transfer <= TTFT), 1 otherwise. --json writes every row to a file.
With PDSERVE_API_KEY set, pdserve requires it and this script sends it (Bearer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# pdserve reads the same variable: with it set, every request (and /health's PIDs) needs the key
HEADERS = {"Authorization": f"Bearer {os.environ['PDSERVE_API_KEY']}"} if os.environ.get("PDSERVE_API_KEY") else {}


def start(args, transport: str, mode: str) -> tuple[subprocess.Popen, str, list[int]]:
    cmd = [sys.executable, "-m", "pdserve.server.cli", "--model", args.model, "--port", "0", "--transport", transport,
           "--mode", mode, "--log-level", "WARNING", *args.extra]
    cmd += ["--device", args.device] if args.device else (["--devices", args.devices] if args.devices else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    end = time.monotonic() + args.startup_timeout
    for line in proc.stdout:
        print(f"  {line.rstrip()}", flush=True)
        if line.startswith("pdserve ready:"):
            url = line.split()[2]
            pids = [w["pid"] for w in httpx.get(url + "/health", headers=HEADERS).json()["workers"]]
            return proc, url, pids
        if time.monotonic() > end:
            break
    proc.kill()
    raise SystemExit(f"pdserve ({transport}/{mode}) did not get ready (exit code {proc.poll()})")


def stop(proc: subprocess.Popen, pids: list[int]) -> bool:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    end = time.monotonic() + 15
    left = pids
    while left and time.monotonic() < end:
        left = [p for p in left if _alive(p)]
        time.sleep(0.1)
    if left:
        print(f"  FAIL: workers {left} outlived pdserve")
    return not left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def run_pair(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict:
    out = {}
    for policy in ("colocated", "disaggregated"):
        r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "policy": policy,
                                                       "ignore_eos": True, "return_token_ids": True})
        if r.status_code != 200:
            raise SystemExit(f"{policy} request failed: {r.status_code} {r.text}")
        out[policy] = r.json()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--devices", default=None, help="as pdserve --devices (default: every GPU, else cpu)")
    p.add_argument("--device", default=None, help="one device for every worker")
    p.add_argument("--transports", default="ipc,nixl,zmq")
    p.add_argument("--modes", default="bulk,layer")
    p.add_argument("--prompt-tokens", default="16,1024", help="comma-separated prompt lengths")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="requests per length and policy (the first warms up)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("extra", nargs="*", help="more pdserve flags, after --")
    args = p.parse_args()

    rng = random.Random(0)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    prompts = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in lengths}
    rows, ok = [], True
    print("| transport | mode | prompt | policy | ttft ms | queue | prefill | transfer | exposed | 1st step | KV MiB | tokens match |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for transport in args.transports.split(","):
        for mode in args.modes.split(","):
            print(f"starting pdserve with {transport}/{mode}", file=sys.stderr, flush=True)
            proc, url, pids = start(args, transport, mode)
            try:
                with httpx.Client(timeout=600, headers=HEADERS) as client:
                    for n, prompt in prompts.items():
                        for rep in range(args.repeats):
                            pair = run_pair(client, url, prompt, args.max_tokens)
                            same = (pair["colocated"]["choices"][0]["token_ids"]
                                    == pair["disaggregated"]["choices"][0]["token_ids"])
                            for policy, body in pair.items():
                                t = body["timings"]
                                causal = t["queue_ms"] + t["prefill_ms"] + (t["transfer_exposed_ms"] or 0) <= t["ttft_ms"] + 1e-3
                                ok &= same and causal
                                row = {"transport": transport, "mode": mode, "prompt_tokens": n, "repeat": rep,
                                       "match": same, "causal": causal, **t}
                                rows.append(row)
                                if rep == args.repeats - 1:
                                    print(f"| {transport} | {mode} | {n} | {policy} | {t['ttft_ms']:.1f} | "
                                          f"{t['queue_ms']:.1f} | {t['prefill_ms']:.1f} | {_f(t['transfer_ms'])} | "
                                          f"{_f(t['transfer_exposed_ms'])} | {_f(t['first_decode_step_ms'])} | "
                                          f"{t['kv_bytes'] / 2**20:.1f} | {'yes' if same else 'NO'}"
                                          f"{'' if causal else ' (timeline not causal!)'} |", flush=True)
            finally:
                ok &= stop(proc, pids)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("all matched, all timelines causal, no orphans" if ok else "FAILED (see above)")
    return 0 if ok else 1


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
