"""The router side never imports torch: its modules, the client, `pdserve --help` and `pdserve router --help`
run in a process where importing torch or transformers raises (even looking for them: a meta-path finder
first in line), and so does `pdserve router` serving: its tokenizer is read without transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_server_harness import ROOT

pytestmark = pytest.mark.timeout(300)

# sitecustomize runs before anything else in the interpreter, so a console script is covered as well
HOOK = textwrap.dedent("""
    import sys
    import traceback

    BLOCKED = ("torch", "transformers")

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                chain = " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1]))
                raise ImportError(f"the router side imported {name}: {chain}")
            return None

    sys.meta_path.insert(0, NoTorch())
""")

ROUTER_MODULES = ("pdserve.server.app", "pdserve.server.cli", "pdserve.server.dispatch", "pdserve.server.tokenizer", "pdserve.server.timeline", "client",
                  "pdserve.client.cli", "pdserve.bench.cli")
# worker internals: the router may take nothing from them (they sit next to torch)
INTERNALS = ("pdserve.workers.engine", "pdserve.workers.roles", "pdserve.workers.transfer", "pdserve.workers.worker")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("notorch")
    (site / "sitecustomize.py").write_text(HOOK)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def pdserve() -> list[str]:
    """The console script where it is installed next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("pdserve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pdserve.server.cli"]


def test_the_hook_blocks_torch(env):
    r = run([sys.executable, "-c", "import torch"], env)
    assert r.returncode != 0 and "the router side imported torch" in r.stderr, r.stderr


def test_router_modules_import_without_torch(env):
    code = (f"import importlib, sys\n"
            f"for m in {ROUTER_MODULES!r}: importlib.import_module(m)\n"
            f"print(*sorted(m for m in sys.modules if m.startswith({INTERNALS!r})))")
    r = run([sys.executable, "-c", code], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"the router imports worker internals: {r.stdout}"


@pytest.mark.parametrize("argv", [["--help"], ["router", "--help"], ["keygen", "--help"]], ids=" ".join)
def test_help_without_torch(env, argv):
    r = run([*pdserve(), *argv], env)
    assert r.returncode == 0, r.stderr
    assert "usage: pdserve" in r.stdout


def test_help_starts_fast():
    """Printed, not asserted: the time depends on the machine and its load."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        r = subprocess.run([*pdserve(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        times.append(time.perf_counter() - start)
        assert r.returncode == 0, r.stderr
    imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "pdserve.server.cli", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120).stderr
    heavy = [line for line in imported.splitlines() if line.rsplit("|", 1)[-1].strip().startswith(
        ("torch", "transformers"))]
    print(f"\npdserve --help: {', '.join(f'{t:.2f}' for t in times)} s (best {min(times):.2f} s)")
    assert heavy == [], heavy[:5]


def test_router_tokenizer_is_transformers_own():
    """The router reads the tokenizer without transformers; transformers reads the same folder: the same ids,
    text, token strings, vocabulary and chat template, for text that exercises the byte-level BPE."""
    from transformers import AutoTokenizer

    from pdserve.settings.models import smollm2_tokenizer_dir
    from pdserve.server.tokenizer import FastTokenizer, PromptEncoder

    folder = smollm2_tokenizer_dir()
    ours, theirs = FastTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in ("Hello there", " leading space", "Ünïcödé — emoji 🎉 and 中文", "a\n\nb\tc  d", "don't stop . , ? !",
                 "<|im_start|>user\nhi<|im_end|>", ""):
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) and ours.convert_ids_to_tokens(ids) == \
            theirs.convert_ids_to_tokens(ids)
    assert len(ours) == len(theirs) == 49152 and ours.get_vocab() == theirs.get_vocab()
    chats = ([{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    for messages in chats:
        for generation in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation) == \
                theirs.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    assert PromptEncoder(ours).max_chars_per_token == PromptEncoder(theirs).max_chars_per_token


def test_pdserve_router_serves_without_torch_or_transformers(env, tmp_path):
    """`pdserve router` starts, loads SmolLM2's tokenizer and answers (503: no worker registered) where
    importing torch or transformers raises."""
    import json
    import urllib.error
    import urllib.request

    if subprocess.run([*pdserve(), "keygen", str(tmp_path / "keys")], env=env, capture_output=True).returncode:
        pytest.fail("pdserve keygen failed")
    proc = subprocess.Popen([*pdserve(), "router", "--keys", str(tmp_path / "keys" / "router"), "--model", "tiny",
                             "--port", "0", "--register", "tcp://127.0.0.1:0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "pdserve router ready:" in line:
                break
        else:
            pytest.fail("the router exited before it was ready:\n" + "".join(lines))
        url = line.split("ready: ")[1].split()[0]
        body = json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=60)
        assert e.value.code == 503 and '"code":"no_worker"' in e.value.read().decode()  # tokenized, then routed
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[0]
    assert "the router side imported" not in rest, rest


def test_tokenizer_without_torch_or_cache_says_what_to_do(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pdserve.server.tokenizer import load_tokenizer\n"
            "load_tokenizer('smollm2-135m')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PDSERVE_CACHE": str(tmp_path)})
    assert r.returncode != 0
    assert "converting the model's GGUF needs torch" in r.stderr and "--tokenizer DIR" in r.stderr, r.stderr
    assert not (tmp_path / "models").exists()
