"""A request body, parsed and checked before any model sees it: hostile input is refused before it
costs anything. The body parses with NaN/Infinity refused and nesting at most MAX_JSON_DEPTH deep
(deeper is refused without the parser's recursion, naming the field); every string (keys too) must be
valid Unicode (a lone surrogate such as \\ud800 cannot be tokenized or encoded); at most MAX_MESSAGES
chat messages. A field of OpenAI's or vLLM's that the endpoint does not implement is refused, naming
it, unless it holds its neutral value (server/fields.py); pydantic's errors become one 400 naming the
field.

    parse_body(raw, Model, sizes)   -> the validated request model, or APIError (400); `sizes` bounds fields by
                                       their length (items, keys) before anything walks them: a body of 600k
                                       allowed ids is refused in the time its JSON takes to parse, not the ten
                                       times that checking and validating each id would cost the router
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from pdserve.server.errors import APIError, bad_request
from pdserve.server.fields import neutral_values, reason

MAX_JSON_DEPTH = 32  # the deepest real body (chat content parts) is 5 levels
MAX_MESSAGES = 2048  # chat messages per request (OpenAI's own cap)
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_body(raw: bytes, model_cls: type[BaseModel], sizes: dict[str, tuple[int, str]] | None = None) -> BaseModel:
    try:
        data = json.loads(raw)  # NaN and Infinity parse; check_tree refuses them, naming the field
    except RecursionError:  # the C parser nests the stack once per level: refuse, do not crash
        field = _deep_field(raw)
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
                          + (f" (in `{field}`)" if field else ""), field, "invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object, "
                          f"e.g. {{\"prompt\": \"Hello\", \"max_tokens\": 16}}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    check_sizes(data, sizes or {})
    check_tree(data)
    refuse_unsupported(data, model_cls)
    for name in [k for k, v in data.items() if v is None and k in model_cls.model_fields]:
        del data[name]  # null is "not set" (what many clients send): the field's default
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise bad_request(f"`messages` holds {len(messages)} messages; at most {MAX_MESSAGES} per request",
                          "messages", "too_many_messages")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def check_sizes(data: dict, sizes: dict[str, tuple[int, str]]) -> None:
    """Each field named in `sizes` holds at most that many items (a list's, an object's keys); a name
    ending in ".chars" bounds the characters of that list's strings together. The value is (the bound,
    what the 400 says after the field's name, with {n} and {most}): the request models check the same
    bounds in the same words, later, on what passes here."""
    for name, (most, says) in sizes.items():
        field, _, chars = name.partition(".")
        value = data.get(field)
        if chars and isinstance(value, list):
            n = sum(len(v) for v in value if isinstance(v, str))
        elif not chars and isinstance(value, (list, dict)):
            n = len(value)
        else:
            continue
        if n > most:
            raise bad_request(f"`{field}` " + says.format(n=n, most=most), field, "too_long" if chars else
                              "too_many_items")


def refuse_unsupported(data: dict, model_cls: type[BaseModel]) -> None:
    """Refuse, naming it, a field this endpoint does not implement (server/fields.py); drop it when it
    holds a neutral value (or null: clients send null for "not set")."""
    kind = getattr(model_cls, "endpoint", None)
    table = neutral_values(kind) if kind else {}
    for name in [k for k in data if k in table and k not in model_cls.model_fields]:
        value, neutral = data[name], table[name]
        if value is None or any(_same(value, v) for v in neutral):
            del data[name]
            continue
        hint = f"leave it out or set it to {json.dumps(neutral[0])}" if neutral else "leave it out"
        why = reason(kind, name)
        raise bad_request(f"`{name}` is not supported by pdserve{f' ({why})' if why else ''}, got {show(value)}; "
                          f"{hint}", name, "unsupported_field")


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same JSON type (false is not 0 here: `logprobs: 0` asks for logprobs)."""
    def kind(v):
        return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)
    return kind(value) == kind(neutral) and value == neutral


def check_tree(data: dict) -> None:
    """Nesting depth, valid Unicode and finite numbers everywhere, without recursion (the depth is what
    is checked)."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at `{_dotted(path)}`)",
                              _dotted(path[:1]), "invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path + (k,))
                if isinstance(v, (dict, list, str, float)):
                    stack.append((v, path + (k,), depth + 1))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (dict, list, str, float)):
                    stack.append((v, path + (i,), depth + 1))
        elif isinstance(value, float):
            if not math.isfinite(value):
                where = _dotted(path)
                raise bad_request(f"`{where}` is {value}, which is not JSON; send a finite number", where,
                                  "invalid_json")
        else:
            _check_text(value, path)


def _check_text(text: str, path: tuple) -> None:
    bad = _SURROGATE.search(text)
    if bad is not None:
        where = _dotted(path)
        raise bad_request(f"`{where}` holds a lone surrogate (\\u{ord(bad.group()):04x} at character {bad.start()}), "
                          f"which is not valid Unicode text; send UTF-8 text", where, "invalid_text")


def _dotted(path: tuple) -> str:
    """The field's path, printable: a surrogate in a key is shown escaped (the error must encode as UTF-8)."""
    return ".".join(str(p) for p in path).encode("utf-8", "backslashreplace").decode("utf-8")


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


def _deep_field(raw: bytes) -> str | None:
    """The top-level field whose value nests too deep for the parser, found without parsing (strings are
    one token each, so this walks only brackets until the depth is passed)."""
    depth, key, last = 0, None, None
    for m in _JSON_TOKEN.finditer(raw):
        t = m.group()
        if t in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif t in (b"]", b"}"):
            depth -= 1
        elif t == b":":
            if depth == 1 and last is not None:
                key = last
        else:
            last = t[1:-1].decode("utf-8", "replace") if depth == 1 else None
    return key


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return bad_request(f"`{param}` is required", param=param, code="missing_field")
    if err["type"] == "extra_forbidden":
        return bad_request(f"`{param}` is not a field pdserve knows, so it is not supported; leave it out (the "
                           f"fields each endpoint takes: docs/api.md, or GET /openapi.json)",
                           param=param, code="unsupported_field")
    if err["type"] == "value_error":
        return bad_request(msg, param=param)
    given = err.get("input")
    return bad_request(f"`{param}`: {msg[0].lower() + msg[1:]}, got {show(given)}", param=param, code="invalid_type")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "literal"}


def show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
