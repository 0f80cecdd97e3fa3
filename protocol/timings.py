"""A request's `timings` object: one typed struct from the router to the client.

The router builds it (server/timeline.py, from the stamps each worker took on its own clock),
/metrics histograms it (server/metrics.py), the response carries it as JSON (top level of a
non-streaming response, last SSE event of a streaming one), and the client reads it back into the
same struct (client.Timings is this class). A new field is one line here, plus where it is
measured; its JSON name is its field name.

Every field may be missing when the client reads another OpenAI-compatible server or an older
pdserve: a missing field reads as None, and fields this version does not know are kept in `extra`.
`ttft_phases_ms` is the time to first token split into the phases of protocol/phases.py (name -> ms,
in timeline order; None where the request's path has no such phase); they sum to `ttft_ms`.
Per-tier figures are keyed by KV_PLACES (the worker's own pool, then each tier of protocol.enums.Tier):
`reused_tokens` is an object of them, `route` has one `expected_<place>_tokens` field each.

Standard library only: the router, the client and the load bench import it without torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields

from pdserve.protocol import phases as PH
from pdserve.protocol.enums import TIERS

# where a request's cached KV can come from: the worker's own pool ("device": on a GPU or the CPU), then
# each tier below it, nearest first
KV_PLACES = ("device", *TIERS)


class TimingsError(ValueError):
    """A `timings` object whose field has the wrong type (the client raises its ProtocolError for it)."""


@dataclass(frozen=True)
class Failover:
    """A disaggregated request whose prefill or KV transfer failed ran once more elsewhere (--failover)."""

    from_: str = ""  # the decode worker it had (JSON: "from")
    to: str = ""  # where it ran again: a decode worker, or a colocated one
    error: str = ""  # why the first try failed


@dataclass(frozen=True)
class Migration:
    """A running request whose decode (or colocated) worker was lost went on elsewhere (--migrate): the
    router sent the prompt and the tokens generated so far to another worker, which continued them."""

    from_: str = ""  # the worker that was lost (JSON: "from")
    to: str = ""  # where the request continued: a disaggregated pair, or a colocated worker
    after_tokens: int = 0  # tokens the client had when it moved (the next one came from `to`)
    error: str = ""  # how the worker was lost


@dataclass(frozen=True)
class Route:
    """Why the request went where it did: the worker the router chose, the cached prompt tokens it
    expected there per tier (from the workers' reports), and the TTFT it predicted from their measured
    costs. `rule`: "kv" (priced by cached prefix) or "least-loaded"."""

    worker: str = ""  # colocated: the worker; disaggregated: "prefill/decode"
    rule: str = ""
    # KV_PLACES -> the cached prompt tokens expected there (JSON: one field per place, expected_device_tokens,
    # expected_host_tokens, ...; 0 where none)
    expected_tokens: dict[str, int] = field(default_factory=dict, metadata={"json": "expected_{}_tokens"})
    # the worker's part as priced (queue ahead, prefill, reload, load): compare with the prefill_queue and
    # prefill phases; None: the worker had measured nothing yet
    predicted_ttft_ms: float | None = None
    auto: str = ""  # policy "auto": why this policy (the inputs of the decision)


@dataclass(frozen=True)
class Timings:
    policy: str | None = None  # "colocated" | "disaggregated"
    queue_ms: float | None = None  # parse + route + inbox + prefill_queue: arrival -> prefill start
    prefill_ms: float | None = None  # the prefilling worker's forward over the prompt
    transfer_ms: float | None = None  # prefill worker: first copy issued -> last copy complete (None: colocated)
    transfer_exposed_ms: float | None = None  # prefill end -> last copy complete: what TTFT pays
    first_decode_step_ms: float | None = None  # the step that makes token 2 (inside e2e_ms, never ttft_ms)
    ttft_ms: float | None = None  # router: arrival -> token 1 handed to the response
    e2e_ms: float | None = None  # router: arrival -> last token received
    ttft_phases_ms: dict[str, float | None] | None = None  # ttft_ms split into protocol/phases.py's phases
    decode_tokens_per_s: float | None = None  # tokens after the first / (last token - first token)
    kv_bytes: int | None = None  # KV moved from the prefill to the decode worker (0: colocated)
    transport: str | None = None
    mode: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    worker: str | None = None  # the colocated worker, or the decode worker
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens whose KV the prefix cache gave (not computed)
    recomputed_tokens: int | None = None  # prompt tokens computed for this request
    reused_tokens: dict[str, int] | None = None  # where the cached tokens came from: KV_PLACES -> tokens
    reload_ms: float | None = None  # reloading cached KV from host memory or disk
    kv_skipped_tokens: int | None = None  # disaggregated: held by the decode worker already, not transferred
    failover: Failover | None = None  # set when the request ran a second time (--failover)
    migrations: list[Migration] | None = None  # set when it moved while running (--migrate), in order
    route: Route | None = None  # where the router sent it and what it expected there
    extra: dict = field(default_factory=dict)  # the client: fields this version does not know

    def to_dict(self) -> dict:
        """The JSON object (field names are the API's)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if f.name in ("failover", "migrations") and value is None:
                continue  # present only when it happened
            if dataclasses.is_dataclass(value):
                value = _plain(value)
            elif isinstance(value, list):
                value = [_plain(v) for v in value]
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict | None) -> "Timings | None":
        """None when the server sent no timings; TimingsError on a wrongly typed field."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise TimingsError(f"`timings` must be a JSON object, got {type(data).__name__}")
        values: dict = {}
        for f in fields(cls):
            if f.name != "extra" and data.get(f.name) is not None:
                values[f.name] = _read(f.name, _HINTS[f.name], data[f.name])
        values["extra"] = {k: v for k, v in data.items() if k not in _HINTS}
        return cls(**values)

    @property
    def ttft_phases(self) -> dict[str, float | None] | None:
        return self.ttft_phases_ms

    @property
    def transfer_paid_ms(self) -> float | None:
        """The part of the KV move that TTFT pays: the exposed transfer, else the whole one."""
        return self.transfer_exposed_ms if self.transfer_exposed_ms is not None else self.transfer_ms

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for the fields that are present, in timeline order."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("extra", PH.FIELD) or value is None:
                continue
            if isinstance(value, float):
                unit = " tok/s" if f.name.endswith("_per_s") else " ms" if f.name.endswith("_ms") else ""
                out.append((f.name, f"{value:.2f}{unit}"))
            elif f.name == "kv_bytes":
                out.append((f.name, f"{value} ({value / 2**20:.2f} MiB)"))
            elif dataclasses.is_dataclass(value):
                out.append((f.name, ", ".join(f"{k} {v}" for k, v in _plain(value).items())))
            elif isinstance(value, list):
                out.extend((f.name, ", ".join(f"{k} {v}" for k, v in _plain(m).items())) for m in value)
            elif isinstance(value, dict):
                out.append((f.name, ", ".join(f"{k} {v}" for k, v in value.items())))
            else:
                out.append((f.name, str(value)))
            if f.name == "ttft_ms" and self.ttft_phases_ms:
                out.extend((f"  {k}", f"{v:.2f} ms") for k, v in self.ttft_phases_ms.items() if v is not None)
        out.extend((k, str(v)) for k, v in self.extra.items())
        return out

    def table(self) -> str:
        rows = self.rows()
        if not rows:
            return "(the server reported no timings)"
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


_HINTS = {k: v for k, v in typing.get_type_hints(Timings).items() if k != "extra"}


def _read(name: str, hint, value):
    """One JSON value as the field's type says (int, float, str, a phase split, tokens per place, a nested
    struct)."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = kinds[0]
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(kind) is dict:
        return _phases(value) if name == PH.FIELD else _per_place(name, value)
    elif typing.get_origin(kind) is list and isinstance(value, list):
        return [_read(name, typing.get_args(kind)[0], v) for v in value]
    elif dataclasses.is_dataclass(kind) and isinstance(value, dict):
        names = {f.name.rstrip("_"): f.name for f in fields(kind) if "json" not in f.metadata}
        args = {names[k]: v for k, v in value.items() if k in names}
        for f in fields(kind):
            if "json" in f.metadata:  # one JSON field per place
                args[f.name] = {p: value[key] for p in KV_PLACES if (key := f.metadata["json"].format(p)) in value}
        return kind(**args)
    raise TimingsError(f"timings.{name} should be {getattr(kind, '__name__', kind)}, got {value!r}; the server's "
                       "timings object does not follow the pdserve schema")


