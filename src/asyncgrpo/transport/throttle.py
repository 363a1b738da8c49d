"""Failed handshakes on `rollout-serve`, limited per source address in log lines and in CPU.

Each failed handshake costs the server a TLS handshake and a key proof (about a millisecond of CPU) and an ERROR
line. `HandshakeThrottle` logs the first LOG_BURST failures of an address per WINDOW_S in full and one summary line
per WINDOW_S after that; once an address has failed BLOCK_AFTER handshakes within WINDOW_S, its new connections are
closed at accept, before any TLS, until its failures age out of the window. Why per address: docs/security.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

log = logging.getLogger("asyncgrpo.transport.remote")  # the accept loop's logger: one place to read for a server

WINDOW_S = 10.0  # failures are counted over this long; a blocked address is let in again once they age out of it
BLOCK_AFTER = 8  # failed handshakes of one address within WINDOW_S before its connections are closed at accept
LOG_BURST = 8  # full log lines per address per WINDOW_S; the rest are counted into one summary line
MAX_ADDRESSES = 4096  # addresses remembered at once (oldest forgotten first): bounded memory under a spread flood


class _Address:
    __slots__ = ("failures", "logged", "suppressed", "summary_at")

    def __init__(self) -> None:
        self.failures: deque[float] = deque()  # times of costly failures within the window
        self.logged: deque[float] = deque()  # times of full log lines within the window
        self.suppressed = 0  # lines not written since the last summary
        self.summary_at = 0.0  # when the last summary was written


class HandshakeThrottle:
    """Per-address failure counts for one listening server; thread-safe (handshakes run on threads of their own)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._addresses: OrderedDict[str, _Address] = OrderedDict()

    def blocked(self, ip: str) -> bool:
        """Whether a new connection from `ip` is to be closed at once (counted into the next summary line)."""
        with self._lock:
            entry = self._entry(ip, create=False)
            if entry is None or len(entry.failures) < BLOCK_AFTER:
                return False
            entry.suppressed += 1
            self._maybe_summarise(ip, entry)
            return True

    def failed(self, ip: str, message: str, *, costly: bool = True) -> None:
        """Note a failed handshake of `ip` and log `message` if this address is still within its LOG_BURST; `costly`:
        it cost a TLS handshake or a key proof (a client that only went silent, or was cut, cost nothing)."""
        with self._lock:
            entry = self._entry(ip, create=True)
            now = self._clock()
            if costly:
                entry.failures.append(now)
            if len(entry.logged) < LOG_BURST:
                entry.logged.append(now)
                log.error("%s", message)
            else:
                entry.suppressed += 1
                self._maybe_summarise(ip, entry)

    def _entry(self, ip: str, create: bool) -> _Address | None:
        now = self._clock()
        entry = self._addresses.get(ip)
        if entry is None:
            if not create:
                return None
            entry = self._addresses[ip] = _Address()
            while len(self._addresses) > MAX_ADDRESSES:
                self._addresses.popitem(last=False)
        self._addresses.move_to_end(ip)
        for times in (entry.failures, entry.logged):
            while times and times[0] <= now - WINDOW_S:
                times.popleft()
        return entry

    def _maybe_summarise(self, ip: str, entry: _Address) -> None:
        now = self._clock()
        if now - entry.summary_at < WINDOW_S:
            return
        log.error("%d more connections from %s failed or were closed at accept without a line each (more than %d "
                  "failed handshakes in %.0f s); still listening", entry.suppressed, ip, BLOCK_AFTER, WINDOW_S)
        entry.suppressed, entry.summary_at = 0, now
