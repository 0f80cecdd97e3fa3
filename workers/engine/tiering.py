"""The engine's side of the KV tiers: which cached blocks go down to host memory (and disk), and
when a prompt's prefix is reloaded from there instead of recomputed.

    build(config, layout, device, model_name, blocks, pool, disk_key) -> Tiers | None   what the config asks for:
                                    for each protocol.enums.Tier, farthest first, kv_tiers/<name>.py's
                                    build(setting, below) (kv_tiers/base.py: how to add a tier)
    Tiers(engine's prefix cache, pool, HostTier)
    levels                          the tiers below the pool, nearest first (each a kv_tiers.base.KVTier:
                                    name, contains, lookup, names() and figures(); each drives the one below it)
    reloaded_tokens                 {tier name: prompt tokens reloaded from it}, cumulative
    offload(req)                    a request is over: its named blocks are copied down, in the
                                    background (skipping those the tier holds); the GPU copies stay
                                    cached until evicted, so eviction itself costs nothing
    plan(names) -> [tier]           of the names after a GPU hit, the leading run held below, cut to
                                    what the cost model says is cheaper to reload than to recompute;
                                    a look (peek), counting no hit or miss
    peek(names) -> [tier]           what host.lookup(names) answers, counting no hit or miss
    count(names)                    the lookup of a claim taken (PromptBlocks.take), counted in each
                                    tier's hits and misses: once per placement, not per plan
    start(req, names, blocks, tiers)  reload those entries into the request's blocks, asynchronously
    poll(req) -> bool               True once nothing is loading for it (its KV landed, or the part
                                    that did not is left to compute: num_computed says how far)
    wait(req)                       block until its load is over (before its blocks are freed)
    observe_prefill(tokens, s)      feeds the cost model the measured prefill time per token

Write-through at finish, not copy-at-eviction: an eviction happens when a new request needs
blocks, which is on its critical path; a store after a request ends is not on anyone's.
"""

from __future__ import annotations

import importlib
import logging

from pdserve.protocol.control import CacheFigures, TierFigures
from pdserve.protocol.enums import TIERS, Tier
from pdserve.settings.worker import EngineConfig
from pdserve.workers.engine import kv_tiers
from pdserve.workers.engine.kv_cache import KVLayout
from pdserve.workers.engine.kv_tiers.base import KVTier, TierSetting, chain
from pdserve.workers.engine.kv_tiers.host import HostTier
from pdserve.workers.engine.kv_tiers.load import LoadHandle
from pdserve.workers.engine.request import Request

log = logging.getLogger("pdserve.engine")

MODULES = {tier: f"{kv_tiers.__name__}.{tier.value}" for tier in Tier}  # each tier's module: kv_tiers/<name>.py


def build(config: EngineConfig, layout: KVLayout, device, model_name: str, blocks, pool,
          disk_key: bytes | None = None) -> "Tiers | None":
    """The tiers below the pool for blocks the prefix cache keeps, if the config asks for them (the
    nearest, host memory, first of all). disk_key: the deployment's key for the disk tier's entries
    (WorkerKeys.disk_key); None: the tier folder's own key."""
    if not config.prefix_cache:
        return None
    setting = TierSetting(config, layout, device, model_name, disk_key)
    below: KVTier | None = None
    for tier in reversed(Tier):  # farthest first: each tier is built over the one below it
        below = importlib.import_module(MODULES[tier]).build(setting, below) or below
    if not isinstance(below, HostTier):  # the engine stores into and loads from host memory
        if below is not None:
            below.close()
        return None
    log.info("KV tiers: %s", ", ".join(f"{t.name} {t.figures().capacity_bytes / 2**30:.1f} GiB" for t in chain(below)))
    return Tiers(blocks, pool, below, layout.block_size)


