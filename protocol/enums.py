"""The names that cross process boundaries, each an enum: what a worker does, how KV moves, how
the router serves a request, why a request failed.

Each member is its own string (`Role.DECODE == "decode"`), so it travels as that string (msgpack,
JSON, Prometheus labels, command-line choices) and a frame holding any other value fails to decode.
"""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A str enum whose str() and format() are the value (as Python 3.11's StrEnum; this runs on 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Role(Name):
    PREFILL = "prefill"  # prefill, push the KV into a decode worker's blocks, report token 1
    DECODE = "decode"  # reserve blocks, take the KV, generate the rest
    COLOCATED = "colocated"  # both, on one GPU


class Transport(Name):
    """How KV moves from a prefill worker into a decode worker's pool (workers/transfer/)."""

    IPC = "ipc"  # same host: CUDA IPC or a shared /dev/shm pool, copies by the prefill worker
    NIXL = "nixl"  # NIXL/UCX writes (RDMA, cuda_ipc, TCP: whatever UCX picks)
    ZMQ = "zmq"  # host-staged frames over TCP: works anywhere


class Mode(Name):
    BULK = "bulk"  # every layer after prefill
    LAYER = "layer"  # each layer as soon as prefill computed it


class Policy(Name):
    """How the router serves a request (RouterConfig.policy, a request's `policy` field)."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    AUTO = "auto"  # short prompts colocated, long ones disaggregated (RouterConfig.auto_threshold)


class Routing(Name):
    """How the router chooses a request's workers (RouterConfig.routing; each rule's class: server/worker_choice.py)."""

    KV = "kv"  # the lowest predicted TTFT from the prefix each worker holds (least loaded until workers report)
    LEAST_LOADED = "least-loaded"


class FailureKind(Name):
    """Why a worker could not go on with a request (RequestFailed.kind); the router maps each to an HTTP status."""

    INVALID = "invalid"  # the request itself (too long for the model, a parameter the engine refuses)
    CAPACITY = "capacity"  # no room for it on this worker
    TRANSFER = "transfer"  # its KV transfer failed
    TIMEOUT = "timeout"  # a deadline passed
    ABORTED = "aborted"  # the router (or a client) gave up on it
    INTERNAL = "internal"  # a bug or a fault on the worker


class Tier(Name):
    """A KV tier below a worker's own pool (workers/engine/kv_tiers/), nearest first: the one list of tier
    names that the wire (CacheFigures, KVCosts, KVEvents, Timeline), the timings (reused_tokens, route),
    the metrics and the router's pricing loop over."""

    HOST = "host"  # host memory (pinned on CUDA): kv_tiers/host.py
    DISK = "disk"  # a local directory below it: kv_tiers/disk.py


ROLES = Role.values()
TRANSPORTS = Transport.values()
MODES = Mode.values()
POLICIES = Policy.values()
ROUTINGS = Routing.values()
FAILURE_KINDS = FailureKind.values()
TIERS = Tier.values()
