"""Command-line flags derived from config dataclasses, so each flag is declared once: on its field.

    flag(default, help, ...)          a dataclass field that carries its flag (name, help, choices)
    add_arguments(parser, Config)     one argparse option per flagged field of Config
    from_args(Config, namespace)      Config built back from what argparse parsed (values: as a dict)

The rules, which keep the flag names users know: a field `max_num_seqs` is `--max-num-seqs` unless
`flag(name=...)` says otherwise (`TransferConfig.host` is `--kv-host`); an on/off field whose default
is True is `--no-<name>` (off), one whose default is False `--<name>` (on); the argparse dest is the
flag's name without its dashes and without "no-" (`args.warmup`, `args.kv_host`), as the tests and
--config files use it. `int | None` fields parse as int; a None default shows no default in --help.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, Field, field, fields, replace
from types import UnionType

FLAG = "flag"  # the metadata key of a field's flag


def flag(default=MISSING, help: str = "", *, name: str | None = None, choices=None, metavar: str | None = None,
         type=None, **field_options) -> Field:
    """A dataclass field with its command-line flag; `type` parses the flag's text (default: the field's type)."""
    spec = {"help": help, "name": name, "choices": choices, "metavar": metavar, "type": type}
    return field(default=default, metadata={FLAG: spec}, **field_options)


def _flagged(cls, only=None) -> list[Field]:
    return [f for f in fields(cls) if FLAG in f.metadata and (only is None or f.name in only)]


def option(f: Field) -> tuple[str, str]:
    """The field's flag and its argparse dest: ("--no-warmup", "warmup"), ("--kv-host", "kv_host")."""
    name = f.metadata[FLAG]["name"] or "--" + f.name.replace("_", "-")
    if f.default is True and not name.startswith("--no-"):
        name = "--no-" + name.removeprefix("--")
    dest = name.removeprefix("--").replace("-", "_")
    return name, dest.removeprefix("no_") if isinstance(f.default, bool) else dest


def _parser_type(cls, f: Field):
    """The field's annotation as argparse's `type`: int for `int | None`; None (a string) for str."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint if hint in (int, float) else None


def add_arguments(p, cls, *, base=None, only=None, overrides: dict[str, dict] | None = None) -> None:
    """Add a flag for each flagged field of `cls` (those named in `only`, if given) to `p` (a parser or
    an argument group). Defaults are the fields' own, or `base`'s values (an instance of `cls`);
    `overrides` maps a field name to add_argument keywords that differ in this command (e.g. its default)."""
    for f in _flagged(cls, only):
        spec = f.metadata[FLAG]
        name, dest = option(f)
        kw: dict = {"dest": dest, "help": spec["help"]}
        default = getattr(base, f.name) if base is not None else f.default
        if isinstance(f.default, bool):
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw |= {"type": spec["type"] or _parser_type(cls, f), "choices": spec["choices"], "metavar": spec["metavar"]}
        if default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
        kw |= (overrides or {}).get(f.name, {})
        p.add_argument(name, **kw)


def values(cls, args: argparse.Namespace, only=None) -> dict:
    """The fields of `cls` that add_arguments(..., cls, only=only) made flags for, as parsed: {name: value}."""
    return {f.name: getattr(args, option(f)[1]) for f in _flagged(cls, only)}


def from_args(cls, args: argparse.Namespace, *, base=None, only=None, **given):
    """`cls` from its parsed flags (see values), `given` fields on top; with `base`, the fields that
    have no flag keep base's values (else their defaults)."""
    fields_ = values(cls, args, only) | given
    return replace(base, **fields_) if base is not None else cls(**fields_)