class Tiers:
    def __init__(self, blocks, pool, host: HostTier, block_size: int):
        self.blocks = blocks  # the PrefixCache
        self.pool = pool  # KVCache.pool
        self.host = host  # the nearest tier: the engine's stores and loads go through it
        self.levels: list[KVTier] = chain(host)
        self.block_size = block_size
        self.bytes_per_token = host.layout.bytes_per_token
        self.loads: dict[int, tuple[LoadHandle, list[str], int]] = {}  # id(req) -> (handle, tiers, first block)
        self.reloaded_tokens = dict.fromkeys(TIERS, 0)
        blocks.on_evict = host.before_reuse

    def offload(self, req: Request) -> None:
        items = [(n, b) for n, b in zip(req.block_names[:req.named_blocks], req.block_ids[:req.named_blocks])
                 if self.blocks.name_of(b) == n]
        if items:
            self.host.store(self.pool, items)

    def plan(self, names: list[bytes]) -> list[str]:
        """The tier of each name to reload from (above). A look that counts nothing (peek): a request is
        planned again at every try to place it (no room yet, the next tick's pricing), and its lookup is
        counted once, when its claim is taken (count)."""
        tiers = self.peek(names) if names else []
        # the cost model: a tier slower than recomputing (the seed's break-even) serves nothing, and the
        # prefix stops where it would be needed
        cost, bs = self.host.cost, self.block_size
        ok = {t: cost.should_reload(t, tiers.count(t) * bs, self.bytes_per_token) for t in set(tiers)}
        cut = next((i for i, t in enumerate(tiers) if not ok[t]), len(tiers))
        return tiers[:cut]

    def peek(self, names: list[bytes]) -> list[str]:
        """What host.lookup(names) answers, counting nothing: the nearest tier holding each leading name,
        to the first name none holds."""
        out = []
        for name in names:
            tier = next((t.name for t in self.levels if t.contains(name)), None)
            if tier is None:
                break
            out.append(tier)
        return out

    def count(self, names: list[bytes]) -> None:
        """Count a lookup of these names in each tier's hits and misses, as host.lookup counts it; its
        answer is not used (what is reloaded is the claim's, from plan)."""
        self.host.lookup(names)

    def start(self, req: Request, names: list[bytes], blocks: list[int], tiers: list[str], first: int) -> None:
        handle = self.host.load(self.pool, list(zip(names, blocks)))
        self.loads[id(req)] = (handle, tiers, first)

    def loading(self, req: Request) -> bool:
        return id(req) in self.loads

    def poll(self, req: Request, wait: bool = False) -> bool:
        """True once the request has no load in flight; applies a finished one to it."""
        entry = self.loads.get(id(req))
        if entry is None:
            return True
        handle, tiers, first = entry
        if wait:
            handle.wait()
        elif not handle.done():
            return False
        del self.loads[id(req)]
        landed = handle.loaded
        if handle.error:
            log.warning("request %s: reloading its cached prefix stopped after %d of %d blocks (%s); the rest "
                        "is computed", req.request_id, landed, len(tiers), handle.error)
        bs = self.block_size
        if req.num_computed == first * bs:  # not preempted meanwhile
            req.num_computed += landed * bs
            req.cached_tokens += landed * bs
            for t in tiers[:landed]:
                req.tier_tokens[t] = req.tier_tokens.get(t, 0) + bs
                self.reloaded_tokens[t] += bs
            req.reload_s = (req.reload_s or 0.0) + (handle.seconds or 0.0)
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.host.cost.observe_prefill(tokens, seconds)

    def close(self) -> None:
        self.host.close()


def cache_figures(blocks, tiers: Tiers | None) -> CacheFigures:
    """The prefix cache (`blocks`, prefix_cache.PrefixCache) and its tiers, cumulative: what a heartbeat carries."""
    if tiers is None:
        return CacheFigures(queried_tokens=blocks.queried_tokens, gpu_hit_tokens=blocks.hit_tokens)
    figures = {t.name: t.figures() for t in tiers.levels}
    return CacheFigures(queried_tokens=blocks.queried_tokens, gpu_hit_tokens=blocks.hit_tokens,
                        tier_hit_tokens=dict(tiers.reloaded_tokens),
                        tiers={name: TierFigures(usage_bytes=s.bytes, capacity_bytes=s.capacity_bytes,
                                                 offload_bytes=s.stored_bytes, reload_bytes=s.loaded_bytes)
                               for name, s in figures.items()})
