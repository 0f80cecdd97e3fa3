"""Transport name -> its module, and the two factories the roles call.

A transport `name` (one of protocol.enums.Transport) lives in workers/transfer/<name>.py, which
defines `Sender` and `Receiver`. The module is imported only when it is picked: nixl.py sets UCX's
environment on import, and a worker that never moves KV over NIXL should not.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from pdserve.protocol.enums import TRANSPORTS

if TYPE_CHECKING:
    from pdserve.settings.worker import TransferConfig
    from pdserve.workers.engine.kv_cache import KVCache
    from pdserve.workers.transfer.base import KVReceiver, KVSender


def transport(name: str) -> ModuleType:
    """The module of transport `name`, holding its Sender and Receiver."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    return importlib.import_module(f"pdserve.workers.transfer.{name}")


def make_receiver(kv: KVCache, cfg: TransferConfig) -> KVReceiver:
    return transport(cfg.transport).Receiver(kv, cfg)


def make_sender(kv: KVCache, cfg: TransferConfig) -> KVSender:
    return transport(cfg.transport).Sender(kv, cfg)
