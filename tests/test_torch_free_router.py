"""The router side never imports torch: its modules, the client, `pdserve --help` and `pdserve router --help`
run in a process where importing torch or transformers raises (even looking for them: a meta-path finder
first in line). The router loads its tokenizer through transformers only when it serves, never for --help."""

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

ROUTER_MODULES = ("server.app", "server.cli", "server.dispatch", "server.tokenizer", "server.timeline", "client",
                  "client.cli", "bench.cli")
# worker internals: the router may take nothing from them (they sit next to torch)
INTERNALS = ("workers.engine", "workers.roles", "workers.transfer", "workers.worker")


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
    return [str(script)] if script.is_file() else [sys.executable, "-m", "server.cli"]


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
    imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "server.cli", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120).stderr
    heavy = [line for line in imported.splitlines() if line.rsplit("|", 1)[-1].strip().startswith(
        ("torch", "transformers"))]
    print(f"\npdserve --help: {', '.join(f'{t:.2f}' for t in times)} s (best {min(times):.2f} s)")
    assert heavy == [], heavy[:5]


def test_tokenizer_where_torch_is_not_installed():
    """At run time the router loads SmolLM2's tokenizer with transformers, which imports torch where it is
    installed (transformers/utils/generic.py) but works without it: a router machine needs no torch once the
    converted cache is there (converting it loads the model, so that step does)."""
    from protocol.models import cache_is_current, smollm2_cache_dir

    if not cache_is_current(smollm2_cache_dir()):
        pytest.skip("SmolLM2's converted cache is not there yet (the first worker start writes it)")
    code = ("import sys; sys.modules['torch'] = None  # as if not installed: find_spec says None, import raises\n"
            "from server.tokenizer import PromptEncoder, load_tokenizer\n"
            "enc = PromptEncoder(load_tokenizer('tiny'))\n"
            "print(enc.vocab_size, enc.chat([{'role': 'user', 'content': 'Hi'}])[-3:])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "49152", r.stdout


def test_tokenizer_without_torch_or_cache_says_what_to_do(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from server.tokenizer import load_tokenizer\n"
            "load_tokenizer('smollm2-135m')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PDSERVE_CACHE": str(tmp_path)})
    assert r.returncode != 0
    assert "converting the model's GGUF needs torch" in r.stderr and "--tokenizer DIR" in r.stderr, r.stderr
    assert not (tmp_path / "models").exists()
