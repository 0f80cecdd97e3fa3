"""`pdserve-worker generate`: local generation from the command line, no router."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from test_server_harness import ROOT

pytestmark = pytest.mark.timeout(300)


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.workers.cli", "generate", *args, "--threads", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_generate_prints_the_greedy_text():
    from pdserve.workers.engine.models import load_model

    loaded = load_model("tiny", "float32", "cpu")
    ids = loaded.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=6, do_sample=False, eos_token_id=loaded.eos_token_ids,
                                    pad_token_id=loaded.eos_token_ids[0])
    want = loaded.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    run = generate("The capital of France is", "--model", "tiny", "--max-tokens", "6")
    assert run.returncode == 0, run.stderr
    assert run.stdout == want + "\n"


def test_generate_says_what_is_wrong():
    run = generate("", "--model", "tiny")
    assert run.returncode == 2 and "the prompt is empty" in run.stderr
    run = generate("Hi", "--model", "tiny", "--max-tokens", "0")
    assert run.returncode == 2 and "`max_tokens` must be an integer in [1, " in run.stderr
