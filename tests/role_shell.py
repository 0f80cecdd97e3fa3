"""A worker role driven message by message in the test's own process: the Worker replaced by a
shell that holds the engine and records what the role sent (tests/test_worker_roles.py,
tests/test_prefix_cache.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pdserve.protocol import control as P
from pdserve.workers.engine.engine import Engine
from pdserve.workers.roles import make_role
from pdserve.settings.worker import TransferConfig


class Shell:
    """What a role needs from its Worker: engine, id, config, and a send() we can read back."""

    def __init__(self, role: str, engine: Engine, transfer: TransferConfig | None = None):
        self.engine, self.worker_id = engine, f"{role}-test"
        self.cfg = SimpleNamespace(transfer=transfer or TransferConfig())
        self.sent: list = []
        self.role = make_role(role, self)

    def send(self, msg) -> None:
        self.sent.append(msg)

    def take(self, cls) -> list:
        got = [m for m in self.sent if isinstance(m, cls)]
        self.sent = [m for m in self.sent if not isinstance(m, cls)]
        return got


def pump(shells, until, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < end, f"no progress within {timeout_s}s; sent: {[s.sent for s in shells]}"
        for s in shells:
            s.role.tick()
        time.sleep(0.0005)


def tokens_of(shell: Shell, rid: str) -> list[P.TokenOut]:
    return [o for m in shell.sent if isinstance(m, P.Tokens) for o in m.outputs if o.request_id == rid]
