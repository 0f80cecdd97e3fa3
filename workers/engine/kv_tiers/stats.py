"""TierStats: the counters every KV tier reports (each tier's figures() returns its own).

Its own module because both tiers fill it and the worker's heartbeat carries it up to /metrics
(server/metrics.py's observe_kv_tiers), so neither tier's module should own it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierStats:
    tier: str
    entries: int = 0
    bytes: int = 0  # held now
    capacity_bytes: int = 0
    stored_bytes: int = 0  # written into this tier, in all
    loaded_bytes: int = 0  # read out of it towards GPU blocks, in all
    hits: int = 0  # lookup: hashes found in this tier
    misses: int = 0  # lookup: hashes looked for here and not found
    evicted: int = 0  # entries pushed out (host: to disk or dropped; disk: files deleted)
    dropped: int = 0  # host: blocks a store found no room for; disk: entries a write failed or skipped
    corrupt: int = 0  # disk: entries refused on read (checksum, short read)
