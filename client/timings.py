"""The server's timeline of one request, as a typed object.

pdserve reports it as `timings` (top level of a non-streaming response, last SSE event of a
streaming one). Every field may be missing (another OpenAI-compatible server, an older pdserve):
a missing field reads as None. Fields the server adds later are kept in `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from client.errors import ProtocolError

_FLOAT_FIELDS = (
    "queue_ms", "prefill_ms", "transfer_ms", "transfer_exposed_ms", "first_decode_step_ms",
    "ttft_ms", "e2e_ms", "decode_tokens_per_s",
)
_INT_FIELDS = ("kv_bytes", "prompt_tokens", "completion_tokens")
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
        known = set(_FLOAT_FIELDS) | set(_INT_FIELDS) | set(_STR_FIELDS)
        values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
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
            if f.name == "extra" or value is None:
                continue
            if isinstance(value, float):
                unit = " tok/s" if f.name.endswith("_per_s") else " ms" if f.name.endswith("_ms") else ""
                out.append((f.name, f"{value:.2f}{unit}"))
            elif f.name == "kv_bytes":
                out.append((f.name, f"{value} ({value / 2**20:.2f} MiB)"))
            else:
                out.append((f.name, str(value)))
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
