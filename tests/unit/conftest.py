"""The `stubs` fixture: start in-process HTTP stubs of vLLM (tests/fakes.py's `StubServer`) for client tests of what a
real vLLM server cannot be made to do on demand; each test module says what its stub stands in for. Every stub started
is closed at teardown."""

from __future__ import annotations

import pytest
from fakes import Route, StubServer


@pytest.fixture
def stubs():
    started: list[StubServer] = []

    def start(route: Route, port: int = 0) -> StubServer:
        started.append(StubServer(route, port))
        return started[-1]

    yield start
    for stub in started:
        stub.close()
