"""SIGTERM / SIGINT / SIGHUP: leave the inference servers serving, then exit with the signal's conventional code.

`exit_on_signal(on_signal)` installs handlers (main thread only) that call `on_signal` (the trainer's `halt`: resume
every server this process paused), then raise SystemExit(128 + signal number): 143 for SIGTERM, 130 for SIGINT, 129
for SIGHUP. The SystemExit runs every `finally` on its way out, which stops the servers and launches we started.
A watcher thread woken through `signal.set_wakeup_fd` also calls `on_signal` at once, for a main thread blocked in a
C call, so `on_signal` must be safe to call twice, from two threads. `train` defers the first SIGTERM for a grace
period, to stop at a step boundary with a checkpoint (`defer`, `grace_s`). Why: docs/faults.md.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # schedulers, Ctrl-C, a closed terminal or SSH session


def exit_code(signum: int) -> int:
    """The conventional exit status of a process ended by signal `signum` (128 + its number)."""
    return 128 + int(signum)


class _Deferral:
    """SIGTERM, when deferred: the first calls `defer` (the loop is asked to stop at its next step boundary) and starts
    the grace; every SIGTERM within it is ignored (a launcher passes the scheduler's SIGTERM on to its ranks, a second
    time). When the grace ends, SIGTERM is raised again in the main thread (`_thread.interrupt_main`) and handled as
    any other signal. SIGINT and SIGHUP are never deferred."""

    def __init__(self, defer: Callable[[], None] | None, grace_s: float):
        self.defer, self.grace_s = defer, grace_s
        self.expired = False
        self._timer: threading.Timer | None = None

    def deferred(self, signum: int) -> bool:
        return self.defer is not None and self.grace_s > 0 and signum == signal.SIGTERM and not self.expired

    def start(self) -> bool:
        """Called by the handler for each deferred SIGTERM; True for the first (which starts the grace)."""
        if self._timer is not None:
            return False
        self.defer()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return True

    def _expire(self) -> None:
        self.expired = True  # before the signal: the handler and the watcher then act on it
        _thread.interrupt_main(signal.SIGTERM)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@contextlib.contextmanager
def exit_on_signal(on_signal: Callable[[], None], *, defer: Callable[[], None] | None = None,
                   grace_s: float = 0.0) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT/SIGHUP run `on_signal` and then raise SystemExit(128 + signum). With `defer`
    and `grace_s` > 0, the first SIGTERM calls `defer` instead (`train`: stop at the next step boundary with a
    checkpoint), SIGTERMs are ignored for `grace_s`, and then handled as above if the block is still running.
    Outside the main thread (where handlers cannot be installed) the block runs without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in HANDLED}
    deferral = _Deferral(defer, grace_s)

    def handler(signum, frame):
        if deferral.deferred(signum):
            if deferral.start():
                log.warning("received SIGTERM: stopping at the next step boundary with a checkpoint, or in %g s at "
                            "the latest (SIGINT: at once)", grace_s)
            return
        for s, h in previous.items():  # a second signal is not handled twice
            signal.signal(s, h)
        name = signal.Signals(signum).name
        log.warning("received %s: making sure no inference server is left paused, then exiting with %d", name,
                    exit_code(signum))
        try:
            on_signal()
        except Exception as exc:  # noqa: BLE001 - the process exits either way; say what could not be done
            log.error("on %s, could not finish cleaning up: %s", name, exc)
        raise SystemExit(exit_code(signum))

    for s in HANDLED:
        signal.signal(s, handler)
    watcher = _Watcher(on_signal, deferral)
    try:
        yield
    finally:
        deferral.cancel()
        watcher.close()
        for s, h in previous.items():
            signal.signal(s, h)


class _Watcher:
    """A daemon thread that calls `on_signal` as soon as a handled signal arrives (through the wakeup fd), even while
    the main thread is stuck in C code."""

    def __init__(self, on_signal: Callable[[], None], deferral: _Deferral):
        self.on_signal = on_signal
        self.deferral = deferral
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd needs a non-blocking fd
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="signal-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data or self._closed:
                return
            handled = [b for b in data if b in (int(s) for s in HANDLED)]
            if any(not self.deferral.deferred(b) for b in handled):
                try:
                    self.on_signal()
                except Exception as exc:  # noqa: BLE001 - the main thread's handler reports and exits
                    log.error("signal watcher: %s", exc)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._closed = True
        os.close(self._write)  # the reader sees end of file and returns
        self._thread.join(timeout=5)
        os.close(self._read)
