"""KVTier: what every KV tier answers, and how tiering.py builds the list (host.py and disk.py implement it).

An entry is one whole block, every layer, named by its block hash. A tier copies entries in from
the tier above it and back up into it: the nearest tier (host memory) sits under the GPU pool,
every other one under the tier before it in protocol.enums.Tier.
    name                          its protocol.enums.Tier value
    below                         the next tier down, or None: where entries pushed out of this one go
    entry_bytes                   the bytes of one entry
    contains(name) -> bool        held here now (counts nothing)
    lookup([name]) -> [tier]      the tier (this one or one below) of each leading name held; stops at
                                  the first miss; counts hits and misses
    store(...)                    copy entries in from the tier above, asynchronously: the host tier from
                                  GPU blocks (pool, [(name, block)]); a tier below it from the host's slot
                                  bytes ([(name, bytes)], ready, done)
    load(...)                     copy entries back up into the tier above: the host tier into GPU blocks
                                  (pool, [(name, block)]) -> LoadHandle; a tier below it into the host's
                                  buffers ([name], [buffer]) -> per entry None or why it was refused
    discard([name])               forget these entries here and below
    names() -> [name]             what this tier can serve now (the router's index)
    figures() -> TierStats        occupancy, bytes in and out, hits and misses
    probe_gbps() -> float         its read bandwidth, measured once (the cost model's first figure)
    flush() / close()             wait for its background work (and below's) / and stop it

How to add a tier `foo`
-----------------------
1. Name it: `FOO = "foo"` in protocol/enums.py Tier, in its place nearest first. The wire, the
   timings, the metrics, the router's index and pricing follow from that name.
2. Write workers/engine/kv_tiers/foo.py: a class that answers KVTier, and
   `build(setting: TierSetting, below: KVTier | None) -> KVTier | None` (None: the config does not
   ask for it). tiering.build() imports kv_tiers.<name> for each Tier, farthest first, and hands
   each the one built below it.
3. Its flag (and the check of it) in settings/worker.py EngineConfig.
This file imports nothing at run time (no torch), like cost.py and stats.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.settings.worker import EngineConfig
    from pdserve.workers.engine.kv_cache import KVLayout
    from pdserve.workers.engine.kv_tiers.stats import TierStats


class KVTier(Protocol):
    name: str
    below: KVTier | None
    entry_bytes: int

    def contains(self, name: bytes) -> bool: ...

    def lookup(self, names: list[bytes]) -> list[str]: ...

    def store(self, *args, **kwargs): ...

    def load(self, *args, **kwargs): ...

    def discard(self, names: list[bytes]) -> None: ...

    def names(self) -> list[bytes]: ...

    def figures(self) -> TierStats: ...

    def probe_gbps(self) -> float: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


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
