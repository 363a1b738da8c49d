"""A liveness bound for the tests: `returns_within(call, bound_s, what)`.

Importable from every test module and conftest as `from liveness import returns_within` (pyproject.toml puts tests/
on pytest's `pythonpath`)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any, Callable


def returns_within(call: Callable[[], Any], bound_s: float, what: str) -> Any:
    """`call()` in a daemon thread: its value, or its exception re-raised in the test's thread, failing the test if
    the call is still running after `bound_s` (the message names `what` and the bound).

    A liveness bound, not a speed check: pick `bound_s` well above the call's normal time, so that only a call that
    would never return (a deadline that never comes, a wait that is never woken, a read with no timeout) trips it.
    Without it such a mistake hangs the test instead of failing it. The thread is a daemon, so a call that never
    returns does not keep the test process alive."""
    outcome: dict[str, Any] = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
            outcome["error"] = exc

    caller = threading.Thread(target=run, name=f"test-call: {what}"[:60], daemon=True)
    caller.start()
    caller.join(bound_s)
    assert not caller.is_alive(), f"{what} had not returned after {bound_s:g} s (a liveness bound: a hang?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def killed_midway(target: Callable, args: tuple, what: str, bound_s: float = 60.0) -> None:
    """Run `target(*args, ready)` in a forked child, wait (at most `bound_s`) until it sets `ready` midway through
    `what`, then SIGKILL it: what a killed writer leaves behind, for real. Asserts the child died by the kill."""
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=target, args=(*args, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(bound_s), f"the child never reached the middle of {what}"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert child.exitcode == -signal.SIGKILL
