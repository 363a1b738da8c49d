"""How many generation requests the producer keeps in flight with `adaptive_inflight: true`: the limit follows what
keeps the trainer fed and the servers busy, within the memory the servers report.

After every batch the trainer takes, `InflightControl.update` reads whether the trainer had to wait for it, whether
the limit is what held the producer back, and each server's load from its Prometheus `/metrics`:

- a server whose KV cache is FULL_KV used or more: the limit shrinks by a quarter (vLLM would start preempting);
- else a server with requests waiting in its own queue: the limit holds (the server is saturated: more requests
  would only wait there, and grow older);
- else, if the trainer waited and the limit was reached: the limit grows by one request per server.

It stays within [number of servers, ceiling]. Why these rules: docs/rollout-internals.md, "How many requests are in
flight".
"""

from __future__ import annotations

from asyncgrpo.inference.server_load import ServerLoad

FULL_KV = 0.9  # fraction of the KV cache in use from which a server counts as out of memory
WAITED_S = 0.01  # a take that blocked longer than this waited for generation (a lock and a sort take microseconds)


class InflightControl:
    """The limit on requests in flight and the rule that moves it (module docstring). `update` returns the new limit;
    `changes` counts how often it moved, `last_reason` says why it did what it did last."""

    def __init__(self, start: int, *, servers: int, ceiling: int):
        self.low = max(1, servers)
        self.high = max(self.low, ceiling)
        self.step = max(1, servers)
        self.limit = min(self.high, max(self.low, start))
        self.changes = 0
        self.last_reason = "start"

    def update(self, loads: list[ServerLoad | None], *, trainer_waited: bool, limit_reached: bool) -> int:
        """Move the limit after one batch: `loads` per server (None: its metrics could not be read), whether the
        trainer waited for the batch, whether requests in flight reached the limit since the last update."""
        known = [load for load in loads if load is not None]
        if any(load.kv_cache_usage >= FULL_KV for load in known):
            new, self.last_reason = max(self.low, self.limit - max(1, self.limit // 4)), "server memory full"
        elif any(load.waiting > 0 for load in known):
            new, self.last_reason = self.limit, "server saturated"
        elif trainer_waited and limit_reached:
            new, self.last_reason = min(self.high, self.limit + self.step), "trainer waited at the limit"
        else:
            new, self.last_reason = self.limit, "trainer fed" if not trainer_waited else "limit not reached"
        self.changes += new != self.limit
        self.limit = new
        return new
