"""SIGTERM / SIGINT: leave the inference servers serving, then exit with the signal's conventional code.

`accelerate launch` and torchrun send SIGTERM to every rank when one of them dies, SLURM sends it on preemption, and
an operator presses Ctrl-C (SIGINT). Python's default for SIGTERM is to die on the spot, so a weight sync in progress
on rank 0's publisher thread would leave the server paused (`POST /pause` done, `POST /resume` never sent), stalling
every later request to it, including the next run's.

`exit_on_signal(on_signal)` installs handlers (main thread only, as Python requires) that call `on_signal` first
(the trainer's `halt`: resume every server this process paused), then raise SystemExit(128 + signal number): 143
for SIGTERM, 130 for SIGINT, what a shell reports for a process the signal killed. `finally` blocks still run. A
second signal while the first is handled gets Python's default behaviour (an impatient operator's second Ctrl-C).

Limit: Python runs a signal handler only when the main thread holds the interpreter. A main thread blocked inside
one C call (a gloo/NCCL collective waiting for a dead rank) runs it when that call returns or times out.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The conventional exit status of a process ended by signal `signum` (128 + its number)."""
    return 128 + int(signum)


@contextlib.contextmanager
def exit_on_signal(on_signal: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT run `on_signal` and then raise SystemExit(128 + signum). Outside the main
    thread (where handlers cannot be installed) the block runs without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in HANDLED}

    def handler(signum, frame):
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
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
