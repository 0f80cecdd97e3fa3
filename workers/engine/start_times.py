"""Where a worker's start went: one record, filled in as the start goes, read by the worker's ready
line (workers/status_log.py) and by `pdserve-bench start`.

    Engine.__init__       began, load_s (None: the model came loaded), kv_pool_s, tiers_s, setup_s
    Engine.warmup         decode graphs and piecewise graphs: how many, and their seconds
    the worker            warmup_s (the warm-up request, workers/warmup.py), then finish(): total_s

Host clock (time.monotonic). A part that launches device work synchronises the device before its
end stamp, so its seconds include the device's. The parts never overlap, so their sum is at most
the total; the rest (what runs between them: the graphs' bookkeeping, the role's own set-up) is
`other_s`, reported as such rather than folded into a part. A graph's capture includes whatever its
first forward pays for: torch.compile of the layers, Triton's compilation of a kernel variant not
seen before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# the parts in the order a start runs them: (attribute, name in the ready line)
PARTS = (("load_s", "model load"), ("kv_pool_s", "KV pool"), ("tiers_s", "KV tiers"),
         ("setup_s", "engine set-up"), ("decode_graphs_s", "decode graphs"),
         ("piecewise_graphs_s", "piecewise graphs"), ("warmup_s", "warm-up request"))


@dataclass
class StartTimes:
    began: float = field(default_factory=time.monotonic)  # the Engine's first line
    load_s: float | None = None  # None: the engine was handed a loaded model
    kv_pool_s: float = 0.0  # the pool's size worked out, the pool allocated and zeroed
    tiers_s: float = 0.0  # host and disk KV tiers (pinned host memory is allocated here)
    setup_s: float = 0.0  # the runner (fused Q/K/V, compile wrappers, graph buffers), scheduler, sampler
    decode_graphs: int = 0
    decode_graphs_s: float = 0.0
    decode_graphs_left: int = 0  # left for idle time (EngineConfig.graphs "lazy")
    piecewise_graphs: int = 0  # token buckets x segments
    piecewise_graphs_s: float = 0.0
    piecewise_buckets_left: int = 0  # token buckets left for idle time (EngineConfig.graphs "lazy")
    warmup_s: float = 0.0  # the warm-up request (0: none ran)
    total_s: float | None = None  # set by finish()

    def finish(self) -> float:
        """The start is over (the worker is ready): total_s from `began` to now."""
        self.total_s = time.monotonic() - self.began
        return self.total_s

    def parts(self) -> dict[str, float]:
        return {attr: getattr(self, attr) or 0.0 for attr, _ in PARTS}

    @property
    def other_s(self) -> float:
        return (self.total_s or 0.0) - sum(self.parts().values())

    @property
    def after_load_s(self) -> float:
        """From the model loaded to ready: what issue-level start targets are about."""
        return (self.total_s or 0.0) - (self.load_s or 0.0)

    def describe(self) -> str:
        """`ready 61.3 s after start (8.1 s model load, then 53.2 s: KV pool 0.4 s, ...)`."""
        shown = []
        for attr, name in PARTS[1:]:
            s = getattr(self, attr)
            if attr == "decode_graphs_s":
                left = f" ({self.decode_graphs_left} more while idle)" if self.decode_graphs_left else ""
                shown.append(f"{self.decode_graphs} decode graphs {s:.2f} s{left}")
            elif attr == "piecewise_graphs_s":
                n = self.piecewise_buckets_left
                left = f" ({n} buckets more while idle)" if n else ""
                shown.append(f"{self.piecewise_graphs} piecewise graphs {s:.2f} s{left}")
            else:
                shown.append(f"{name} {s:.2f} s")
        shown.append(f"other {self.other_s:.2f} s")
        load = "model given" if self.load_s is None else f"model load {self.load_s:.2f} s"
        return f"ready {self.total_s or 0.0:.2f} s after start ({load}, then {self.after_load_s:.2f} s: " \
               f"{', '.join(shown)})"

    def to_dict(self) -> dict:
        out = {attr: getattr(self, attr) for attr, _ in PARTS}
        out.update(decode_graphs=self.decode_graphs, decode_graphs_left=self.decode_graphs_left,
                   piecewise_graphs=self.piecewise_graphs, piecewise_buckets_left=self.piecewise_buckets_left,
                   total_s=self.total_s,
                   other_s=self.other_s, after_load_s=self.after_load_s)
        return out
