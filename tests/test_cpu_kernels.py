"""The numerics-sensitive tests once more under other CPU kernels, so a machine difference shows up
in CI and not on a user's machine.

PyTorch picks its CPU kernels by the instructions it finds (AVX-512 and AMX here, AVX2 on many
machines, plain vectorised code elsewhere); ATEN_CPU_CAPABILITY forces a lower choice. Tests that
compare two code paths bitwise do so only where both run the same kernels on the same operands, and
the others use a tolerance justified where they are defined; if either is wrong, the run under the
next capability down says so on this machine. That run is one pytest subprocess over the tests below
(the ones whose verdict depends on float arithmetic), bounded in time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# SmolLM2 only where both models run (tiny's logits stay bitwise equal under every capability measured);
# the engine against transformers through the logprobs test (test_batched_greedy_equals_transformers_generate
# holds the same oracle at 1e-4 but costs twice as much); ~25 s a capability on this 2-core machine, idle
NUMERICS = [
    "tests/test_engine.py::test_prefill_only_then_adopt_is_bitwise_identical[smollm2-135m]",
    "tests/test_engine.py::test_prefill_only_over_a_cached_prefix_then_adopt_matches_within_float32_rounding"
    "[smollm2-135m]",
    "tests/test_logprobs.py::test_prompt_and_token_logprobs_match_transformers[smollm2-135m-chunk7]",
    "tests/test_logprobs.py::test_disaggregated_logprobs_equal_colocated[echo]",
]
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
# avx2 names an x86 kernel set; elsewhere only `default` (the portable kernels) is a lower choice
CAPABILITIES = ["avx2", "default"] if X86 else ["default"]
LADDER = ["avx512", "avx2", "default"]  # x86, from the widest kernels down
RUN_TIMEOUT_S = 420


def with_capability(capability: str | None) -> dict[str, str]:
    """The environment with ATEN_CPU_CAPABILITY set to `capability` (None: unset, the machine's own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "PYTEST_ADDOPTS")}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


def chosen_capability(capability: str | None) -> str:
    """The kernels torch picks under that environment, lower-case."""
    run = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=with_capability(capability), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().lower()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_numerics_sensitive_tests_pass_under_other_cpu_kernels():
    """The next capability down from the machine's own (whose run is the suite itself): an AVX-512 or
    AMX machine reruns these tests under avx2, an AVX2 machine under default, so the kernels of every
    kind of machine are checked on the kind just above it."""
    native = chosen_capability(None)
    below = LADDER[LADDER.index(native) + 1:] if native in LADDER else LADDER
    lower = [c for c in CAPABILITIES if c in below]
    if not lower:
        pytest.skip(f"this CPU's kernels ({native}) are the plainest there are: no lower choice to run under")
    capability = lower[0]
    assert chosen_capability(capability) == capability
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *NUMERICS],
                         env=with_capability(capability), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         cwd=ROOT)
    assert run.returncode == 0, f"under ATEN_CPU_CAPABILITY={capability}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " failed" not in run.stdout
