"""pdserve end to end with smollm2-135m on the CPU, every process real:

- the README's start command and every curl command of its serving section, as written;
- greedy output through the colocated and the disaggregated policy equal to transformers'
  generate(), for each transport (ipc with the README's defaults, nixl layer by layer, zmq);
- streaming: the last event carries usage and the timeline, and the timeline is causal.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch

from test_server_harness import ROOT, Pdserve  # pytest puts tests/ on sys.path (no tests/__init__.py)

pytestmark = pytest.mark.timeout(900)

# The commands a reader runs: README.md's serving section.
README = ROOT / "README.md"
README_URL = "http://127.0.0.1:8000"
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def readme_commands() -> tuple[list[str], list[str]]:
    """(the command that starts pdserve, every curl command) from the README's bash blocks."""
    text = README.read_text()
    # the serving section: its pdserve command to the end of its ## section
    curl_at = text.index("curl http://127.0.0.1:8000/v1/models")
    end = text.find("\n## ", curl_at)
    text = text[text.rindex("```bash\npdserve", 0, curl_at):end if end > 0 else None]
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S)]
    lines = [line.strip() for b in blocks for line in b.splitlines() if line.strip()]
    start = shlex.split(lines[0])
    assert start[0] == "pdserve", f"the README's first command should start pdserve, found {lines[0]!r}"
    return start, [line for line in lines if line.startswith("curl ")]


def pdserve_command(args: list[str]) -> list[str]:
    script = ROOT / ".venv" / "bin" / "pdserve"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.server.cli"]
    return exe + args


@pytest.fixture(scope="module")
def reference():
    """Greedy continuations from transformers' own generate() on the same weights."""
    from pdserve.workers.engine.models import load_model

    loaded = load_model(MODEL, "float32", "cpu")
    tok = loaded.tokenizer

    def greedy(ids: list[int], n: int = MAX_TOKENS) -> list[int]:
        with torch.no_grad():
            out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=n, do_sample=False, eos_token_id=loaded.eos_token_ids,
                                        pad_token_id=loaded.eos_token_ids[0])
        return out[0, len(ids):].tolist()

    chat_ids = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    prompt_ids = tok.encode(PROMPT)
    return {"completion": greedy(prompt_ids), "chat": greedy(chat_ids), "tokenizer": tok,
            "prompt_tokens": {"completion": len(prompt_ids), "chat": len(chat_ids)}}


@pytest.fixture(scope="module")
def readme_server():
    start, _ = readme_commands()
    with Pdserve(command=pdserve_command(start[1:] + ["--port", "0"])) as srv:
        yield srv


