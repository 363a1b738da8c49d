"""Admission: what the producer may send, for which batch, at which policy version. One object, one lock.

`rollout_mode: batch`: a request whose group will land in batch b is sent only once the server serves a version close
enough to the one batch b will be trained at (`version_needed`). `stream`: a request is sent whenever fewer than a
capacity of groups are in flight or queued, and the trainer's next batch could still take it. Either way it is
tagged with the version served when it was sent. The queue reports what leaves it (`removed`), the producer what it
sends (`claim`), what came back (`finished`) and what it lost (`lost`). Lock order: the queue calls `removed` with
its own lock held; admission never calls the queue. Why this bounds staleness: docs/rollout-internals.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from asyncgrpo.config import AsyncSettings, TrainingSettings
from asyncgrpo.errors import ConfigError


@dataclass
class AdmissionSettings(AsyncSettings, TrainingSettings):
    """The sections the send rule reads: max_staleness, weight_sync_steps and the rollout mode (AsyncSettings)
    against num_iterations (TrainingSettings)."""


def version_needed(batch: int, cfg: AdmissionSettings) -> int:
    """The policy version a server must serve before requests for batch `batch` (0-based) may be sent: the trainer's
    version when it first trains on that batch (step batch * num_iterations), less `max_staleness`."""
    return batch * cfg.num_iterations // cfg.weight_sync_steps - cfg.max_staleness


class Admission:
    """The send rule and the state it reads, guarded by `cond` (the producer thread waits on it in `claim`).

    `servers_up()` says whether any inference server is up (ServerRecovery); `batches_taken` is the index of the first
    batch still to fill (a resumed run starts at its checkpoint's batch)."""

    def __init__(self, cfg: AdmissionSettings, groups_per_step: int, max_inflight: int, *,
                 servers_up: Callable[[], bool] = lambda: True, batches_taken: int = 0):
        self.cfg = cfg
        self.groups_per_step = groups_per_step
        self.stream = cfg.rollout_mode == "stream"
        self.capacity = cfg.stream_capacity(groups_per_step)  # stream: groups in flight + queued, at most
        if self.stream and self.capacity < groups_per_step:
            raise ConfigError("rollout_capacity", f"is {self.capacity}, fewer than the {groups_per_step} groups of "
                              "one step: the trainer would never find a whole batch queued",
                              f"use at least {groups_per_step}, or unset it")
        self.max_inflight = max_inflight  # requests in flight at once, at most
        self.servers_up = servers_up
        self.cond = threading.Condition()
        self.version = -1  # nothing served yet: no request is sent before the first set_policy()
        self.adapter = ""
        self.inflight = 0  # requests sent whose answer has not been handled yet
        self.peak_inflight = 0  # the most in flight at once since the last `set_limit` (adaptive_inflight)
        self._inflight_by_adapter: Counter[str] = Counter()
        self.pending = 0  # groups sent and not yet taken, dropped or lost: in flight or queued
        self.batches_taken = batches_taken
        self.stopped = False

    # ---- what the publisher and the trainer's side tell it ----------------------------------------------------
    def set_policy(self, version: int, adapter: str) -> None:
        """The servers now serve `adapter` as policy `version`; requests sent from now on are tagged with it."""
        with self.cond:
            self.version, self.adapter = version, adapter
            self.cond.notify_all()

    def removed(self, groups: int, batch: bool) -> None:
        """`groups` groups left the queue: taken as one batch (`batch`), or dropped (stale, or zero reward std)."""
        with self.cond:
            self.pending -= groups
            self.batches_taken += batch
            self.cond.notify_all()

    def wake(self) -> None:
        """Something the rule reads outside this object changed (a server went down or came back)."""
        with self.cond:
            self.cond.notify_all()

    def set_limit(self, decide: Callable[[bool], int]) -> int:
        """Requests in flight are now capped by `decide(reached)`, where `reached` says whether they reached the
        cap since the last call (adaptive_inflight: rollout/concurrency.py); returns the new cap."""
        with self.cond:
            reached = self.peak_inflight >= self.max_inflight
            self.max_inflight = decide(reached)
            self.peak_inflight = self.inflight
            self.cond.notify_all()
            return self.max_inflight

    def stop(self) -> None:
        """Send nothing more; `claim` returns None from now on."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    # ---- the producer ---------------------------------------------------------------------------------------
    def may_send(self) -> bool:
        """With `cond` held: is there room for one more request, and may it be sent at the version served? (True once
        stopped, so that a waiting `claim` returns.) batch: the version its batch needs is served. stream: fewer
        than `capacity` groups are in flight or queued, and the next batch the trainer takes could still train it."""
        if self.stopped:
            return True
        if self.inflight >= self.max_inflight or self.version < 0:
            return False
        if not self.servers_up():
            return False  # every server is down: wait for one to be recovered
        if self.stream:
            return self.pending < self.capacity and self.version >= version_needed(self.batches_taken, self.cfg)
        return self.version >= version_needed(self.next_batch(), self.cfg)

    def next_batch(self) -> int:
        """With `cond` held: the batch a group sent now would land in."""
        return self.batches_taken + self.pending // self.groups_per_step

    def claim(self) -> tuple[int, str] | None:
        """Block until one more request may be sent, count it as sent, and return the (version, adapter) to send it
        with; None once stopped."""
        with self.cond:
            self.cond.wait_for(self.may_send)
            if self.stopped:
                return None
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            self.pending += 1
            self._inflight_by_adapter[self.adapter] += 1
            return self.version, self.adapter

    def finished(self, adapter: str) -> None:
        """A request sent to `adapter` is out of flight (its group is queued, lost, or dropped)."""
        with self.cond:
            self.inflight -= 1
            self._inflight_by_adapter[adapter] -= 1
            self.cond.notify_all()

    def lost(self) -> None:
        """A sent group will not reach the queue (its request failed or was aborted): its slot is free again."""
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    @contextlib.contextmanager
    def latest(self) -> Iterator[tuple[int, str]]:
        """For one turn of an episode (`episode_version: latest`): the (version, adapter) served now, counted as in
        use until the turn's request ends. Read and counted under one lock, so a publisher that unloads what is not
        in use after `set_policy` sees every turn that still reads an older adapter."""
        with self.cond:
            version, adapter = self.version, self.adapter
            self._inflight_by_adapter[adapter] += 1
        try:
            yield version, adapter
        finally:
            with self.cond:
                self._inflight_by_adapter[adapter] -= 1
                self.cond.notify_all()

    def adapters_in_use(self) -> set[str]:
        """Adapter names that requests in flight were sent to (they must stay loaded)."""
        with self.cond:
            return {name for name, count in self._inflight_by_adapter.items() if count > 0}
