"""The server's timeline of one request, as a typed object.

pdserve reports it as `timings` (top level of a non-streaming response, last SSE event of a
streaming one). Every field may be missing (another OpenAI-compatible server, an older pdserve):
a missing field reads as None. Fields the server adds later are kept in `extra`.

`ttft_phases` is the time to first token split into the phases of protocol/phases.py (name -> ms,
in timeline order; None where the request's path has no such phase); they sum to `ttft_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from client.errors import ProtocolError
from protocol import phases as PH

_FLOAT_FIELDS = (
    "queue_ms", "prefill_ms", "transfer_ms", "transfer_exposed_ms", "first_decode_step_ms",
    "ttft_ms", "e2e_ms", "decode_tokens_per_s", "reload_ms",
)
_INT_FIELDS = ("kv_bytes", "prompt_tokens", "completion_tokens", "cached_tokens", "recomputed_tokens",
               "kv_skipped_tokens")
_STR_FIELDS = ("policy", "transport", "mode", "prefill_worker", "decode_worker", "worker")


@dataclass(frozen=True)
class Timings:
    policy: str | None = None  # "colocated" | "disaggregated"
    queue_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None  # None for colocated
    transfer_exposed_ms: float | None = None  # transfer done - prefill end: what TTFT pays
    first_decode_step_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    decode_tokens_per_s: float | None = None
    kv_bytes: int | None = None
    transport: str | None = None
    mode: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    worker: str | None = None  # the colocated worker, or the decode worker
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens whose KV the prefix cache gave (not computed)
    recomputed_tokens: int | None = None  # prompt tokens computed for this request
    kv_skipped_tokens: int | None = None  # disaggregated: held by the decode worker already, not transferred
    reload_ms: float | None = None  # reloading cached KV from host memory or disk
    ttft_phases: dict[str, float | None] | None = None  # the server's `ttft_phases_ms`
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict | None, request_id: str | None = None) -> "Timings | None":
        """None when the server sent no timings; raises ProtocolError on a wrongly typed field."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ProtocolError(f"`timings` must be a JSON object, got {type(data).__name__}", request_id)
        values: dict = {}
        for name in _FLOAT_FIELDS:
            values[name] = _typed(data, name, (int, float), float, request_id)
        for name in _INT_FIELDS:
            values[name] = _typed(data, name, (int,), int, request_id)
        for name in _STR_FIELDS:
            values[name] = _typed(data, name, (str,), str, request_id)
        values["ttft_phases"] = _phases(data.get(PH.FIELD), request_id)
        known = set(_FLOAT_FIELDS) | set(_INT_FIELDS) | set(_STR_FIELDS) | {PH.FIELD}
        values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)

    def to_dict(self) -> dict:
        """The server's object again (its field names)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "ttft_phases")}
        out[PH.FIELD] = None if self.ttft_phases is None else dict(self.ttft_phases)
        out.update(self.extra)
        return out

    @property
    def transfer_paid_ms(self) -> float | None:
        """The part of the KV move that TTFT pays: the exposed transfer, else the whole one."""
        return self.transfer_exposed_ms if self.transfer_exposed_ms is not None else self.transfer_ms

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for the fields that are present, in timeline order."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("extra", "ttft_phases") or value is None:
                continue
            if isinstance(value, float):
                unit = " tok/s" if f.name.endswith("_per_s") else " ms" if f.name.endswith("_ms") else ""
                out.append((f.name, f"{value:.2f}{unit}"))
            elif f.name == "kv_bytes":
                out.append((f.name, f"{value} ({value / 2**20:.2f} MiB)"))
            else:
                out.append((f.name, str(value)))
            if f.name == "ttft_ms" and self.ttft_phases:
                out.extend((f"  {k}", f"{v:.2f} ms") for k, v in self.ttft_phases.items() if v is not None)
        out.extend((k, str(v)) for k, v in self.extra.items())
        return out

    def table(self) -> str:
        rows = self.rows()
        if not rows:
            return "(the server reported no timings)"
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _typed(data: dict, name: str, accepted: tuple, convert, request_id: str | None):
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, accepted):
        if convert is int and isinstance(value, float) and value.is_integer():
            return int(value)
        raise ProtocolError(
            f"timings.{name} should be {'/'.join(t.__name__ for t in accepted)}, got {value!r}; "
            "the server's timings object does not follow the pdserve schema",
            request_id,
        )
    return convert(value)


def _phases(value, request_id: str | None) -> dict[str, float | None] | None:
    """The split, in the phases' order (names this client does not know yet go last, kept)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"timings.{PH.FIELD} should be an object of phase -> ms, got {value!r}", request_id)
    for name, ms in value.items():
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float))):
            raise ProtocolError(f"timings.{PH.FIELD}.{name} should be a number of ms or null, got {ms!r}", request_id)
    order = [n for n in PH.NAMES if n in value] + [n for n in value if n not in PH.NAMES]
    return {n: None if value[n] is None else float(value[n]) for n in order}
