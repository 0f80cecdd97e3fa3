"""The request fields that name token ids or text to tokenize, bounded at the router with a 400 that names
the field (against fake workers, no model): `logit_bias` keys that are not ASCII-digit token ids ("²",
5000 digits) or values out of range; `allowed_token_ids` longer than the vocabulary or outside it;
`bad_words` past its length (3.9 MB of them held the event loop for seconds: /health is answered
meanwhile now). A request within the bounds is served."""

from __future__ import annotations

import threading
import time

import pytest

from test_server_router import colocated_echo, router, tokenizer  # noqa: F401  (a fixture)
from pdserve.protocol import control as P
MAX_BAD_WORDS_CHARS = 8192  # bad_words characters in all, as docs/api.md states

PROMPT = {"prompt": "Hello there", "max_tokens": 3}


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    with router(tokenizer) as c:
        c.worker = c.add_worker("colocated", "c0", colocated_echo(3))
        yield c


def refused(client, extra: dict, param: str, *words: str) -> dict:
    r = client.post("/v1/completions", json={**PROMPT, **extra})
    assert r.status_code == 400, r.text[:300]
    assert len(r.content) < 1024, "a short OpenAI-style error, not a traceback"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]
    return err


@pytest.mark.parametrize("bias, words", [
    ({"²": 1}, ['"\\u00b2"']),  # a digit to str.isdigit(), not to int()
    ({"9" * 5000: 1}, ["99999"]),  # past int()'s 4300 digits
    ({"12345678901": 1}, ["12345678901"]),  # past 10 digits
    ({"4294967295": 1}, ["4294967295"]),  # 10 digits past 2**31-1
    ({"-1": 1}, ['"-1"']),
    ({" 5": 1}, ['" 5"']),
    ({"５": 1}, ['"\\uff15"']),  # a full-width five
    ({"5": 100.5}, ["100.5", '"5"']),
    ({"5": -101}, ["-101", '"5"']),
    ({"49152": 1}, ["49152", "outside the vocabulary"]),  # the tiny model's vocabulary: 0..49151
    ({str(i): 1 for i in range(1025)}, ["1025", "at most 1024"]),
])
def test_logit_bias_keys_and_values_are_checked_naming_the_key(client, bias, words):
    refused(client, {"logit_bias": bias}, "logit_bias", *words)


def test_logit_bias_within_bounds_is_served(client):
    r = client.post("/v1/completions", json={**PROMPT, "logit_bias": {"0": -100, "49151": 100, "5": 0.5}})
    assert r.status_code == 200, r.text
    gen = [m for m in client.worker.got(P.Generate)][-1]
    assert gen.sampling.logit_bias == {0: -100.0, 49151: 100.0, 5: 0.5}


def test_allowed_token_ids_at_most_the_vocabulary(client, tokenizer):  # noqa: F811
    vocab = len(tokenizer)
    refused(client, {"allowed_token_ids": list(range(vocab)) + [0]}, "allowed_token_ids", f"{vocab + 1} ids",
            f"at most the vocabulary's {vocab}")
    refused(client, {"allowed_token_ids": [0] * 600_000}, "allowed_token_ids", "600000 ids")
    refused(client, {"allowed_token_ids": [5, vocab]}, "allowed_token_ids", "outside the vocabulary")
    r = client.post("/v1/completions", json={**PROMPT, "allowed_token_ids": list(range(vocab))})
    assert r.status_code == 200, r.text
    assert client.worker.got(P.Generate)[-1].sampling.allowed_token_ids == list(range(vocab))


def test_bad_words_are_bounded_and_tokenized_once(client, tokenizer, monkeypatch):  # noqa: F811
    refused(client, {"bad_words": ["x" * (MAX_BAD_WORDS_CHARS + 1)]}, "bad_words", f"{MAX_BAD_WORDS_CHARS + 1} "
            "characters", f"at most {MAX_BAD_WORDS_CHARS}")
    refused(client, {"bad_words": [" ".join(["Paris"] * 40)]}, "bad_words", "bad_words[0]", "at most 32")
    encoder = client.app.state.router.encoder
    calls = []
    real = encoder.text
    monkeypatch.setattr(encoder, "text", lambda text, special=True: calls.append(text) or real(text, special))
    words = [" Paris", "London", "Rome " * 6]  # " Paris" is its own spaced spelling: tokenized once
    r = client.post("/v1/completions", json={**PROMPT, "bad_words": words})
    assert r.status_code == 200, r.text
    assert sorted(c for c in calls if c != PROMPT["prompt"]) == sorted([" Paris", "London", " London",
                                                                          "Rome " * 6, " " + "Rome " * 6])
    sent = client.worker.got(P.Generate)[-1].sampling.bad_words_ids
    assert tokenizer.encode("London", add_special_tokens=False) in sent and len(sent) == 5


def test_bad_words_of_megabytes_do_not_hold_the_router(client):
    """3.9 MB of bad words (two words of 1.95 MB; the body limit allows them): refused at once, and
    /health asked meanwhile is answered without waiting for them."""
    hostile: dict = {}

    def send():
        start = time.monotonic()
        hostile["r"] = client.post("/v1/completions", json={**PROMPT, "bad_words": ["Paris " * 325_000] * 2})
        hostile["s"] = time.monotonic() - start

    t = threading.Thread(target=send)
    t.start()
    latencies = []
    while t.is_alive():
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        latencies.append(time.monotonic() - start)
    t.join()
    r = hostile["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text[:300]
    print(f"3.9 MB of bad_words: refused in {hostile['s']:.2f}s; /health meanwhile at most "
          f"{max(latencies, default=0) * 1e3:.0f} ms over {len(latencies)} requests")
    assert max(latencies, default=0) < 0.5, latencies
