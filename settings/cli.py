"""Command-line conventions shared by `pdserve` and `pdserve-worker` (both torch-free to here):
--help that shows defaults, --config YAML files, one log format, the version line, exiting fast,
and following a parent process's death.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading

from pdserve.protocol.wire import PROTOCOL_VERSION

PR_SET_PDEATHSIG = 1
# the signal a worker gets when pdserve dies: not SIGTERM, which pdserve itself sends to stop it. The
# kernel sends it as the parent's thread that started the worker exits, and while the parent's other
# threads still exit getppid() names the parent: a SIGTERM then could not tell the two apart
PARENT_DIED = signal.SIGUSR2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # pdserve's, its workers' and uvicorn's lines


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default, except where there is none to show (None, an empty list,
    an on/off flag) or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.nargs == 0 or action.default is None or action.default == [] or not action.option_strings
                or "default:" in text or "%(default)" in text or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="a YAML file whose keys are this command's flags "
                   "(`max-num-seqs: 32`, `no-colocated: true`, `worker-arg: [--handshake-timeout, 10]`); flags on "
                   "the command line win")


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argv, after the flags of --config FILE if it is given (so the command line overrides them)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return p.parse_args(argv)
    return p.parse_args(config_flags(p, known.config) + list(argv))


def config_flags(p: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a --config file stands for, checked against `p`'s own (an unknown key is an error)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        p.error(f"cannot read --config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        p.error(f"--config {path} is not YAML: {e}")
    if data is None:
        return []
    if not isinstance(data, dict):
        p.error(f"--config {path} must be a mapping of flag names to values, got a {type(data).__name__}")
    actions = p._option_string_actions  # argparse's table of long flags (no public accessor)
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help", "--version"):
            p.error(f"--config {path}: {key!r} is not a flag of {p.prog} (see {p.prog} --help)")
        if action.nargs == 0:  # an on/off flag: true sets it, false leaves it off
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key!r} is an on/off flag; give true or false, not {value!r}")
            out += [flag] if value else []
        else:  # --flag=value: a value that starts with "-" (a --worker-arg) stays a value
            out += [f"{flag}={item}" for item in (value if isinstance(value, list) else [value])]
    return out


def version() -> str:
    """pdserve's version (one for the router and the workers) and the control protocol it speaks."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        v = installed("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never pip-installed
        v = "unknown (not installed)"
    return f"{v} (control protocol {PROTOCOL_VERSION})"


def die_with_parent(parent_pid: int, on_parent_death, signum: int = signal.SIGTERM) -> None:
    """Get `signum` when the parent dies (Linux), and watch it from a thread as well (any OS, and the
    case where the parent died before prctl ran)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            logging.getLogger("pdserve.worker").warning("prctl(PR_SET_PDEATHSIG) failed: errno %d",
                                                        ctypes.get_errno())
    if os.getppid() != parent_pid:
        sys.exit(f"pdserve-worker: parent process {parent_pid} is already gone; exiting")

    def watch():
        while os.getppid() == parent_pid:
            threading.Event().wait(0.25)
        on_parent_death()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_now(rc: int) -> None:
    """Exit without the interpreter's teardown (about a second with torch and a model loaded): every
    resource the process owns (sockets, transports, the KV pool and its /dev/shm file) is closed by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
