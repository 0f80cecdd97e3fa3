"""The two processes of `pdserve-bench transfer`: prefill and decode, driven by JSON lines.

    python -m pdserve.bench.transfer.roles prefill|decode --model M --device D ... (started by bench/transfer/table.py)

Each loads the model once and answers one command per stdin line with one stdout line that starts
with REPLY (libraries such as NIXL log to stdout too).

Every run has its own prompt (seeded: bench/transfer/check.py) and the decode side poisons the
reserved blocks (NaN) before the transfer, so a transport that moves too little cannot pass the
exact-match check on an earlier run's KV. `--break FAULT` (prefill side) makes our senders drop
part of every request, to show that the check then fails.

Prefill side (our transports, one sender per transport and mode, and the seed's method):
    bandwidth {nbytes, to}              device-to-device copy of one buffer, GB/s
    paged_copy {blocks}                 a request's blocks across all layers inside this pool: one strided
                                        copy_ vs one copy_ per layer, GB/s
    prefill {n, seed}                   plain prefill_only, ms (the reference for layer-wise extra)
    transfer {id, n, seed, transport, mode, peer, dst, profile?}   prefill + move the KV into the decode
                                        blocks; the transfer opens at layer 0 in both modes, so the receiver's
                                        Accept comes back while prefill runs; profile: a folder, finish()
                                        under torch.profiler (bench/transfer/profile.py)
    seed_prepare {n, info}              map the decode side's contiguous buffer
    seed {id, n, seed, mode}            untimed: prefill this prompt and keep a contiguous copy of its K/V
                                        (as transformers' DynamicCache holds it); timed: prefill again +
                                        one copy_ per layer for K and V (bulk: after prefill; layer: from
                                        a hook, on a side stream)
Decode side:
    prepare {id, n, seed, method}       the colocated reference run of this prompt (untimed); then for our
                                        transports reserve blocks, poison them, expect the transfer ->
                                        blocks, receiver address; for the seed's method poison its buffer
    decode {id, n, transport, first_token, logits_sha}   wait for the KV, adopt, decode to --tokens and
                                        compare tokens and logits bitwise with the reference
    seed_buffer {n}                     a contiguous [layers, 2, kv_heads, n, head_dim] buffer, exported
    seed_decode {id, n, first_token, logits_sha}   scatter that buffer into reserved (poisoned) blocks,
                                        then as decode
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import uuid

import msgspec
import torch

from pdserve.bench.engine.decode import sync
from pdserve.bench.transfer.check import break_sender, parse_fault, poison, prompt_ids, scrub, step_logits
from pdserve.bench.transfer.pools import paged_copy, parse_method, release, scatter
from pdserve.bench.transfer.profile import profiled
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.request import Request, SamplingParams
from pdserve.settings.keys import load_worker_keys
from pdserve.protocol import kv as P
from pdserve.settings.worker import TransferConfig
from pdserve.protocol.enums import MODES
from pdserve.protocol.phases import ms
from pdserve.protocol.shm import SHM_PREFIX
from pdserve.workers.transfer.registry import make_receiver, make_sender
from pdserve.workers.transfer.ipc import map_cuda, map_shm, wait_event

REPLY = "@bench "


def logits_digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def make_engine(args, device: str, max_len: int, shared: bool) -> Engine:
    blocks = 2 * math.ceil((max_len + args.tokens) / args.block_size) + 8
    # chunked_prefill off: the decode side's colocated reference prefills the prompt in one step,
    # as prefill_only does on the prefill side, so both compute the same KV bit for bit; the prefix
    # cache off: every repeat computes and moves the whole prompt
    return Engine(EngineConfig(model=args.model, device=device, dtype=args.dtype, block_size=args.block_size,
                               num_blocks=blocks, max_num_seqs=8, max_batched_tokens=max(8192, max_len),
                               chunked_prefill=False, kv_shared=shared, max_model_len=max_len + args.tokens + 1,
                               prefix_cache=False))


def transfer_config(args, method: str, **kw) -> TransferConfig:
    """A method's TransferConfig: its transport; zmq-curve with the bench's keys (--keys)."""
    transport, variant = parse_method(method)
    keys = load_worker_keys(args.keys) if variant == "curve" else None
    streams = {"streams": args.kv_streams} if args.kv_streams else {}
    return TransferConfig(transport=transport, deadline_s=args.deadline_s, keys=keys, **streams, **kw)


class PrefillSide:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.engine = make_engine(args, args.device, args.max_len, shared=False)
        self.senders = {(t, m): make_sender(self.engine.kv, transfer_config(args, t, mode=m))
                        for t in args.transports.split(",") for m in MODES}
        fault = parse_fault(args.fault)
        if fault is not None:
            for sender in self.senders.values():
                break_sender(sender, fault)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.seed_dst: dict[int, torch.Tensor] = {}
        self.seed_src: dict[int, list[torch.Tensor]] = {}

    def hello(self) -> dict:
        return {"layout": self.engine.layout.describe(), "bytes_per_token": self.engine.layout.bytes_per_token,
                "num_layers": self.engine.layout.num_layers, "model": self.engine.model_name,
                "dtype": self.engine.layout.dtype}

    def bandwidth(self, cmd) -> dict:
        src = torch.empty(cmd["nbytes"], dtype=torch.uint8, device=self.device)
        dst = torch.empty(cmd["nbytes"], dtype=torch.uint8, device=cmd["to"])
        runs = []
        for i in range(6):
            sync(self.device), sync(dst.device)
            start = time.perf_counter()
            dst.copy_(src)
            sync(self.device), sync(dst.device)
            if i:  # the first one warms up
                runs.append(time.perf_counter() - start)
        runs.sort()
        return {"gbps": cmd["nbytes"] / runs[len(runs) // 2] / 1e9}

    def paged_copy(self, cmd) -> dict:
        """A request's paged-KV copy patterns inside this pool (bench/transfer/pools.py)."""
        return paged_copy(self.engine.kv.pool, cmd["blocks"], self.device)

    def request(self, rid: str, n: int, seed: int) -> Request:
        return Request(rid, prompt_ids(self.engine.vocab_size, n, seed),
                       SamplingParams(max_tokens=self.args.tokens, ignore_eos=True))

    def prefill(self, cmd) -> dict:
        req = self.request(f"plain-{uuid.uuid4().hex[:8]}", cmd["n"], cmd["seed"])
        sync(self.device)
        start = time.perf_counter()
        self.engine.prefill_only(req)
        ms = (time.perf_counter() - start) * 1e3
        self.engine.release(req.request_id)
        return {"prefill_ms": ms}

    def transfer(self, cmd) -> dict:
        sender = self.senders[(cmd["transport"], cmd["mode"])]
        req = self.request(cmd["id"], cmd["n"], cmd["seed"])
        holder = []
        fillers = []
        if parse_method(cmd["transport"])[1] == "fragmented":  # the prompt's blocks scattered over the pool
            fillers = scatter(self.engine, -(-cmd["n"] // self.engine.layout.block_size), cmd["seed"])

        def open_transfer():
            return sender.open(req.request_id, cmd["peer"], list(req.block_ids), cmd["dst"], cmd["n"])

        def on_layer(layer: int) -> None:  # bulk: layer_done is a no-op, opening early hides the Begin/Accept
            if not holder:
                holder.append(open_transfer())
            holder[0].layer_done(layer)

        sync(self.device)
        start = time.perf_counter()
        try:
            result = self.engine.prefill_only(req, on_layer)
            prefill_ms = (time.perf_counter() - start) * 1e3
            prefill_end = time.time()
            prefill_event = gpu_mark(self.device)
            if not holder:
                holder.append(open_transfer())
            stats, profile = profiled(lambda: holder[0].finish(result.first_token), cmd.get("profile"), self.device)
        except Exception as e:
            if holder:
                holder[0].abort(repr(e))
            self.engine.release(req.request_id)
            release(self.engine, fillers)
            return {"error": f"{type(e).__name__}: {e}"}
        self.engine.release(req.request_id)
        release(self.engine, fillers)
        done_event = stats.done_event
        gpu_exposed = copy_gpu_ms = None
        if prefill_event is not None and done_event is not None:
            gpu_exposed = max(0.0, prefill_event.elapsed_time(done_event))
        if stats.start_event is not None and done_event is not None:  # the copies alone, on the GPU's clock
            copy_gpu_ms = stats.start_event.elapsed_time(done_event)
        return {"prefill_ms": prefill_ms, "transfer_ms": (stats.finished_at - stats.started_at) * 1e3,
                "exposed_ms": max(0.0, stats.finished_at - prefill_end) * 1e3, "copies": stats.copies,
                "exposed_gpu_ms": gpu_exposed, "copy_gpu_ms": copy_gpu_ms, "ucx_lane": stats.ucx_lane, "runs": stats.runs,
                "kv_bytes": stats.num_bytes, "first_token": result.first_token, "profile": profile,
                "logits_sha": logits_digest(result.logits)}

    # ---- the seed's method: a contiguous cache, one copy_ per layer for K and V ------------------

    def seed_prepare(self, cmd) -> dict:
        n = cmd["n"]
        L = self.engine.layout
        info = msgspec.json.decode(cmd["info"], type=P.TransportInfo)
        shape = (L.num_layers, 2, L.num_kv_heads, n, L.head_dim)
        if isinstance(info, P.CudaIpcInfo):
            self.seed_dst[n] = map_cuda(info, shape, L.torch_dtype, "the decode process")
        else:
            self.seed_dst[n] = map_shm(info, shape, L.torch_dtype, "the decode process")
        # K and V of each layer as [1, heads, n, dim], refilled for each run's prompt
        self.seed_src[n] = [torch.empty(1, L.num_kv_heads, n, L.head_dim, dtype=L.torch_dtype, device=self.device)
                            for _ in range(2 * L.num_layers)]
        return {"ok": True}

    def _seed_source(self, req: Request) -> None:
        """A contiguous copy of this prompt's cache, as the seed's DynamicCache holds it (untimed)."""
        n, L = len(req.prompt_ids), self.engine.layout
        self.engine.prefill_only(req)
        pool, src = self.engine.kv.pool, self.seed_src[n]
        for layer in range(L.num_layers):  # [blocks, 2, bs, heads, dim] -> K and V as [heads, n, dim]
            x = pool[layer, req.block_ids].permute(1, 3, 0, 2, 4).reshape(2, L.num_kv_heads, -1, L.head_dim)
            src[2 * layer][0].copy_(x[0, :, :n])
            src[2 * layer + 1][0].copy_(x[1, :, :n])
        self.engine.release(req.request_id)

    def seed(self, cmd) -> dict:
        n, layered = cmd["n"], cmd["mode"] == "layer"
        src, dst = self.seed_src[n], self.seed_dst[n]
        state = {"started": 0.0, "copies": 0}

        def copy_layer(layer: int) -> None:
            state["started"] = state["started"] or time.time()
            if self.stream is None:
                dst[layer, 0].copy_(src[2 * layer][0])
                dst[layer, 1].copy_(src[2 * layer + 1][0])
            else:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                self.stream.wait_event(ready)
                with torch.cuda.stream(self.stream):
                    dst[layer, 0].copy_(src[2 * layer][0], non_blocking=True)
                    dst[layer, 1].copy_(src[2 * layer + 1][0], non_blocking=True)
            state["copies"] += 2

        self._seed_source(self.request(cmd["id"] + "-source", n, cmd["seed"]))
        req = self.request(cmd["id"], n, cmd["seed"])
        sync(self.device)
        start = time.perf_counter()
        result = self.engine.prefill_only(req, copy_layer if layered else None)
        prefill_ms = (time.perf_counter() - start) * 1e3
        prefill_end = time.time()
        if not layered:
            for layer in range(self.engine.layout.num_layers):
                copy_layer(layer)
        if self.stream is not None:
            wait_event(self.stream.record_event(), time.monotonic() + self.args.deadline_s, req.request_id, "seed")
        finished = time.time()
        self.engine.release(req.request_id)
        return {"prefill_ms": prefill_ms, "transfer_ms": (finished - state["started"]) * 1e3,
                "exposed_ms": max(0.0, finished - prefill_end) * 1e3, "copies": state["copies"],
                "kv_bytes": n * self.engine.layout.bytes_per_token, "first_token": result.first_token,
                "logits_sha": logits_digest(result.logits)}


def gpu_mark(device: torch.device) -> torch.cuda.Event | None:
    """A timed event on the compute stream now (prefill has ended: its tokens were read back)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class DecodeSide:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.decode_device)
        self.engine = make_engine(args, args.decode_device, args.max_len, shared=self.device.type == "cpu")
        self.receivers = {t: make_receiver(self.engine.kv, transfer_config(args, t, host=args.kv_host))
                          for t in args.transports.split(",")}
        self.fillers: dict[str, list[str]] = {}  # request -> the blocks held to scatter its reservation
        self.refs: dict[str, dict] = {}  # request id -> its colocated reference
        self.lengths_seen: set[int] = set()
        self.seed_buffers: dict[int, torch.Tensor] = {}
        self.shm_paths: list[str] = []
        self.arrivals: dict = {}

    def hello(self) -> dict:
        return {"addresses": {t: r.address for t, r in self.receivers.items()}}

    def prepare(self, cmd) -> dict:
        """Reference first, then reserve: the reservation may get the very blocks the reference just
        freed, holding this prompt's KV; the poison is what keeps a silent transport from passing."""
        rid, n, seed = cmd["id"], cmd["n"], cmd["seed"]
        self.refs[rid] = self.reference(n, seed)
        if cmd["method"] == "seed-copy":
            buf = self.seed_buffers[n]
            buf.fill_(float("nan"))
            sync(buf.device)
            return {"ok": True}
        if parse_method(cmd["method"])[1] == "fragmented":  # room for the prompt and the decoded tokens
            need = -(-(n + self.args.tokens) // self.engine.layout.block_size) + 1
            self.fillers[rid] = scatter(self.engine, need, seed)
        blocks = self.engine.reserve(rid, n)
        if blocks is None:
            self._done(rid)
            return {"error": f"no room for {n} tokens in the decode pool"}
        poison(self.engine.kv.pool, blocks, seed)
        receiver = self.receivers[cmd["method"]]
        receiver.expect(rid, blocks, self.args.deadline_s)
        return {"blocks": blocks, "address": receiver.address}

    def decode(self, cmd) -> dict:
        rid, receiver = cmd["id"], self.receivers[cmd["transport"]]
        end = time.monotonic() + self.args.deadline_s + 5
        while rid not in self.arrivals and time.monotonic() < end:
            self.arrivals.update({a.request_id: a for a in receiver.poll()})
            time.sleep(0.0005)
        arrival = self.arrivals.pop(rid, None)
        error = None
        if arrival is None or not arrival.ok:
            error = arrival.error if arrival else f"request {rid}: no arrival reported"
        elif arrival.first_token != cmd["first_token"]:
            error = f"request {rid}: first token {arrival.first_token} arrived, {cmd['first_token']} sent"
        if error is not None:
            self.engine.release(rid)
            self._done(rid)
            return {"error": error}
        return self._continue(cmd)

    def _done(self, rid: str) -> None:
        self.refs.pop(rid, None)
        release(self.engine, self.fillers.pop(rid, []))
        scrub(self.engine.kv.pool)  # every block is free again: leave no NaN behind for the next run

    def _continue(self, cmd) -> dict:
        """Adopt the request whose prompt KV sits in its reserved blocks, decode, compare with colocated."""
        rid = cmd["id"]
        ref = self.refs[rid]
        req = Request(rid, ref["prompt"], SamplingParams(max_tokens=self.args.tokens, ignore_eos=True),
                      return_logits=True)
        self.engine.adopt(req, cmd["first_token"])
        logits = step_logits(self.engine, req)
        self._done(rid)
        tokens_equal = req.output_ids == ref["tokens"]
        first_equal = cmd["logits_sha"] == ref["first_sha"]
        # a step without logits is one the engine failed (e.g. NaN from blocks the transfer never wrote)
        step = next((i + 1 for i, (a, b) in enumerate(zip(logits, ref["logits"][1:]))
                     if a is None or not torch.equal(a, b)), None)
        failed = req.finish_reason == "error"
        exact = (not failed and tokens_equal and first_equal and step is None
                 and len(logits) == len(ref["logits"]) - 1)
        out = {"exact": exact, "tokens_equal": tokens_equal, "first_logits_equal": first_equal,
               "first_step_ms": ms(req.stamps.first_step_start, req.stamps.first_step_end),
               "colocated_first_step_ms": ref["first_step_ms"]}
        if failed:
            out["mismatch"] = f"decoding from the transferred KV failed: {req.error}"
        elif not exact:
            out["mismatch"] = (f"first differing logits at generated token {step}; tokens transferred "
                               f"{self.engine.tokenizer.decode(req.output_ids)!r} vs colocated "
                               f"{self.engine.tokenizer.decode(ref['tokens'])!r}")
        return out

    def reference(self, n: int, seed: int) -> dict:
        """The colocated run of this prompt on this engine: greedy tokens and every step's logits."""
        prompt = prompt_ids(self.engine.vocab_size, n, seed)
        if n not in self.lengths_seen:
            self.lengths_seen.add(n)
            self.engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
            # ^ untimed: takes the decode graphs of this length, so the timed first step is a replay
        req = Request(f"colocated-{n}-{seed}", prompt, SamplingParams(max_tokens=self.args.tokens, ignore_eos=True),
                      return_logits=True)
        self.engine.add_request(req)
        logits = step_logits(self.engine, req)
        return {"prompt": prompt, "seed": seed, "tokens": req.output_ids, "logits": logits,
                "first_sha": logits_digest(logits[0]),
                "first_step_ms": ms(req.stamps.first_step_start, req.stamps.first_step_end)}

    # ---- the seed's method ----------------------------------------------------------------------

    def seed_buffer(self, cmd) -> dict:
        n, L = cmd["n"], self.engine.layout
        shape = (L.num_layers, 2, L.num_kv_heads, n, L.head_dim)
        if self.device.type == "cuda":
            buf = torch.zeros(shape, dtype=L.torch_dtype, device=self.device)
            info = P.CudaIpcInfo(*buf.untyped_storage()._share_cuda_())
        else:
            # named like a KV pool: map_shm maps nothing else (and orphans are swept the same way)
            path = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.shm_paths.append(path)
            buf = torch.from_file(path, shared=True, size=math.prod(shape), dtype=L.torch_dtype).view(shape)
            info = P.ShmInfo(path, buf.numel() * buf.element_size())
        self.seed_buffers[n] = buf
        return {"info": msgspec.json.encode(info).decode()}

    def seed_decode(self, cmd) -> dict:
        n, rid, L = cmd["n"], cmd["id"], self.engine.layout
        blocks = self.engine.reserve(rid, n)
        if blocks is None:
            self._done(rid)
            return {"error": f"no room for {n} tokens in the decode pool"}
        poison(self.engine.kv.pool, blocks, self.refs[rid]["seed"])
        buf, pool = self.seed_buffers[n], self.engine.kv.pool
        padded = len(blocks) * L.block_size
        for layer in range(L.num_layers):  # [2, heads, n, dim] -> [blocks, 2, bs, heads, dim]
            x = torch.zeros(2, L.num_kv_heads, padded, L.head_dim, dtype=buf.dtype, device=buf.device)
            x[:, :, :n] = buf[layer]
            pool[layer, blocks] = x.view(2, L.num_kv_heads, len(blocks), L.block_size, L.head_dim) \
                .permute(2, 0, 3, 1, 4).to(pool.device)
        return self._continue(cmd)

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        for path in self.shm_paths:
            if os.path.exists(path):
                os.unlink(path)
        self.engine.kv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="one side of pdserve-bench transfer (started by it)")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--decode-device", required=True)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--transports", required=True)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--kv-streams", type=int, default=None, help="zmq's data streams (default: TransferConfig's)")
    ap.add_argument("--keys", default=None, help="worker key folder for the zmq-curve method (made by bench/transfer/table.py)")
    ap.add_argument("--kv-host", default="127.0.0.1",
                    help="decode side: the address its receivers bind and advertise (bench/transfer/multihost.py: its namespace's)")
    ap.add_argument("--break", dest="fault", default=None,
                    help="prefill side, tests only: our senders drop part of every request (skip-block:K, skip-all)")
    args = ap.parse_args()
    side = PrefillSide(args) if args.role == "prefill" else DecodeSide(args)
    print(REPLY + json.dumps(side.hello()), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        with torch.inference_mode():
            out = getattr(side, cmd["cmd"])(cmd)
        print(REPLY + json.dumps(out), flush=True)
    if isinstance(side, DecodeSide):
        side.close()


if __name__ == "__main__":
    main()
