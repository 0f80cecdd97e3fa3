"""The KV tiers below GPU memory: a host slot pool (pinned on CUDA), an optional disk directory
under it, and the cost model that chooses between reloading a cached prefix and recomputing it.

An entry is one whole block, every layer (`pool[:, b]`: entry_bytes = num_layers x
KVLayout.block_bytes), named by the prefix cache's block hash (bytes, opaque here). The engine
drives a HostTier from one caller thread (through workers/engine/tiering.py), and each tier the
one below it; the tiers' own threads only write files, read files and free slots.

One concept per module (each docstring lists its primitives):
    base.py    KVTier: what every tier answers (name, lookup, figures, ...); LowerTier: a tier under
               another, its store and load of bytes; TierSetting, what a tier module's build() takes;
               how to add a tier
    host.py    HostTier: the slot memory and its bookkeeping (LRU, spill to the tier below, discard, stats)
    copies.py  the copies between GPU blocks and host slots, both ways (staging, streams, runs; CUDA),
               and the load path that spans the host tier and the one below it
    load.py    LoadHandle: one load in flight, what the engine polls
    disk.py    DiskTier: files per batch (model, layout, per-block keyed MAC), restart-safe, LRU by file
    disk_format.py  its file format, and what a start keeps, counts and reclaims of what it finds
    files.py   the disk tier's files kept private and checked: folder, regular files, key, MAC, deadlines
    cost.py    CostModel: reload or recompute (torch-free)
    stats.py   TierStats: the counters each tier reports
This file imports nothing, so that base.py, cost.py and stats.py load without torch.
"""
