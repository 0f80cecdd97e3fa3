"""The API's documents, both from the request models themselves (server/requests.py):

    docs_page(title, version, bodies)   GET /docs: the API on one self-contained HTML page (no script,
                                        nothing fetched from elsewhere, so it works offline and behind a
                                        strict proxy): the endpoints, each request body's fields from the
                                        same schemas /openapi.json serves, and the table of OpenAI's and
                                        vLLM's fields (server/fields.py)
    openapi_body(model)                 a route's request body for /openapi.json, and its schemas
"""

from __future__ import annotations

import html
import json

from pydantic import BaseModel

from pdserve.server.fields import FIELDS

ENDPOINTS = (
    ("POST", "/v1/completions", "prompt -> text (stream: server-sent events)"),
    ("POST", "/v1/chat/completions", "messages -> the assistant's message"),
    ("GET", "/v1/models", "the model served (and /v1/models/{id})"),
    ("POST", "/tokenize", "a prompt or chat messages -> token ids"),
    ("POST", "/detokenize", "token ids -> text"),
    ("GET", "/health", "200 while some policy can be served; the workers"),
    ("GET", "/metrics", "Prometheus (vLLM's names and pdserve's)"),
    ("GET", "/version", "pdserve's version"),
    ("GET", "/openapi.json", "this API as OpenAPI, every request body field by field"),
)


def docs_page(title: str, version: str, bodies: dict[str, type[BaseModel]]) -> str:
    """bodies: path -> its request model."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)} API</title>",
             "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}td,th{border:1px solid #ccc;"
             "padding:.2em .5em;vertical-align:top}table{border-collapse:collapse}code{font-size:95%}</style>",
             f"</head><body><h1>{e(title)} {e(version)}</h1><h2>Endpoints</h2><table>"]
    parts += [f"<tr><td>{m}</td><td><code>{e(p)}</code></td><td>{e(w)}</td></tr>" for m, p, w in ENDPOINTS]
    parts.append("</table>")
    for path, model in bodies.items():
        parts.append(f"<h2>POST <code>{e(path)}</code>: <code>{model.__name__}</code></h2><table>"
                     "<tr><th>field</th><th>type</th><th>default</th><th>what</th></tr>")
        for name, info in model.model_fields.items():
            default = "required" if info.is_required() else json.dumps(info.default, default=str)
            kind = getattr(info.annotation, "__name__", None) or str(info.annotation).replace("typing.", "")
            parts.append(f"<tr><td><code>{e(name)}</code></td><td>{e(kind)}</td><td>{e(default)}</td>"
                         f"<td>{e(info.description or '')}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>OpenAI's and vLLM's fields, and what pdserve does with each</h2><table><tr><th>field</th>"
                 "<th>endpoint</th><th>from</th><th>class</th><th>neutral value</th><th>what</th></tr>")
    for f in FIELDS:
        neutral = ", ".join(json.dumps(v) for v in f.neutral)
        parts.append(f"<tr><td><code>{e(f.name)}</code></td><td>{e(', '.join(f.endpoints))}</td><td>{f.origin}</td>"
                     f"<td>{f.kind}</td><td><code>{e(neutral)}</code></td><td>{e(f.note or f.why)}</td></tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)


def openapi_body(model_cls: type[BaseModel]) -> tuple[dict, dict]:
    """The route's `openapi_extra` documenting `model_cls` as its JSON body (handlers read the body
    themselves, through parse_body's limits), and the schemas it refers to, for components."""
    schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    ref = {"$ref": f"#/components/schemas/{model_cls.__name__}"}
    body = {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
    return body, {model_cls.__name__: schema, **defs}
