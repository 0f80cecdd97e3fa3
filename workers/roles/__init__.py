"""The three worker roles; each module opens with the life cycle of a request on it. kv_report.py: what
every role's worker tells the router about its KV (block names per tier, measured costs)."""

from __future__ import annotations


def make_role(name: str, worker):
    if name == "colocated":
        from pdserve.workers.roles.colocated import ColocatedRole as cls
    elif name == "prefill":
        from pdserve.workers.roles.prefill import PrefillRole as cls
    elif name == "decode":
        from pdserve.workers.roles.decode import DecodeRole as cls
    else:
        raise ValueError(f"unknown role {name!r}; choose prefill, decode or colocated")
    return cls(worker)
