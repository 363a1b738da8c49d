"""`environment_factory`'s instances over a run: built once, reset for each episode, closed at the end (TRL's "construct
once, reset often"). docs/agents.md, "With an environment class"."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Callable

from asyncgrpo.errors import ConfigError, ToolError

log = logging.getLogger(__name__)


def called(value):
    """A sync or async method's result."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


class EnvironmentPool:
    """`environment_factory`'s instances, built once and reused (TRL: "construct once, reset often"): an episode takes
    an idle one (a new one only when every instance is in use, so there are as many as episodes ever ran at once)
    and gives it back once its group is scored. `close()` calls each instance's `close()`, when it has one, at the
    end of the run; an instance given back after that is closed at once."""

    def __init__(self, factory: Callable, ref: str | None):
        self.factory, self.ref = factory, ref
        self._lock = threading.Lock()
        self._idle: list = []
        self.built = 0  # instances made so far
        self._closed = False

    def take(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.built += 1
        try:
            environment = self.factory()
        except Exception as exc:  # noqa: BLE001 - a user's class: name it
            raise ToolError(f"environment_factory {self.ref} could not be built: {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(environment, "reset", None)):
            raise ConfigError("environment_factory", f"{self.ref} returned a {type(environment).__name__}, which has "
                              f"no reset(**row) method", "return an instance with reset(**row) and public tool methods")
        return environment

    def give_back(self, environment) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(environment)
                return
        close_environment(environment)

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for environment in idle:
            close_environment(environment)


def close_environment(environment) -> None:
    """`environment.close()` when it has one; a failure is logged, not raised (the run is ending)."""
    close = getattr(environment, "close", None)
    if not callable(close):
        return
    try:
        called(close())
    except Exception as exc:  # noqa: BLE001 - a user's close: report it and go on closing the others
        log.warning("%s.close() raised %s: %s", type(environment).__name__, type(exc).__name__, exc)