def _plain(value) -> dict:
    """A nested struct as its JSON object (from_ -> "from"; a field keyed by place: one JSON field per place,
    every place present)."""
    out = {}
    for f in fields(value):
        v = getattr(value, f.name)
        if "json" in f.metadata:
            out.update({f.metadata["json"].format(p): v.get(p, 0) for p in KV_PLACES})
        else:
            out[f.name.rstrip("_")] = v
    return out


def _per_place(name: str, value) -> dict[str, int]:
    """Tokens per place (KV_PLACES, in that order; every place present, places this version does not know
    dropped)."""
    if not isinstance(value, dict):
        raise TimingsError(f"timings.{name} should be an object of place -> tokens, got {value!r}")
    return {p: 0 if value.get(p) is None else _read(f"{name}.{p}", int, value[p]) for p in KV_PLACES}


def _phases(value) -> dict[str, float | None]:
    """The split, in the phases' order (names this version does not know go last, kept)."""
    if not isinstance(value, dict):
        raise TimingsError(f"timings.{PH.FIELD} should be an object of phase -> ms, got {value!r}")
    for name, ms in value.items():
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float))):
            raise TimingsError(f"timings.{PH.FIELD}.{name} should be a number of ms or null, got {ms!r}")
    order = [n for n in PH.NAMES if n in value] + [n for n in value if n not in PH.NAMES]
    return {n: None if value[n] is None else float(value[n]) for n in order}
