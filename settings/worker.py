"""The configs of a worker: its engine, its KV transfer, the worker process around them.

Plain dataclasses, torch-free, checked when built. Each field with a command-line flag declares it
(settings/flags.py): `pdserve-worker` and `pdserve` derive their flags from these fields. The embedded
launcher (server/launcher.py) hands each worker its WorkerConfig in a file (write_worker_config); the
benches and tests build them directly. What needs torch to check (is the CUDA device there?) is
checked when the engine starts (workers/engine/device.py).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field, replace

from pdserve.settings.keys import WorkerKeys
from pdserve.protocol.enums import MODES, ROLES, TRANSPORTS
from pdserve.settings.flags import flag

DTYPES = ("float32", "float16", "bfloat16")  # workers/engine/kv_cache.py maps each to its torch dtype
ATTENTION = ("auto", "triton", "reference")
DECODE_GRAPH_FORWARDS = ("cut", "layers")  # EngineConfig.decode_graph_forward
GRAPH_STARTS = ("all", "lazy")  # EngineConfig.graphs
MODEL_HELP = "smollm2-135m, tiny, qwen2.5-7b or a local checkpoint dir"  # the router's --model too
# the colocated chunk budget when --chunk-tokens is not given, by device kind: CUDA's is the best of a capacity
# sweep on an H200 (docs/results.md, "The colocated worker's defaults"); the CPU's keeps a 2-core machine's
# decodes moving between prompt chunks (a 512-token chunk of SmolLM2 takes about a second there)
CHUNK_TOKENS = {"cuda": 8192, "cpu": 512}


@dataclass
class EngineConfig:
    model: str = flag("smollm2-135m", MODEL_HELP)  # a name in models.MODEL_NAMES or a local checkpoint directory
    device: str = flag("cpu", "cpu or cuda:N")
    dtype: str | None = flag(None, "default: float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    block_size: int = flag(16, "tokens per KV block")
    # the pool holds one block more, for padding
    num_blocks: int | None = flag(None, "KV pool size in blocks (or --kv-memory-gb)")
    # default (neither given): 1 GiB on CPU, 30% of free memory on CUDA
    kv_memory_gb: float | None = flag(None, "KV pool size in GiB")
    max_num_seqs: int = flag(64, "running requests at once")
    # one budget for every prefill of whole prompts: a colocated worker's prefill step with --no-chunked-prefill,
    # and a prefill worker's forward over the waiting prompts it batches (roles/prefill.py); a cached prefix
    # does not count, and a longer prompt runs alone, never split. 8192: past it a forward of a 7B model is
    # compute-bound on an H100/H200 (the weights' ~3.6 ms are ~2% of it), so a larger batch gains nothing and
    # only delays its first prompts; the same budget on both sides keeps a disaggregated run comparable with
    # an unchunked colocated one. To be chosen by measurement on the GPU (bench/run_defaults_gpu.sh: pd-pbatchN
    # against pd-default; pd-pbatch1 is one prompt a forward), as --chunk-tokens was
    max_batched_tokens: int = flag(8192, "prompt tokens prefilled in one forward of whole prompts (a cached prefix "
                                   "does not count; the first prompt runs whatever its length, never split): a "
                                   "prefill worker's batch of waiting prompts, and with --no-chunked-prefill a "
                                   "colocated worker's prefill step; 1: one prompt at a time")
    # a step carries every running decode plus up to chunk_tokens prompt tokens
    chunked_prefill: bool = flag(True, "prefill whole prompts in steps of their own (running requests wait for them)")
    # None: CHUNK_TOKENS of the device (resolved where used, step_chunk_tokens: the router builds one config
    # and gives each worker its device afterwards)
    chunk_tokens: int | None = flag(None, "prompt tokens per step (default: 8192 on CUDA, 512 on the CPU, by "
                                    "measured capacity: docs/results.md); each step also carries every running "
                                    "request's next token")
    # a prompt token at position p counts 1 + p / chunk_attention_tokens against chunk_tokens (scheduler.py);
    # 0: every token counts 1
    chunk_attention_tokens: int = flag(16384, "with chunked prefill: a prompt token at position p counts 1 + p / "
                                       "this against --chunk-tokens, so a chunk deep in a long prompt holds fewer "
                                       "tokens (0: every token counts 1, the chunk is --chunk-tokens at any depth)")
    prefix_cache: bool = flag(True, "recompute every prompt in full (default: reuse the KV of full blocks a "
                              "previous prompt began with)")  # prefix_cache.py; host and disk tiers: kv_tiers/
    host_cache_gb: float = flag(0.0, "host memory (pinned on CUDA) that keeps the KV of finished requests' blocks "
                                "below the GPU, reloaded instead of recomputed when that is cheaper (0: off)")
    disk_cache_dir: str | None = flag(None, "with --host-cache-gb: a directory for blocks pushed out of host memory "
                                      "(written in the background)")
    disk_cache_gb: float = flag(16.0, "size of the --disk-cache-dir tier")
    # the disk tier's MAC key: False, the deployment's (derived from the worker key: entries outlive a
    # restart as long as the keys of `pdserve keygen` do); True, the folder's own kv.key (0600), kept
    # across restarts: `pdserve` sets it, since it makes new deployment keys at each start
    disk_cache_own_key: bool = False
    # CPU: put the pool in /dev/shm so another process can map it (the worker CLI sets it for ipc)
    kv_shared: bool = False
    max_model_len: int | None = flag(None, "context limit (default: the model's)")
    attention: str = flag("auto", "auto: Triton paged decode + flash over gathered prefixes on CUDA; triton: "
                          "Triton for prefixes too; reference: gather + SDPA (CPU always)", choices=ATTENTION)
    # CUDA: torch.compile each decoder layer around attention (fused norms, rotary, MLP); --no-compile
    # turns fuse_qkv off too (workers/cli.py)
    compile: bool = flag(True, "CUDA: run decoder layers eagerly (no torch.compile, no fused Q/K/V)")
    fuse_qkv: bool = True  # CUDA: one Q/K/V projection instead of three (fusion.py)
    # CUDA: one gate/up projection in each MLP instead of two (fusion.py); off until the engine bench's A/B
    # of the decode step on a GPU measures it (bench/run_check_gpu.sh PARTS=fuse)
    fuse_gate_up: bool = flag(False, "CUDA: one gate/up projection in each MLP instead of two (fusion.py)")
    cuda_graphs: bool = True  # CUDA: replay decode steps as CUDA graphs (False: eager, for debugging)
    # steps with prompt tokens run piecewise (workers/engine/graphs.py, MixedGraphs: the dense segments between
    # the attention calls) up to a chunk and the decodes beside it; those of up to this many tokens replay the
    # segments as CUDA graphs (captured at start), longer ones run them directly; 0: every such step eagerly
    mixed_graph_tokens: int = 1024
    # what a decode graph captures (workers/engine/graphs.py): "cut", the piecewise path's compiled segments
    # with paged decode attention between them, so a worker compiles its layers once; "layers", transformers'
    # forward with each decoder layer torch.compiled, compiled apart from the segments (a model that cannot be
    # cut, layers.cuttable, always runs this one). The default stays "layers", the design measured on a GPU,
    # until `pdserve-bench start` and `engine` A/B the two there (bench/run_check_gpu.sh): a default is a
    # measured choice, and "cut" has run on the CPU only
    decode_graph_forward: str = "layers"
    # when a worker captures its CUDA graphs, decode graphs and piecewise ones alike (workers/engine/graphs.py):
    # "all" at start, before it is ready; "lazy": of each kind the largest bucket at start (it compiles what that
    # kind's graphs run and sizes their memory pool), every other when the worker has no request (one per loop
    # turn, decode graphs first, largest first) or at the first step that needs it. "all" stays the default
    # until `pdserve-bench start` and a load run A/B the two on a GPU (bench/run_check_gpu.sh PARTS=lazy)
    graphs: str = flag("all", "CUDA: capture every graph at start (all), or of each kind (decode, piecewise) the "
                       "largest at start and the others while the worker is idle or when a step first needs one "
                       "(lazy)", choices=GRAPH_STARTS)
    # the host schedules and launches step N+1 while step N runs, reading N's tokens back a step late
    # (workers/engine/overlap.py); None: on CUDA
    overlap: bool | None = None
    # a directory: each worker writes a JSON line per step to <dir>/steps-<worker id>.jsonl from ready on
    # (workers/engine/step_trace.py; `pdserve-bench trace` reads them)
    step_trace: str | None = flag(None, "write a line per engine step (its rows, forward path, host and device "
                                  "milliseconds) to DIR/steps-<worker id>.jsonl; `pdserve-bench trace` reads them",
                                  metavar="DIR")
    # torch's thread count is the process's: the worker CLI sets it before the engine loads
    threads: int | None = flag(None, "CPU threads for torch (default: torch's choice)")

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_memory_gb is not None and self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb}")
        if self.max_num_seqs <= 0 or self.max_batched_tokens <= 0 or (self.chunk_tokens or 1) <= 0:
            raise ValueError("max_num_seqs, max_batched_tokens and chunk_tokens must be positive")
        if self.chunk_attention_tokens < 0:
            raise ValueError(f"chunk_attention_tokens must be >= 0 (0: every prompt token counts 1), got "
                             f"{self.chunk_attention_tokens}")
        if self.host_cache_gb < 0 or self.disk_cache_gb <= 0:
            raise ValueError("host_cache_gb must be >= 0 and disk_cache_gb positive")
        if self.disk_cache_dir and not self.host_cache_gb:
            raise ValueError("a disk cache needs a host cache above it: give host_cache_gb too")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be auto, triton or reference, got {self.attention!r}")
        if self.graphs not in GRAPH_STARTS:
            raise ValueError(f"graphs must be all or lazy, got {self.graphs!r}")
        if self.decode_graph_forward not in DECODE_GRAPH_FORWARDS:
            raise ValueError(f"decode_graph_forward must be cut or layers, got {self.decode_graph_forward!r}")
        if self.step_trace:  # a worker may start elsewhere than its launcher's directory
            self.step_trace = os.path.abspath(self.step_trace)
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")


    @property
    def step_chunk_tokens(self) -> int:
        """Prompt tokens per colocated step: --chunk-tokens, else this device kind's CHUNK_TOKENS."""
        return self.chunk_tokens or CHUNK_TOKENS[self.device.partition(":")[0]]