def generate(srv: Pdserve, kind: str, policy: str) -> dict:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "policy": policy, "return_token_ids": True}
    if kind == "chat":
        r = srv.post("/v1/chat/completions", {**body, "messages": QUESTION})
    else:
        r = srv.post("/v1/completions", {**body, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    return r.json()


def check_against_reference(out: dict, kind: str, policy: str, reference: dict) -> None:
    choice = out["choices"][0]
    want = reference[kind]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert choice["token_ids"] == want, (
        f"{kind}/{policy}: tokens differ from transformers generate()\n"
        f"  pdserve:      {text!r}\n  transformers: {reference['tokenizer'].decode(want, skip_special_tokens=True)!r}")
    assert text == reference["tokenizer"].decode(want, skip_special_tokens=True)
    t = out["timings"]
    assert t["policy"] == policy and t["prompt_tokens"] == reference["prompt_tokens"][kind]
    assert out["usage"]["completion_tokens"] == len(want) == t["completion_tokens"]


# ---- the README, as written ---------------------------------------------------------------------


def test_readme_curl_commands(readme_server):
    _, curls = readme_commands()
    assert len(curls) >= 6
    for cmd in curls:
        cmd = cmd.replace(README_URL, readme_server.url)
        run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{cmd}\nexit {run.returncode}: {run.stderr}"
        out = run.stdout.strip()
        assert out, f"{cmd}: no output"
        if out.startswith("data:"):
            events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
            assert last["timings"]["completion_tokens"] == last["usage"]["completion_tokens"] > 0
        elif out.startswith("{"):
            body = json.loads(out)
            assert "error" not in body, f"{cmd}: {body}"
            if "/v1/models" in cmd:
                assert body["data"][0]["id"] == MODEL
            elif "/health" in cmd:
                assert body["status"] == "ok" and {w["role"] for w in body["workers"]} == {"prefill", "decode",
                                                                                          "colocated"}
            else:
                assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["timings"]["ttft_ms"] > 0
                if '"policy": "disaggregated"' in cmd:
                    assert body["timings"]["policy"] == "disaggregated"
        else:  # the metrics lines: one count per policy
            counts = [line.split() for line in out.splitlines()]
            assert all(name.startswith("pdserve_ttft_seconds_count{policy=") for name, _ in counts)
            assert sum(float(v) for _, v in counts) >= 3  # the three completions above


# ---- equal to transformers, every transport and policy -----------------------------------------------


@pytest.mark.parametrize("policy", ["colocated", "disaggregated"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_ipc_matches_transformers(readme_server, reference, kind, policy):
    out = generate(readme_server, kind, policy)
    check_against_reference(out, kind, policy, reference)
    if policy == "disaggregated":
        t = out["timings"]
        assert (t["transport"], t["mode"], t["prefill_worker"], t["decode_worker"]) == ("ipc", "bulk", "prefill-0",
                                                                                      "decode-0")
        assert t["kv_bytes"] > 0 and t["transfer_ms"] >= 0


@pytest.mark.parametrize("transport,mode", [("nixl", "layer"), ("zmq", "bulk")])
def test_other_transports_match_transformers(reference, transport, mode):
    with Pdserve("--model", MODEL, "--no-colocated", "--transport", transport, "--mode", mode,
                 "--kv-memory-gb", "0.25", "--threads", "1") as srv:
        for kind in ("completion", "chat"):
            out = generate(srv, kind, "disaggregated")
            check_against_reference(out, kind, "disaggregated", reference)
            t = out["timings"]
            assert (t["transport"], t["mode"]) == (transport, mode) and t["kv_bytes"] > 0
        # auto with no colocated worker: served disaggregated, same output
        check_against_reference(generate(srv, "completion", "auto"), "completion", "disaggregated", reference)


# ---- streaming and the timeline ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["colocated", "disaggregated"])
def test_streaming_last_event_carries_a_causal_timeline(readme_server, reference, policy):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "policy": policy, "stream": True,
            "return_token_ids": True}
    events = list(readme_server.stream("/v1/completions", body))
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == reference["completion"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["tokenizer"].decode(ids,
                                                                                           skip_special_tokens=True)
    assert all(c["choices"][0]["finish_reason"] is None and "timings" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    details = last["usage"].pop("prompt_tokens_details")  # the prefix cache's share: earlier tests sent it too
    assert last["usage"] == {"prompt_tokens": reference["prompt_tokens"]["completion"],
                             "completion_tokens": MAX_TOKENS,
                             "total_tokens": reference["prompt_tokens"]["completion"] + MAX_TOKENS}
    t = last["timings"]
    assert details == {"cached_tokens": t["cached_tokens"]}
    assert t["cached_tokens"] + t["recomputed_tokens"] == t["prompt_tokens"]
    assert t["policy"] == policy
    exposed = t["transfer_exposed_ms"] or 0.0
    if policy == "disaggregated":
        assert t["transfer_exposed_ms"] is not None and t["transfer_ms"] is not None
    else:
        assert t["transfer_exposed_ms"] is None and t["kv_bytes"] == 0
    # Every stretch was measured on one clock and they follow each other: queue, prefill and the
    # exposed part of the transfer happen before the router has token 1.
    assert t["queue_ms"] + t["prefill_ms"] + exposed <= t["ttft_ms"] + 1e-3
    # The first decode step makes token 2, so it also ends before the client reads token 2
    # (each event carries one token; the client's clock starts before the router's).
    second_token_s = events[1][0]
    assert t["queue_ms"] + t["prefill_ms"] + exposed + t["first_decode_step_ms"] <= second_token_s * 1e3 + 1e-3
    assert t["ttft_ms"] <= t["e2e_ms"] and t["ttft_ms"] <= events[0][0] * 1e3 + 1e-3
    assert t["decode_tokens_per_s"] > 0
