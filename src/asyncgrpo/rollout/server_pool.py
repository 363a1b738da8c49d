"""Which inference server gets the next generation request: the one that is up with the fewest requests in flight;
among equals, the next in round-robin order.

Not thread-safe on its own: the producer calls it under the lock that guards its scheduling state. What the rule
guarantees (and what it does not): docs/running.md, "Several inference servers".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ServerPicker:
    """Requests in flight per server, counted by the producer: `pick()` when a request is sent, `done()` when its
    answer or error comes back."""

    def __init__(self, clients: Sequence):
        assert clients, "a producer needs at least one inference server"
        self.clients = list(clients)
        self._index = {id(c): i for i, c in enumerate(self.clients)}
        self.inflight = [0] * len(self.clients)  # requests sent and not yet answered (nor failed), per server
        self.sent = [0] * len(self.clients)  # requests sent in all, per server
        self._next = 0  # where the round-robin scan of equally loaded servers starts

    def pick(self, is_up: Callable[[object], bool]):
        """The server that gets the next request (counted as sent): up, fewest in flight, ties in round-robin order."""
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        candidates = [i for i in order if is_up(self.clients[i])] or order
        chosen = min(candidates, key=lambda i: self.inflight[i])  # min keeps the first of equals: round robin
        self._next = (chosen + 1) % n
        self.inflight[chosen] += 1
        self.sent[chosen] += 1
        return self.clients[chosen]

    def done(self, client) -> None:
        """A request to `client` came back (answer or error): one fewer in flight there."""
        i = self._index[id(client)]
        assert self.inflight[i] > 0, f"{client.base_url}: an answer came back for no request in flight"
        self.inflight[i] -= 1

    def inflight_per_server(self) -> dict[str, int]:
        return {c.base_url: k for c, k in zip(self.clients, self.inflight)}

    def sent_per_server(self) -> dict[str, int]:
        return {c.base_url: k for c, k in zip(self.clients, self.sent)}
