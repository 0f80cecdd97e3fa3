"""The fence a decode worker controls itself: the death of the process behind a sender, confirmed.

    process_start(pid) -> str | None        that process's start time (what a pid names, with it)
    SenderProcess(hello.sender, host)       from a sender's Hello ("host:pid:start", sender.py): a pidfd of
                                            that very process, if it runs on this host
      .gone() -> bool                       the process exited: none of its writes can land any more
      .close()

The receiver (receiver.py) keeps one per sender it shook hands with, and frees a transfer's fenced
blocks at this fence when the sender's own Abort or Done does not come (docs/design-fencing.md).
"""

from __future__ import annotations

import os
import select

MAX_SENDERS = 1024  # sender processes remembered for the fence (the oldest forgotten: no death check)


def process_start(pid: int) -> str | None:
    """A process's start time (clock ticks after boot, /proc/<pid>/stat field 22): with its pid it names
    one process, in any pid namespace of the host; None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # from field 3 on (the name may hold spaces)
    return fields[19] if len(fields) > 19 else None


class SenderProcess:
    """The process behind a sender, as its Hello names it ("host:pid:start", sender.py); a pidfd taken at
    the handshake confirms its death without mistaking a later process that reused the pid. Only when
    this host's process of that pid started at that very tick: a sender in another pid namespace (a
    container sharing /dev/shm) names a pid that is not its own here, and gets no pidfd (then only its
    Abort or Done is a fence). The name comes over the authenticated channel: a worker of this deployment."""

    def __init__(self, name: str, host: str):
        self.pidfd: int | None = None
        peer_host, pid, start = (name.split(":") + ["", "", ""])[:3]
        if peer_host != host or not pid.isdigit() or not start or process_start(int(pid)) != start:
            return
        try:
            pidfd = os.pidfd_open(int(pid))
        except (OSError, AttributeError):  # gone already, or no pidfd here (not Linux >= 5.3)
            return
        if process_start(int(pid)) == start:  # still that process once the pidfd holds it
            self.pidfd = pidfd
        else:
            os.close(pidfd)

    def gone(self) -> bool:
        if self.pidfd is None:
            return False  # another host, or unknown: only its Abort or Done is a fence
        return bool(select.select([self.pidfd], [], [], 0)[0])  # readable once the process exited

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
