"""HandshakeThrottle with a hand-driven clock: log lines and blocking per address, and both age out of the window."""

import logging

from asyncgrpo.transport import throttle
from asyncgrpo.transport.throttle import BLOCK_AFTER, LOG_BURST, WINDOW_S, HandshakeThrottle


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_an_address_is_blocked_after_its_failures_and_let_in_once_they_age_out(caplog):
    clock = Clock()
    limiter = HandshakeThrottle(clock)
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        for i in range(BLOCK_AFTER):
            assert not limiter.blocked("10.0.0.9")
            limiter.failed("10.0.0.9", f"refused {i}")
        assert limiter.blocked("10.0.0.9") and limiter.blocked("10.0.0.9")
        assert not limiter.blocked("10.0.0.8")  # another address is not held to this one's failures
        clock.now += WINDOW_S + 0.1
        assert not limiter.blocked("10.0.0.9")
    lines = errors(caplog)
    assert lines[:BLOCK_AFTER] == [f"refused {i}" for i in range(BLOCK_AFTER)]
    # one summary for the two connections closed at accept, not a line each
    assert lines[BLOCK_AFTER:] == [f"1 more connections from 10.0.0.9 failed or were closed at accept without a line "
                                   f"each (more than {BLOCK_AFTER} failed handshakes in {WINDOW_S:.0f} s); still "
                                   f"listening"]


def test_silent_or_cut_clients_are_logged_within_the_burst_but_never_blocked(caplog):
    clock = Clock()
    limiter = HandshakeThrottle(clock)
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        for i in range(3 * LOG_BURST):
            limiter.failed("10.0.0.7", f"silent {i}", costly=False)
        assert not limiter.blocked("10.0.0.7")
        assert len(errors(caplog)) == LOG_BURST + 1  # the burst, then one summary per window
        clock.now += WINDOW_S + 0.1
        limiter.failed("10.0.0.7", "silent again", costly=False)
    assert errors(caplog)[-1] == "silent again"


def test_the_addresses_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(throttle, "MAX_ADDRESSES", 3)
    limiter = HandshakeThrottle(Clock())
    for n in range(10):
        limiter.failed(f"10.0.1.{n}", "x")
    assert list(limiter._addresses) == ["10.0.1.7", "10.0.1.8", "10.0.1.9"]
