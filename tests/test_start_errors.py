"""A newcomer's start-up mistakes answered in one line (exit code 2, what to do), never a traceback:
a CUDA device on a machine without one (`pdserve --devices cuda:0`, `pdserve-worker --device cuda:0`),
and a worker port another process holds, found before the model loads (the worker runs with torch
made unimportable: reaching the model would be an ImportError)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from test_server_harness import ROOT
from pdserve.settings.keys import keygen

pytestmark = pytest.mark.timeout(120)

NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "torch":
                raise ImportError("torch imported before the start-up checks were done")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def run(module: str, *argv: str, hook=None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    if hook is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=100)
    return out, time.monotonic() - start


def one_line(out: subprocess.CompletedProcess, *words: str) -> str:
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in text, \
        f"exit {out.returncode}, {len(lines)} lines:\n{text[-3000:]}"
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def worker_keys(tmp_path_factory):
    return str(keygen(tmp_path_factory.mktemp("keys") / "k")[1])


@pytest.fixture()
def no_torch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    return tmp_path


@pytest.fixture()
def taken():
    """A port some other process listens on, whose port below was free a moment ago (the plaintext case
    names it as --kv-port: a neighbour holding it would answer for the wrong flag)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with socket.socket() as below:
            try:
                below.bind(("127.0.0.1", port - 1))
            except OSError:
                s.close()
                continue
        s.listen()
        with s:
            yield port
        return
    pytest.fail("no port with a free one below it in 50 tries")


@pytest.mark.parametrize("flag", ["--devices", "--device"])
def test_pdserve_on_a_cuda_device_this_machine_lacks(flag):
    out, took = run("pdserve.server.cli", "--model", "tiny", "--port", "0", flag, "cuda:0")
    one_line(out, f"{flag} cuda:0", "no CUDA GPU", f"{flag} cpu")
    assert took < 30


def test_a_worker_on_a_cuda_device_this_machine_lacks(worker_keys):
    out, _ = run("pdserve.workers.cli", "--role", "colocated", "--model", "tiny", "--keys", worker_keys,
                 "--device", "cuda:0")
    one_line(out, "pdserve-worker: --device cuda:0", "no CUDA GPU", "--device cpu")
    out, _ = run("pdserve.workers.cli", "generate", "Hi", "--model", "tiny", "--device", "cuda:0")
    one_line(out, "--device cuda:0", "no CUDA GPU")


@pytest.mark.parametrize("which", ["control", "kv", "plaintext data"])
def test_a_worker_port_in_use_is_one_line_before_the_model_loads(worker_keys, no_torch, taken, which):
    args = ["--model", "tiny", "--keys", worker_keys, "--router", "tcp://127.0.0.1:9"]
    if which == "control":
        args += ["--role", "colocated", "--control", f"tcp://127.0.0.1:{taken}"]
        words = ["--control", f"127.0.0.1:{taken} is in use"]
    elif which == "kv":
        args += ["--role", "decode", "--transport", "zmq", "--kv-port", str(taken)]
        words = ["--kv-port", f"127.0.0.1:{taken} is in use"]
    else:
        args += ["--role", "decode", "--transport", "zmq", "--kv-plaintext", "--kv-port", str(taken - 1)]
        words = ["--kv-plaintext data port", f"127.0.0.1:{taken} is in use"]
    out, took = run("pdserve.workers.cli", *args, hook=no_torch)
    one_line(out, "pdserve-worker:", *words)
    assert took < 30


def test_a_control_port_taken_after_the_check_is_one_line_too(taken):
    """The check and the bind are apart (another process may take the port between them): the bind's
    failure says the same, typed, and the worker CLI prints it in one line."""
    import zmq

    from pdserve.workers.preflight import StartupError
    from pdserve.workers.worker import bind_endpoint

    ctx = zmq.Context()
    try:
        with pytest.raises(StartupError, match=f"--control: tcp://127.0.0.1:{taken} is in use"):
            bind_endpoint(ctx.socket(zmq.PULL), f"tcp://127.0.0.1:{taken}", None)
    finally:
        ctx.destroy(linger=0)
