"""Schema-driven fuzzing of the HTTP API: bodies drawn from /openapi.json's own request schemas (a small
JSON-schema-to-hypothesis converter for the keywords pydantic emits), and arbitrary JSON objects beside them, against the router with a fake worker. Whatever arrives, the answer
is a well-formed success or an OpenAI error object with a 4xx, never a 5xx (503 "no worker" aside: the
fake serves only colocated) and never a crash; a bounded number of examples, so it stays fast."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_router import colocated_echo, router, tokenizer  # noqa: F401  (a fixture)

EXAMPLES = 100
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    with router(tokenizer) as c:
        c.add_worker("colocated", "c0", colocated_echo(2))
        yield c


@pytest.fixture(scope="module")
def doc(client) -> dict:
    return client.get("/openapi.json").json()


def _bodies(doc: dict) -> dict[str, dict]:
    """path -> its request body's schema."""
    return {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path, ops in doc["paths"].items() if ops.get("post", {}).get("requestBody")}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=12)
SCALARS = {"string": st.text(max_size=40), "integer": st.integers(-2, 2**64) | st.integers(-3, 300),
           "number": st.floats(allow_nan=False, allow_infinity=False) | st.floats(-1, 3), "boolean": st.booleans(),
           "null": st.none()}


# values that pass validation, drawn beside the schema's own (which is laxer: `prompt` is any JSON, `policy`
# any string), so the examples reach the success paths too, not only the refusals
HINTS = {"model": st.just("tiny"), "policy": st.sampled_from(["colocated", "auto"]), "max_tokens": st.integers(1, 4),
         "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 100), min_size=1, max_size=5),
         "content": st.text(min_size=1, max_size=30), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
         "tokens": st.lists(st.integers(0, 100), max_size=5)}


def strategy(schema: dict, components: dict):
    """Values that `schema` accepts: $ref, anyOf, enum, type (objects with properties, required and
    additionalProperties, arrays with items); the empty schema is any JSON."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        return st.deferred(lambda: strategy(components[name], components))
    if "anyOf" in schema:
        return st.one_of(*(strategy(s, components) for s in schema["anyOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: HINTS[k] | strategy(v, components) if k in HINTS else strategy(v, components)
                  for k, v in props.items()}
        optional = st.fixed_dictionaries({}, optional={k: v for k, v in fields.items() if k not in required})
        return st.tuples(st.fixed_dictionaries({k: fields[k] for k in required}), optional).map(
            lambda parts: {**parts[0], **parts[1]})
    if kind == "array":
        return st.lists(strategy(schema.get("items", {}), components), max_size=5)
    if kind in SCALARS:
        return SCALARS[kind]
    assert not kind, f"a schema keyword the converter does not know: {schema}"
    return JSON


def _check(path: str, r) -> None:
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(isinstance(json.loads(e), dict) for e in events[:-1]), r.text
        else:
            assert isinstance(r.json(), dict) and "error" not in r.json(), r.text
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    assert r.status_code < 500 or (r.status_code == 503 and err["code"] == "no_worker"), (path, r.text)


PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def test_every_post_route_has_a_body_schema(doc):
    assert sorted(_bodies(doc)) == sorted(PATHS)


@pytest.mark.parametrize("path", PATHS)
def test_bodies_drawn_from_the_schema_get_no_5xx(client, doc, path):
    @SETTINGS
    @given(strategy(_bodies(doc)[path], doc["components"]["schemas"]))
    def run(body):
        _check(path, client.post(path, json=body))

    run()


KEYS = st.sampled_from(["prompt", "messages", "max_tokens", "stream", "stream_options", "tools", "n", "policy",
                        "tokens", "logprobs", "stop", "seed", "temperature", "model"]) | st.text(max_size=12)


@pytest.mark.parametrize("path", PATHS)
def test_arbitrary_json_objects_get_no_5xx(client, path):
    @SETTINGS
    @given(st.dictionaries(KEYS, JSON, max_size=6))
    def run(body):
        _check(path, client.post(path, json=body))

    run()
