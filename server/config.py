"""The router's settings (the `pdserve` CLI fills them from its flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.auth import RouterKeys
from protocol.control import POLICIES

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a 128k-token prompt is under 1 MB of text or of token ids


@dataclass
class RouterConfig:
    model: str = "smollm2-135m"  # the one model this router serves (workers must register the same)
    tokenizer: str | None = None  # default: the model's own tokenizer
    register: str = "tcp://127.0.0.1:7100"  # ZMQ endpoint workers register at (port 0: any free port)
    policy: str = "auto"  # default routing policy; a request's "policy" field overrides it
    auto_threshold: int = 256  # auto: prompts shorter than this many tokens stay colocated
    heartbeat_interval_s: float = 1.0  # told to workers at registration
    heartbeat_misses: int = 3  # a worker silent for this many intervals is dropped
    kv_deadline_s: float = 60.0  # a decode reservation waits this long for its KV
    token_timeout_s: float = 120.0  # longest silence from a worker during a request before it fails
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    default_chat_max_tokens: int = 512  # chat without max_tokens (capped by the context left)
    keys: RouterKeys | None = None  # CURVE keys of the deployment; None: plain sockets (tests only)
    api_key: str | None = field(default=None, repr=False)  # HTTP: `Authorization: Bearer <key>` required
    public_metrics: bool = False  # /metrics answers without the API key (a scraper on a trusted network)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 before they are read
    # admission (server/admission.py), per role; 0: derived from the role's registered KV capacity
    max_inflight_requests: int = 0  # requests in flight at once (0: the role's total KV blocks)
    max_inflight_tokens: int = 0  # prompt tokens in flight at once (0: twice the role's KV tokens)
    retry_after_s: int = 1  # the Retry-After of a 429 or 503 (seconds)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may run before they are aborted
    expected_workers: dict[str, int] | None = None  # role -> count; /health says "degraded" while fewer are live
    failover: bool = False  # a disaggregated request that fails before its first token runs once more elsewhere

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_misses < 1:
            raise ValueError("heartbeat interval must be positive and misses at least 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max body size must be at least 1 KiB, got {self.max_body_bytes} bytes")
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("the API key must be at least 16 characters (e.g. `openssl rand -hex 24`)")
        if self.max_inflight_requests < 0 or self.max_inflight_tokens < 0:
            raise ValueError("admission bounds must be 0 (derived from the KV capacity) or positive")
        if self.retry_after_s < 1 or self.drain_timeout_s < 0:
            raise ValueError("retry-after must be at least 1 s and the drain timeout not negative")
        if self.kv_deadline_s <= 1.0:
            raise ValueError(f"kv deadline must exceed 1 s, got {self.kv_deadline_s}")

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses
