"""KVTier and LowerTier: what the KV tiers answer (host.py and disk.py), and how tiering.py builds the list.

An entry is one whole block, every layer, named by its block hash. A tier copies entries in from
the tier above it and back up into it: the nearest tier (host memory) sits under the GPU pool,
every other one under the tier before it in protocol.enums.Tier.

KVTier: what every tier answers.
    name                          its protocol.enums.Tier value
    below                         the next tier down (a LowerTier), or None: where entries pushed out of this one go
    entry_bytes                   the bytes of one entry
    contains(name) -> bool        held here now (counts nothing)
    lookup([name]) -> [tier]      the tier (this one or one below) of each leading name held; stops at
                                  the first miss; counts hits and misses
    discard([name])               forget these entries here and below
    names() -> [name]             what this tier can serve now (the router's index)
    figures() -> TierStats        occupancy, bytes in and out, hits and misses
    probe_gbps() -> float         its read bandwidth, measured once (the cost model's first figure)
    flush() / close()             wait for its background work (and below's) / and stop it

LowerTier: a KVTier under another tier (disk.py): it takes entries as bytes (the host tier's slots)
and reads them back into buffers.
    store([(name, bytes)], ready, done)        keep these entries, in the background: ready() is called
                                               first (it returns once the bytes have landed), done(ok)
                                               once the bytes are no longer read
    load([name], [buffer]) -> [why | None]     read each entry into its buffer (entry_bytes, writable);
                                               per entry None or why it was refused

The host tier is the one tier under the GPU pool (tiering.build requires a HostTier there), so
its store and load, the engine's calls, are HostTier's own (host.py, copies.py), not KVTier's:
    store(pool, [(name, block)]) -> int        copy these GPU blocks into host slots, asynchronously
    load(pool, [(name, block)]) -> LoadHandle  copy these entries into the GPU blocks, asynchronously

How to add a tier `foo`
-----------------------
1. Name it: `FOO = "foo"` in protocol/enums.py Tier, in its place nearest first (after HOST). The
   wire, the timings, the metrics, the router's index and pricing follow from that name.
2. Write workers/engine/kv_tiers/foo.py: a class that answers LowerTier, and
   `build(setting: TierSetting, below: LowerTier | None) -> LowerTier | None` (None: the config does
   not ask for it). tiering.build() imports kv_tiers.<name> for each Tier, farthest first, and hands
   each the one built below it.
3. Its flag (and the check of it) in settings/worker.py EngineConfig.
This file imports nothing at run time (no torch), like cost.py and stats.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.kv_cache import KVLayout
    from pdserve.workers.engine.kv_tiers.stats import TierStats


class KVTier(Protocol):
    """What every tier answers (the module docstring)."""

    name: str
    below: LowerTier | None
    entry_bytes: int

    def contains(self, name: bytes) -> bool: ...

    def lookup(self, names: list[bytes]) -> list[str]: ...

    def discard(self, names: list[bytes]) -> None: ...

    def names(self) -> list[bytes]: ...

    def figures(self) -> TierStats: ...

    def probe_gbps(self) -> float: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class LowerTier(KVTier, Protocol):
    """A tier under another tier: entries come in and go back up as bytes (the module docstring)."""

    def store(self, entries: list[tuple[bytes, memoryview]], ready: Callable[[], None] | None = None,
              done: Callable[[bool], None] | None = None) -> None: ...

    def load(self, names: list[bytes], buffers: list[memoryview]) -> list[str | None]: ...


@dataclass(frozen=True)
class TierSetting:
    """What a tier is built from (each tier module's build() takes it)."""

    config: EngineConfig
    layout: KVLayout
    device: object  # the engine's torch device
    model_name: str
    key: bytes | None = None  # the deployment's key for entries kept outside the process (WorkerKeys.disk_key)


def chain(tier: KVTier | None) -> list[KVTier]:
    """This tier and every tier below it, nearest first."""
    out = []
    while tier is not None:
        out.append(tier)
        tier = tier.below
    return out
