"""The disk tier's files, kept private and checked (workers/engine/kv_tiers/disk.py writes and reads them).

KV bytes are the prompt in another form, and a file that is not what it says can wedge a reader or
feed it forged entries, so:
    private_dir(path)        the folder: made 0700; refused if a link, another user's or writable by others
    open_regular(path)       an fd only on a regular file of this user with one link (no links followed;
                             a FIFO or device is refused without blocking on its open)
    is_own_regular(path)     the same test without opening (sweeps touch nothing else)
    folder_key(path)         the folder's own MAC key (0600), kept across restarts: when no deployment
                             key is given, or the deployment's keys are new at each start (`pdserve`)
    mac(key, hash, data)     an entry's keyed MAC (HMAC-SHA256 over its hash and bytes), hex
    run_with_deadline(jobs, threads, timeout_s) -> late   reads that may hang, on daemon threads, waited
                             on for timeout_s at most; what a late job delivers afterwards is dropped
    align(n), write_all(fd, buf), read_all(fd, buf, offset) -> n   page-aligned sizes, whole writes and reads
    read_gbps(folder, nbytes) -> GB/s   a file written, synced, dropped from the page cache and read back
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger("pdserve.kv_tiers")

KEY_FILE = "kv.key"  # without a deployment key: the folder's own (0600), made once
TMP_MARK = ".tmp-"  # a temporary file of ours is .NAME[.RANDOM].tmp-PID (an entry or the key, before its link)
PUBLISH_WAIT_S = 2.0  # how long a worker waits for another to finish publishing the key (folder_key)
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # no links; a FIFO opens without waiting, then is refused
MAC = "sha256"  # HMAC; OpenSSL's SHA-256 runs at about 1 GiB/s a core and lets go of the GIL
MAC_BYTES = 32
ALIGN = 4096  # a file's payload starts on a page boundary


class DiskTierError(ValueError):
    """The folder cannot be used safely (another user's, writable by others, not a folder)."""


def mac(key: bytes, h: bytes, data) -> str:
    mac = hmac.new(key, h, MAC)  # the hash inside: bytes swapped between entries fail too
    mac.update(data)
    return mac.hexdigest()


def private_dir(directory: Path) -> Path:
    """Make (0700) or check the folder: a directory (not a link), owned by this user, writable by no
    one else; readable by others it is made 0700. Raises DiskTierError otherwise."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise DiskTierError(f"disk tier {directory}: not a folder pdserve can use ({e.strerror}); "
                            f"give a private directory (--disk-cache-dir)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise DiskTierError(f"disk tier {directory} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); "
                                f"KV entries are prompts in another form: give a folder of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise DiskTierError(f"disk tier {directory} is writable by others (mode {st.st_mode & 0o777:o}); "
                                f"chmod 700 it or give a private folder")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
            log.warning("disk tier %s was readable by others (mode %o); made it 0700", directory, st.st_mode & 0o777)
    finally:
        os.close(fd)
    return directory


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """An fd on `path` if it is a regular file of this user with one link; OSError otherwise (a link,
    a FIFO, a device, another user's file are never read)."""
    fd = os.open(path, flags | OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise OSError(f"{path.name} is not a regular file of this user with one link")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def folder_key(directory: Path) -> bytes:
    """The folder's own MAC key (32 random bytes, 0600), made on first use and kept: entries written
    before a restart are served after it. Published whole (written under a temporary name, then linked
    to KEY_FILE), so workers that start together over one folder agree on it. Between the link and the
    temporary name's removal the key has two links, which open_regular refuses: a worker that meets it
    then waits while a temporary name is still there (PUBLISH_WAIT_S), and reads the key once it is gone."""
    path = directory / KEY_FILE
    if not os.path.lexists(path):
        tmp = directory / f".{KEY_FILE}.{uuid.uuid4().hex[:8]}{TMP_MARK}{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, memoryview(os.urandom(32)))
            os.fsync(fd)  # a crash must not leave a short key that refuses every entry
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another worker published first: its key is the folder's
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    fd = _open_published(directory, path)
    try:
        if os.fstat(fd).st_mode & 0o077:
            raise DiskTierError(f"disk tier key {path} is readable by others; remove it (the entries it "
                                f"signed will be refused) or chmod 600 it")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise DiskTierError(f"disk tier key {path} is not 32 bytes; remove it (the entries it signed are refused)")
    return key


def _open_published(directory: Path, path: Path) -> int:
    """open_regular(path), waiting up to PUBLISH_WAIT_S while another worker is between linking the key and
    removing its temporary name (a link of the key's under that name is what makes it two)."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while True:
        try:
            return open_regular(path)
        except OSError:
            publishing = any(directory.glob(f".{KEY_FILE}.*{TMP_MARK}*"))
            if not publishing or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def is_own_regular(path: Path) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def run_with_deadline(jobs: list, threads: int, timeout_s: float) -> set[int]:
    """Run job(guard) for each job on up to `threads` daemon threads (a hung read must not keep the
    process from exiting); wait at most timeout_s. A job hands each result to guard(fn, *args), which
    runs fn(*args) under a lock unless the deadline has passed (then it returns False and the job
    should stop). The indices of the jobs not finished at the deadline."""
    state = {"open": True, "next": 0}
    lock = threading.Lock()
    finished = threading.Semaphore(0)
    done: set[int] = set()

    def guard(fn, *args) -> bool:
        with lock:
            if state["open"]:
                fn(*args)
            return state["open"]

    def work() -> None:
        try:
            while True:
                with lock:
                    j = state["next"]
                    if j >= len(jobs) or not state["open"]:
                        return
                    state["next"] = j + 1
                jobs[j](guard)
                with lock:
                    done.add(j)
        finally:
            finished.release()

    pool = [threading.Thread(target=work, name="pdserve-kv-disk-read", daemon=True)
            for _ in range(min(threads, len(jobs)))]
    for t in pool:
        t.start()
    end = time.monotonic() + timeout_s
    for _ in pool:
        if not finished.acquire(timeout=max(0.0, end - time.monotonic())):
            break
    with lock:
        state["open"] = False
        return set(range(len(jobs))) - done


def align(n: int) -> int:
    """n rounded up to a page (a file's payload starts on a page boundary)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_all(fd: int, buf: memoryview) -> None:
    """All of buf at the fd's position (os.write may write less)."""
    buf = buf.cast("B")
    while buf:
        buf = buf[os.write(fd, buf):]


def read_all(fd: int, buf: memoryview, offset: int) -> int:
    """Fill buf from offset on; returns the bytes read (fewer: the file ended)."""
    buf, got = buf.cast("B"), 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def read_gbps(directory: Path, nbytes: int = 16 << 20) -> float:
    """Read bandwidth of a file written, synced and dropped from the page cache (GB/s)."""
    path = directory / f".probe-{uuid.uuid4().hex[:8]}.tmp-{os.getpid()}"
    data = os.urandom(nbytes)
    buf = bytearray(nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_all(fd, memoryview(data))
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            read_all(fd, memoryview(buf), 0)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return nbytes / max(seconds, 1e-9) / 1e9
