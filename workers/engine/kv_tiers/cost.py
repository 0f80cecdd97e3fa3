"""CostModel: reload a cached prefix from a tier below the GPU, or recompute it (torch-free).

Apart from the tiers because it is policy, not copies: the engine asks it, the HostTier seeds it
from probe copies and each finished LoadHandle feeds it; it knows only bytes, seconds and tokens.
    seed_bandwidth(tier, gbps), observe_load(tier, bytes, s), observe_prefill(tokens, s)
    should_reload(tier, num_tokens, bytes_per_token) -> bool, break_even_gbps(), reload_seconds(tier, bytes)
"""

from __future__ import annotations

import threading


class CostModel:
    """Reload or recompute: bytes over the tier's measured bandwidth against tokens times the
    measured prefill seconds per token (the seed's break-even link speed as a live decision).
    Both figures are EWMAs (weight `alpha` on each new observation); a tier's bandwidth starts
    from its probe. Before any prefill was observed, or for a tier never measured, reload."""

    def __init__(self, bytes_per_token: int | None = None, alpha: float = 0.2):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.bytes_per_token = bytes_per_token
        self.alpha = alpha
        self._gbps: dict[str, float] = {}
        self._s_per_token: float | None = None
        self._lock = threading.Lock()  # loads are observed from the tiers' threads too

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def seed_bandwidth(self, tier: str, gbps: float) -> None:
        if gbps > 0:
            with self._lock:
                self._gbps[tier] = gbps

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._gbps[tier] = self._mix(self._gbps.get(tier), nbytes / seconds / 1e9)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._s_per_token = self._mix(self._s_per_token, seconds / tokens)

    def bandwidth_gbps(self, tier: str) -> float | None:
        return self._gbps.get(tier)

    def reload_seconds(self, tier: str, nbytes: int) -> float | None:
        gbps = self._gbps.get(tier)
        return None if gbps is None else nbytes / (gbps * 1e9)

    def should_reload(self, tier: str, num_tokens: int, bytes_per_token: int | None = None) -> bool:
        if num_tokens <= 0:
            return False
        bpt = bytes_per_token or self.bytes_per_token
        reload_s = self.reload_seconds(tier, num_tokens * bpt) if bpt else None
        if self._s_per_token is None or reload_s is None:
            return True
        return reload_s < num_tokens * self._s_per_token

    def break_even_gbps(self, bytes_per_token: int | None = None) -> float | None:
        """The link speed at which reloading and recomputing cost the same (GB/s)."""
        bpt = bytes_per_token or self.bytes_per_token
        if not bpt or not self._s_per_token:
            return None
        return bpt / self._s_per_token / 1e9
