"""The thread behind each sender and receiver: it owns the ZMQ sockets (and the NIXL agent).

ZMQ sockets and a NIXL agent without a progress thread must each be used from one thread,
and both sides have to answer the network while the engine thread is busy in a forward pass.
So each endpoint runs one I/O thread; the public methods hand it closures (`_submit`) and wait
on the returned Future with a deadline. The loop:

    wait for the sockets as long as the last `_tick()` allowed: 50 ms when idle (a message or a
    handed-in closure ends the wait at once), 200 us while a NIXL receiver's data moves (UCX over
    tcp needs the target to make progress), 50 us while something needs progress right now (GPU
    events to watch, NIXL writes in flight, notifications due)
    run the closures handed in, read the readable sockets, then `_tick()` (progress, deadlines)

Subclasses implement `_setup`, `_on_readable(sock)`, `_tick() -> seconds until the next tick`, `_teardown`.

With the deployment's keys (TransferConfig.keys) every KV channel socket is CURVE: a receiver's socket
is a server (`_secure_server`, before bind) whose Gate, answered on this thread, lets in only the
worker key; a sender's sockets are clients (`_secure_client`) that check the receiver holds it. Failed
handshakes on a server are logged throttled; a client learns them from its monitor (sender.py).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import zmq

from pdserve.protocol import auth
from pdserve.settings import keys
from pdserve.workers.transfer.errors import TransferError

log = logging.getLogger("pdserve.transfer")

IDLE_S = 0.05
MOVING_S = 200e-6
NOW_S = 50e-6


class Endpoint:
    def __init__(self, name: str, keys: keys.WorkerKeys | None = None):
        self._name = name
        self._keys = keys
        self._throttle = auth.Throttle(log)
        self._gate: auth.Gate | None = None
        self._watches: dict[zmq.Socket, auth.HandshakeWatch] = {}  # monitor socket -> its watch (servers)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._calls: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stopping = False
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    # ---- for subclasses ------------------------------------------------------------------

    def _setup(self) -> None: ...

    def _on_readable(self, sock: zmq.Socket) -> None: ...

    def _tick(self) -> float:
        """Progress and deadlines; returns how long the loop may wait before the next tick (s)."""
        return IDLE_S

    def _teardown(self) -> None: ...

    def _secure_server(self, sock: zmq.Socket) -> None:
        """I/O thread, before bind: with keys, `sock` takes only CURVE clients holding the worker key."""
        if self._keys is None:
            return
        if self._gate is None:
            self._gate = auth.Gate(self._ctx, self._keys.kv_gate(), self._name, self._throttle)
            self._poller.register(self._gate.sock, zmq.POLLIN)
        auth.serve_curve(sock, self._keys.worker)
        watch = auth.HandshakeWatch(sock, server=True)
        self._watches[watch.sock] = watch
        self._poller.register(watch.sock, zmq.POLLIN)

    def _secure_client(self, sock: zmq.Socket) -> None:
        """Before connect: with keys, `sock` talks only to a server holding the worker key."""
        if self._keys is not None:
            auth.connect_curve(sock, self._keys.worker, self._keys.worker.public)

    def _close_security(self) -> None:
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        if self._gate is not None:
            self._gate.close()
            self._gate = None

    # ---- caller side ---------------------------------------------------------------------

    def _start(self, timeout_s: float) -> None:
        ready: Future = Future()
        self._ready = ready
        self._thread.start()
        try:
            ready.result(timeout=timeout_s)
        except FutureTimeout:
            raise TransferError(f"{self._name}: start-up did not finish within {timeout_s:.1f} s") from None

    def _submit(self, fn, *args) -> Future:
        fut: Future = Future()
        if self._broken is not None or self._stopping:
            fut.set_exception(TransferError(f"{self._name} is closed or broken ({self._broken or 'closed'}); "
                                            "make a new one"))
            return fut
        self._calls.append((fut, fn, args))
        os.write(self._wake_w, b"x")
        return fut

    def _call(self, fn, *args, timeout_s: float):
        """Run fn on the I/O thread and wait for its result (re-raising its exception)."""
        try:
            return self._submit(fn, *args).result(timeout=max(timeout_s, 0.001))
        except FutureTimeout:
            raise TransferError(f"{self._name}: I/O thread did not answer within {timeout_s:.1f} s") from None

    def _stop(self, timeout_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            self._close_fds()
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("%s: I/O thread did not stop within %.1f s", self._name, timeout_s)
        else:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ---- the thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # handed to the caller of _start()
            self._broken = f"start-up failed: {e}"
            self._ready.set_exception(e)
            self._close_security()
            self._ctx.destroy(linger=0)
            return
        self._ready.set_result(None)
        wait_s = IDLE_S
        try:
            while not self._stopping:
                # below 1 ms, zmq's poll cannot wait: poll, then nap (which still answers within wait_s)
                ready = dict(self._poller.poll(int(wait_s * 1000)))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._run_calls()
                for sock in ready:
                    if sock is self._wake_r:
                        continue
                    if self._gate is not None and sock is self._gate.sock:
                        self._gate.answer()
                    elif sock in self._watches:
                        for why in self._watches[sock].failures():
                            self._throttle(why, logging.WARNING, "%s: %s", self._name, why)  # a fixed set
                    else:
                        self._on_readable(sock)
                wait_s = self._tick()
                if wait_s < 1e-3:
                    time.sleep(wait_s)
        except BaseException as e:
            log.exception("%s: I/O thread failed", self._name)
            self._broken = f"I/O thread failed: {e!r}"
        finally:
            self._fail_calls()
            try:
                self._teardown()
            finally:
                self._close_security()
                self._ctx.destroy(linger=0)

    def _run_calls(self) -> None:
        while self._calls:
            fut, fn, args = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)

    def _fail_calls(self) -> None:
        while self._calls:
            fut, _, _ = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(TransferError(f"{self._name} stopped ({self._broken or 'closed'})"))
