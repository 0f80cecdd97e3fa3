"""A KV transfer endpoint in its own process, driven by JSON lines on stdin/stdout (tests only;
replies are the stdout lines that start with REPLY).

    python tests/transfer_peer.py receiver --transports ipc,zmq,nixl --layout 4,2,8,float32,16,64
        -> {"addresses": {transport: address}, "shm_path": ...}
        {"cmd": "expect", "transport", "id", "blocks", "deadline_s"}            -> {"ok": true}
        {"cmd": "wait", "id", "timeout_s", "seed", "src_layout", "src_blocks", "dst_blocks"}
            -> the Arrival, and whether the received blocks equal the sender's (its pool is regenerated
            from the seed) and every other block is still zero
    python tests/transfer_peer.py sender --transports ... --layout ... --seed N
        -> {"ready": true}
        {"cmd": "begin", "transport", "id", "peer", "src", "dst", "layers"}     -> opens, sends `layers`
            layers (layer mode), answers {"sent": n}, then keeps the transfer open until killed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pdserve.workers.engine.kv_cache import KVCache, KVLayout  # noqa: E402
from pdserve.settings.worker import TransferConfig  # noqa: E402
from pdserve.workers.transfer.registry import make_receiver, make_sender  # noqa: E402


def parse_layout(text: str) -> KVLayout:
    layers, heads, dim, dtype, block, blocks = text.split(",")
    return KVLayout(int(layers), int(heads), int(dim), dtype, int(block), int(blocks))


def layout_arg(layout: KVLayout) -> str:
    return ",".join(str(x) for x in (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                                     layout.block_size, layout.num_blocks))


def source_pool(layout: KVLayout, seed: int) -> KVCache:
    kv = KVCache(layout, "cpu")
    gen = torch.Generator().manual_seed(seed)
    kv.pool.copy_(torch.randn(kv.pool.shape, generator=gen).to(kv.pool.dtype))
    return kv


REPLY = "@peer "  # libraries (NIXL) log to stdout too; replies carry this prefix


def reply(obj) -> None:
    print(REPLY + json.dumps(obj), flush=True)


def run_receiver(args, layout: KVLayout) -> None:
    kv = KVCache(layout, "cpu", shared=True)
    receivers = {t: make_receiver(kv, TransferConfig(transport=t, deadline_s=args.deadline_s,
                                                     cancel_grace_s=args.deadline_s))
                 for t in args.transports.split(",")}
    reply({"addresses": {t: r.address for t, r in receivers.items()}, "shm_path": kv.shm_path})
    arrivals = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "expect":
            receivers[cmd["transport"]].expect(cmd["id"], cmd["blocks"], cmd["deadline_s"])
            reply({"ok": True})
        elif cmd["cmd"] == "wait":
            end = time.monotonic() + cmd["timeout_s"]
            while cmd["id"] not in arrivals and time.monotonic() < end:
                for r in receivers.values():
                    arrivals.update({a.request_id: a for a in r.poll()})
                time.sleep(0.001)
            a = arrivals.pop(cmd["id"], None)
            if a is None:
                reply({"arrival": None})
                continue
            src = source_pool(parse_layout(cmd["src_layout"]), cmd["seed"])
            dst_blocks = cmd["dst_blocks"]
            others = [b for b in range(layout.num_blocks) if b not in set(dst_blocks)]
            reply({"arrival": {"ok": a.ok, "error": a.error, "first_token": a.first_token, "num_bytes": a.num_bytes},
                   "equal": bool(torch.equal(kv.pool[:, dst_blocks], src.pool[:, cmd["src_blocks"]])),
                   "untouched": bool((kv.pool[:, others] == 0).all())})
            kv.pool[:, dst_blocks] = 0
        elif cmd["cmd"] == "quit":
            break
    for r in receivers.values():
        r.close()
    kv.close()


def run_sender(args, layout: KVLayout) -> None:
    kv = source_pool(layout, args.seed)
    senders = {t: make_sender(kv, TransferConfig(transport=t, mode="layer", deadline_s=args.deadline_s))
               for t in args.transports.split(",")}
    reply({"ready": True})
    held = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "begin":
            t = senders[cmd["transport"]].open(cmd["id"], cmd["peer"], cmd["src"], cmd["dst"],
                                               len(cmd["src"]) * layout.block_size)
            for layer in range(cmd["layers"]):
                t.layer_done(layer)
            held.append(t)
            reply({"sent": cmd["layers"]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["receiver", "sender"])
    ap.add_argument("--transports", default="ipc,zmq,nixl")
    ap.add_argument("--layout", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=10.0)
    args = ap.parse_args()
    layout = parse_layout(args.layout)
    (run_receiver if args.role == "receiver" else run_sender)(args, layout)


if __name__ == "__main__":
    main()