@dataclass
class TransferConfig:
    transport: str = flag("ipc", "ipc: same host; nixl: NIXL/UCX; zmq: host-staged TCP, works anywhere",
                          choices=TRANSPORTS)
    mode: str = flag("bulk", "bulk: after prefill; layer: each layer as it is done", choices=MODES)
    host: str = flag("127.0.0.1", "decode: interface the KV receiver binds and advertises", name="--kv-host")
    port: int = flag(0, "decode: KV receiver port (0: any free port)", name="--kv-port")
    # also the default deadline of a transfer
    deadline_s: float = flag(30.0, "seconds for a KV transport handshake (a request's own deadline comes from "
                             "the router)", name="--handshake-timeout")
    # receiver: after it gave up on a transfer already writing (ipc, nixl), how long the sender may
    # take to confirm it stopped before a warning; the request fails at once, its blocks stay fenced
    # (held) until that confirmation or the sender's death (docs/design-fencing.md)
    cancel_grace_s: float = 10.0
    # integrity (workers/transfer/integrity.py): both sides need it; a debug and test option (one
    # extra pass over each request's KV on each side)
    checksum: bool = flag(False, "stamp every transferred KV block with a checksum on the prefill worker and verify "
                          "it on the decode worker before the request runs (debugging; both sides need it)",
                          name="--kv-checksum")
    # the deployment's CURVE keys: the KV channel's sockets authenticate and encrypt (endpoint.py);
    # None: plain sockets (tests and benches of the transports themselves)
    keys: WorkerKeys | None = None
    streams: int = flag(8, "zmq: parallel TCP streams per decode worker for the KV bytes (each its own CURVE "
                        "session and ZMQ I/O thread, so the encryption spreads over cores)", name="--kv-streams")
    plaintext: bool = flag(False, "zmq, decode and prefill: KV bytes unencrypted on a second port (--kv-port + 1), "
                           "for an isolated network only (SECURITY.md); the handshake stays CURVE",
                           name="--kv-plaintext")
    # nixl, both sides: the staging region a fragmented request goes through (workers/transfer/staging.py)
    staging_gb: float | None = flag(None, "nixl: GiB of staging memory on the KV pool's device, registered at start, "
                                    "that a request of many short runs of blocks is gathered into and written "
                                    "from whole (default: half the KV pool, at most 2 GiB; 0: none, such requests "
                                    "go run by run)", name="--kv-staging-gb")

    def __post_init__(self):
        if not 1 <= self.streams <= 64:
            raise ValueError(f"--kv-streams must be 1..64, got {self.streams}")
        if self.staging_gb is not None and self.staging_gb < 0:
            raise ValueError(f"--kv-staging-gb must be >= 0, got {self.staging_gb}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown transfer mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.deadline_s <= 0 or self.cancel_grace_s <= 0:
            raise ValueError("deadline_s and cancel_grace_s must be positive")


@dataclass
class WorkerConfig:
    role: str = flag(help="what this worker does: prefill, decode, or both (colocated)", choices=ROLES)
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    control: str = flag("tcp://127.0.0.1:0", "endpoint this worker binds for router messages (port 0: any free port)")
    router: str = flag("tcp://127.0.0.1:7100", "the router's registration endpoint")
    advertise_host: str | None = flag(None, "host to give the router when --control binds 0.0.0.0")
    worker_id: str | None = flag(None, "default: <role>-<hostname>-<pid>")
    keys: WorkerKeys | None = None  # CURVE keys of the deployment; None: plain sockets (tests only)
    stats_interval_s: float = flag(10.0, "seconds between stats lines in the log (throughput, running, waiting, KV "
                                   "usage) while there is work; 0: none", name="--stats-interval")
    # one real request through the engine before registering (workers/warmup.py)
    warmup: bool = flag(True, "register without running a warm-up request first (the first real request pays "
                        "for torch's lazy start)")
    parent_pid: int | None = flag(None, "exit when this process dies (set by `pdserve`, which starts its workers "
                                  "with it)")
    run_dir: str | None = flag(None, "with --parent-pid: that process's private run directory, removed if it "
                               "dies first")

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.worker_id is None:
            self.worker_id = f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    def disk_key(self) -> bytes | None:
        """The disk tier's MAC key: the deployment's (WorkerKeys.disk_key), or None, the tier folder's own
        (kept across restarts): without keys, or where the deployment's keys are new at each start."""
        if self.keys is None or self.engine.disk_cache_own_key:
            return None
        return self.keys.disk_key()


def write_worker_config(cfg: WorkerConfig, path: str) -> None:
    """`cfg` as JSON in a new 0600 file, for `pdserve-worker --worker-config` (server/launcher.py). Without
    its keys: key material never lands here (the worker loads them from `--keys DIR`)."""
    data = asdict(replace(cfg, keys=None, transfer=replace(cfg.transfer, keys=None)))
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(data, f, indent=1)


def read_worker_config(path: str) -> WorkerConfig:
    """What write_worker_config wrote (without keys)."""
    with open(path) as f:
        data = json.load(f)
    engine, transfer = EngineConfig(**data.pop("engine")), TransferConfig(**data.pop("transfer"))
    return WorkerConfig(**data, engine=engine, transfer=transfer)
