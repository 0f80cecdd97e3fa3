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


@pytest.fixture(autouse=True)
def _disk_tiers_closed():
    """A disk tier runs a writer thread and a pool of MAC threads until it is closed; tests that make one and
    drop it left them idle for the rest of their process (~35 threads after the tier tests). Every DiskTier a
    test makes is closed after the test (close() may be called twice)."""
    import sys

    disk = sys.modules.get("pdserve.workers.engine.kv_tiers.disk")
    if disk is None:  # nothing imported it: this test makes none at module level
        yield
        return
    made = []
    init = disk.DiskTier.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    disk.DiskTier.__init__ = recording
    try:
        yield
    finally:
        disk.DiskTier.__init__ = init
        for tier in made:
            tier.close()


# --- `alone`: a test whose bound compares timings runs with no other test beside it -------------------------------
# The suite runs in two processes (pytest-xdist, `-n 2`). A test that measures a latency against its own baseline
# (a well-behaved client beside hostile ones, a decode worker beside a killed one) reads a neighbouring test's
# burst of CPU as harm. Such a test is marked `alone` (a module: `pytestmark = pytest.mark.alone`): it waits for
# the test running in the other process to end, and none starts there until it ends. Across the processes this is
# a readers-writer lock on a file: every test holds it shared, an `alone` test exclusive; a second file, taken
# briefly by a test about to start and held by an `alone` one while it waits, keeps a stream of ordinary tests
# from starving it. Without xdist it does nothing.
import contextlib  # noqa: E402
import fcntl  # noqa: E402
from pathlib import Path  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: under `-n 2`, no other test runs beside this one (its bound is a timing)")


def _lock_dir(config) -> Path | None:
    """The folder the xdist processes of one run share (none without xdist)."""
    if not hasattr(config, "workerinput"):
        return None
    # each process's base temp is <this run's folder>/popen-gwN: their parent is the run's, and pytest's own
    # temp-folder rotation removes it with the run's other folders
    d = config._tmp_path_factory.getbasetemp().parent / "alone-locks"
    d.mkdir(exist_ok=True)
    return d


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    d = _lock_dir(item.config)
    if d is None:
        yield
        return
    gate, tests = d / "gate", d / "tests"
    if item.get_closest_marker("alone") is not None:
        with _flock(gate, fcntl.LOCK_EX), _flock(tests, fcntl.LOCK_EX):
            yield
    else:
        with contextlib.ExitStack() as held:
            with _flock(gate, fcntl.LOCK_EX):
                held.enter_context(_flock(tests, fcntl.LOCK_SH))
            yield
