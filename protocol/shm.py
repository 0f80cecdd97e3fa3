"""The /dev/shm files that hold KV pools on the CPU (the `ipc` transport maps a decode worker's pool
into its prefill peer), named /dev/shm/pdserve-kv-<creator pid>-<8 hex>. Here, torch-free, because
three sides handle them: the worker that makes one, the peer that checks a name it is handed, and
the supervisor (the router's process) that removes a dead worker's.

    POOL_NAME                      the names pdserve gives its pools, and nothing else
    create_pool(nbytes) -> path    a new pool file of this process: O_EXCL, no links, 0600 (its bytes
                                   are prompts in another form), sized
    remove_pools(pid=None)         unlink the pools of `pid` (None: of every process that is gone);
                                   never raises

/dev/shm is shared by every user of the machine: anyone may create a name there, so a sweep touches
only regular files of this user whose name parses, and an entry it cannot handle is logged and left.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import uuid

log = logging.getLogger("pdserve.shm")

SHM_DIR = "/dev/shm"
SHM_PREFIX = f"{SHM_DIR}/pdserve-kv-"  # + creator pid + "-" + 8 hex digits
POOL_NAME = re.compile(re.escape(SHM_PREFIX) + r"([0-9]{1,10})-[0-9a-f]{8}")
PID_MAX = 2**22  # Linux's largest pid_max: a larger number in a name is no process of ours


def create_pool(nbytes: int) -> str:
    """A new, zero-filled pool file of `nbytes` for this process, readable and writable by this user only."""
    path = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def remove_pools(pid: int | None = None) -> list[str]:
    """Unlink the pool files of `pid`, or (None) of every process that no longer exists; only regular
    files owned by this user, named as create_pool names them. The paths removed; never raises."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError as e:
        log.warning("cannot list %s to remove KV pools: %s", SHM_DIR, e)
        return removed
    for name in names:
        path = f"{SHM_DIR}/{name}"
        m = POOL_NAME.fullmatch(path)
        if m is None:
            continue
        owner = int(m.group(1))
        if owner > PID_MAX or (owner != pid if pid is not None else _alive(owner)):
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue  # someone else's, or not a pool: never ours to remove
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("cannot remove KV pool %s: %s", path, e)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process, or no valid pid
        return True
    return True
