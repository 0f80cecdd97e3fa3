"""The router's settings. Each field with a flag declares it (settings/flags.py): `pdserve` and
`pdserve router` derive their router flags from these fields."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.settings.keys import RouterKeys
from pdserve.settings.worker import MODEL_HELP
from pdserve.protocol.enums import POLICIES, ROLES, ROUTINGS
from pdserve.settings.flags import flag

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a 128k-token prompt is under 1 MB of text or of token ids


def mebibytes(text: str) -> int:
    """--max-body-mb's MiB, as the bytes of max_body_bytes."""
    return int(float(text) * 2**20)


def kibibytes(text: str) -> int:
    """--min-body-rate's KiB (per second), as bytes."""
    return int(float(text) * 2**10)


def expected_counts(text: str | None) -> dict[str, int] | None:
    """--expect-workers' ROLE=N,... (prefill=2,decode=2) as {role: count}."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        role, _, n = part.partition("=")
        if role.strip() not in ROLES or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"takes ROLE=N,... with roles {', '.join(ROLES)}; got {part!r}")
        out[role.strip()] = int(n)
    return out


@dataclass
class RouterConfig:
    model: str = flag("smollm2-135m", MODEL_HELP)  # the one model it serves (workers must register the same)
    tokenizer: str | None = flag(None, "tokenizer directory, when the model's is not on this machine")
    served_model_name: str | None = flag(None, "the model's id in the API (/v1/models, the `model` of requests and "
                                         "responses); default: --model")
    # `pdserve` has its own default, an ipc:// socket in its run directory (server/cli.py)
    register: str = flag("tcp://127.0.0.1:7100", "ZMQ endpoint workers register at (port 0: any free port)")
    policy: str = flag("auto", "default routing policy (a request's \"policy\" field overrides it)", choices=POLICIES)
    auto_threshold: int = flag(256, "auto policy: prompts shorter than this many tokens stay colocated")
    routing: str = flag("kv", "worker choice: kv (the lowest predicted TTFT from the prefix each worker holds and "
                        "its measured costs; least loaded until workers report) or least-loaded",
                        choices=ROUTINGS)
    # told to workers at registration
    heartbeat_interval_s: float = flag(1.0, "seconds between worker heartbeats", name="--heartbeat-interval")
    heartbeat_misses: int = flag(3, "missed heartbeats before a worker is dropped")
    kv_deadline_s: float = flag(60.0, "seconds a decode reservation waits for its KV", name="--kv-deadline")
    token_timeout_s: float = flag(120.0, "seconds of silence from a worker before its request fails",
                                  name="--token-timeout")
    default_max_tokens: int = flag(16, "tokens a completion without max_tokens may generate (OpenAI's default)")
    default_chat_max_tokens: int = flag(512, "tokens a chat answer without max_tokens may generate (capped by the "
                                        "context left)")
    keys: RouterKeys | None = None  # CURVE keys of the deployment; None: plain sockets (tests only)
    # the CLI reads it from the flag, $PDSERVE_API_KEY or --api-key-file (server/cli.py api_key)
    api_key: str | None = flag(None, "require `Authorization: Bearer KEY` on the HTTP API (/health without it shows "
                               "no addresses or PIDs); default: $PDSERVE_API_KEY. A flag is visible in `ps`: prefer "
                               "the variable or --api-key-file", repr=False)
    public_metrics: bool = flag(False, "with an API key: serve /metrics without it too (a Prometheus scraper that "
                                "holds no key)")
    # a larger request body gets 413 before it is read; the flag is in MiB
    max_body_bytes: int = flag(DEFAULT_MAX_BODY_BYTES, "largest HTTP request body in MiB (413 above it) (default: "
                               f"{DEFAULT_MAX_BODY_BYTES / 2**20})", name="--max-body-mb", type=mebibytes)
    # the front door: what a body (server/bodies.py) and a connection (server/connections.py) may hold
    max_bodies_bytes: int = flag(16 * DEFAULT_MAX_BODY_BYTES, "request bodies being read at once, router-wide, in "
                                 "MiB; when full, a newcomer takes room from the address holding the most, or gets "
                                 f"503 (default: {16 * DEFAULT_MAX_BODY_BYTES / 2**20})",
                                 name="--max-bodies-mb", type=mebibytes)
    header_timeout_s: float = flag(10.0, "seconds a connection may take to send a request's headers before it is "
                                   "closed", name="--header-timeout")
    body_timeout_s: float = flag(60.0, "seconds a request body may take to arrive (408 after)", name="--body-timeout")
    min_body_rate: int = flag(4 * 2**10, "the slowest a request body may arrive, in KiB/s, judged over each "
                              "window of 5 s from its start (408 under it; 0: no floor) (default: 4)",
                              name="--min-body-rate", type=kibibytes)
    rate_window_s: float = 5.0  # the window --min-body-rate is judged over; the first is a body's grace
    send_timeout_s: float = flag(60.0, "seconds a response, streamed or not, waits for a client that stopped reading "
                                 "before its connection is dropped", name="--send-timeout")
    max_connections: int = flag(4096, "open HTTP connections at most (kept under the open-file limit); past it a new "
                                "one closes the longest idle, or the newest of the address holding the most")
    client_share: float = flag(0.25, "the share of --max-bodies-mb and of --max-connections one client address (an "
                               "IPv4 address, an IPv6 /64) may hold; 1: no per-address bound (behind a proxy, where "
                               "every client has the proxy's address)")
    allowed_hosts: str | None = flag(None, "without an API key: Host names the HTTP API answers besides localhost and "
                                     "IP addresses, comma-separated ('*': any); a guard against DNS rebinding")
    chat_special_tokens: str = flag("escape", "special tokens (e.g. <|im_start|>) typed in chat messages: escape (read "
                                    "as plain text), refuse (400), or allow (vLLM's: they become real markers)",
                                    choices=("escape", "refuse", "allow"))
    # admission (server/admission.py), per role; 0: derived from the role's registered KV capacity
    max_inflight_requests: int = flag(0, "admission: requests in flight per role (colocated; prefill, decode) before "
                                      "new ones get 429 + Retry-After (0: the role's total KV blocks, as its workers "
                                      "registered them)")
    max_inflight_tokens: int = flag(0, "admission: prompt tokens in flight per role before new requests get 429 (0: "
                                    "twice the role's KV capacity in tokens)")
    retry_after_s: int = flag(1, "seconds in the Retry-After of a 429 or 503", name="--retry-after")
    drain_timeout_s: float = flag(30.0, "on SIGTERM: seconds in-flight requests may run (new ones get 503) before the "
                                  "rest are aborted and the workers stopped", name="--drain-timeout")
    # role -> count; `pdserve` fills in the counts it starts when the flag is not given
    expected_workers: dict[str, int] | None = flag(
        None, "/health says \"degraded\" while fewer workers of a role are live, e.g. prefill=2,decode=2 (pdserve: the "
        "counts it starts)", name="--expect-workers", metavar="ROLE=N,...", type=expected_counts)
    failover: bool = flag(False, "a disaggregated request whose prefill or KV transfer fails before its first "
                          "token runs once more on another decode worker or colocated (its timings say so); default: "
                          "it fails")
    migrate: bool = flag(False, "a request whose decode (or colocated) worker is lost after its first token "
                         "continues on another worker from its prompt and the tokens so far (its timings say so); "
                         "default: it fails")

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}")
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
        if self.default_max_tokens < 1 or self.default_chat_max_tokens < 1:
            raise ValueError("the default max_tokens must be at least 1")
        if min(self.header_timeout_s, self.body_timeout_s, self.send_timeout_s) <= 0 or self.max_connections < 8:
            raise ValueError("the header, body and send timeouts must be positive and max connections at least 8")
        if self.max_bodies_bytes < self.max_body_bytes:
            raise ValueError("--max-bodies-mb must be at least --max-body-mb")
        if not 0 < self.client_share <= 1 or self.min_body_rate < 0 or self.rate_window_s <= 0:
            raise ValueError("--client-share must be in (0, 1] and --min-body-rate not negative")
        if self.kv_deadline_s <= 1.0:
            raise ValueError(f"kv deadline must exceed 1 s, got {self.kv_deadline_s}")

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def client_bodies_bytes(self) -> int:
        """Request bodies one client address may have being read: its share, and at least one whole body."""
        return max(self.max_body_bytes, int(self.client_share * self.max_bodies_bytes))

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses
