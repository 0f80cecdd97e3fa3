"""The configs of a worker: its engine, its KV transfer, the worker process around them.

Plain dataclasses, torch-free, checked when built: the worker CLI fills them from its flags, the
embedded launcher (server/launcher.py) hands them to the workers it starts, the benches and tests
build them directly. What needs torch to check (is the CUDA device there?) is checked when the engine
starts (workers/engine/config.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from protocol.auth import WorkerKeys
from protocol.enums import MODES, ROLES, TRANSPORTS

DTYPES = ("float32", "float16", "bfloat16")  # workers/engine/kv_cache.py maps each to its torch dtype
ATTENTION = ("auto", "triton", "reference")


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # a name in models.MODEL_NAMES or a local checkpoint directory
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks for requests (the pool holds one more, for padding); or kv_memory_gb
    kv_memory_gb: float | None = None  # KV pool size in GiB; default 1 GiB on CPU, 30% of free memory on CUDA
    max_num_seqs: int = 64  # running requests at once
    max_batched_tokens: int = 8192  # unchunked: prompt tokens per prefill step (a longer prompt runs alone)
    chunked_prefill: bool = True  # a step carries every running decode plus up to chunk_tokens prompt tokens
    chunk_tokens: int = 512  # prompt tokens per step with chunked_prefill
    prefix_cache: bool = True  # reuse the KV of full blocks a previous prompt began with (prefix_cache.py)
    host_cache_gb: float = 0.0  # host memory for blocks evicted from the GPU (kv_tiers.py; pinned on CUDA); 0: none
    disk_cache_dir: str | None = None  # with host_cache_gb: a directory for blocks evicted from host memory
    disk_cache_gb: float = 16.0
    kv_shared: bool = False  # CPU: put the pool in /dev/shm so another process can map it (ipc transport)
    max_model_len: int | None = None  # default: the model's own limit
    # "auto": CUDA decodes through the Triton kernel, prefix chunks gathered + flash SDPA; "triton":
    # prefix chunks through the Triton kernel too; "reference": gather + SDPA for everything (CPU always)
    attention: str = "auto"
    compile: bool = True  # CUDA: torch.compile each decoder layer around attention (fused norms, rotary, MLP)
    fuse_qkv: bool = True  # CUDA: one Q/K/V projection instead of three (fusion.py)
    cuda_graphs: bool = True  # CUDA: replay decode steps as CUDA graphs (False: eager, for debugging)

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_memory_gb is not None and self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb}")
        if self.max_num_seqs <= 0 or self.max_batched_tokens <= 0 or self.chunk_tokens <= 0:
            raise ValueError("max_num_seqs, max_batched_tokens and chunk_tokens must be positive")
        if self.host_cache_gb < 0 or self.disk_cache_gb <= 0:
            raise ValueError("host_cache_gb must be >= 0 and disk_cache_gb positive")
        if self.disk_cache_dir and not self.host_cache_gb:
            raise ValueError("a disk cache needs a host cache above it: give host_cache_gb too")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be auto, triton or reference, got {self.attention!r}")
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")


@dataclass
class TransferConfig:
    transport: str = "ipc"  # one of TRANSPORTS
    mode: str = "bulk"  # one of MODES
    host: str = "127.0.0.1"  # receiver: interface to bind; also the address it advertises
    port: int = 0  # receiver: 0 picks a free port
    deadline_s: float = 30.0  # default for handshakes and transfers
    # receiver: after it gave up on a transfer already writing (ipc, nixl), how long it waits for
    # the sender to confirm it stopped before reporting the failure anyway
    cancel_grace_s: float = 10.0
    # the deployment's CURVE keys: the KV channel's sockets authenticate and encrypt (endpoint.py);
    # None: plain sockets (tests and benches of the transports themselves)
    keys: WorkerKeys | None = None

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown transfer mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.deadline_s <= 0 or self.cancel_grace_s <= 0:
            raise ValueError("deadline_s and cancel_grace_s must be positive")


@dataclass
class WorkerConfig:
    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    control: str = "tcp://127.0.0.1:0"  # endpoint this worker binds for router messages (port 0: any)
    router: str = "tcp://127.0.0.1:7100"  # the router's registration endpoint
    advertise_host: str | None = None  # host the router should use when `control` binds a wildcard
    worker_id: str | None = None  # default: <role>-<host>-<pid>
    keys: WorkerKeys | None = None  # CURVE keys of the deployment; None: plain sockets (tests only)
    stats_interval_s: float = 10.0  # a stats line in the log this often while there is work (0: never)
    warmup: bool = True  # one real request through the engine before registering (workers/warmup.py)
    parent_pid: int | None = None  # the process that started us (pdserve); its death ends us at once
    run_dir: str | None = None  # that process's private run directory: removed if it dies first

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.worker_id is None:
            self.worker_id = f"{self.role}-{socket.gethostname()}-{os.getpid()}"
