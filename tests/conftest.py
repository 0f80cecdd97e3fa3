"""Set before any test module imports torch or triton: Triton kernels in the suite run on the
CPU through Triton's interpreter (the suite is CPU-only; GPU checks are in bench/). Triton
reads this when it is first imported, which another test module's imports may do first."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pdserve(tmp_path_factory):
    """One tiny pdserve (router + prefill, decode and colocated workers) for the live tests that only
    send requests and compare answers, so they do not each pay for a start. Its workers trace their
    steps into `step_trace` (test_step_trace.py reads them)."""
    from test_server_harness import TINY, Pdserve

    trace = tmp_path_factory.mktemp("steps")
    with Pdserve(*TINY, "--step-trace", str(trace)) as s:
        s.step_trace = trace
        yield s
