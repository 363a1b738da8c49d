"""The bounded, versioned queue of scored rollout groups between the producer and the trainer.

`take` hands the trainer a batch, oldest policy version first, never a group more than `max_staleness` versions behind
it; it drops and counts those (and, with dynamic sampling, groups whose rewards are all equal).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from asyncgrpo.contracts import Group, scale_by_batch_std


class RolloutQueue:
    """Thread-safe queue of groups, taken oldest policy version first. `take` never returns a group more than `max_staleness` versions older
    than the trainer; such groups are discarded and counted in `dropped_stale`."""

    def __init__(self, max_staleness: int, scale_rewards: str = "group", dynamic_sampling: bool = False):
        self.max_staleness = max_staleness
        self.scale_rewards = scale_rewards  # `batch`: advantages are scaled over the batch `take` returns
        self.dynamic_sampling = dynamic_sampling  # drop groups whose rewards are all equal (DAPO)
        self.dropped_stale = 0
        self.dropped_stale_tokens = 0  # sampled tokens of the groups dropped as too old: generated for nothing
        self.dropped_zero_std = 0  # groups dropped by dynamic sampling (the producer generated others instead)
        self._groups: deque[Group] = deque()
        self.cond = threading.Condition()  # guards the queue; `take` waits on it
        self._error: BaseException | None = None
        self.batches_taken = 0  # batches this queue handed to the trainer
        # Called as f(groups, batch) with `cond` held whenever groups leave the queue: taken as a batch, or dropped
        # (the producer's schedule frees their slots). They must not call back into the queue.
        self.removal_listeners: list[Callable[[int, bool], None]] = []

    def put(self, group: Group) -> None:
        """Queue a scored group; with dynamic sampling a group whose rewards are all equal (no advantage, no
        gradient) is counted and dropped instead, and the producer, woken, sends another request in its place."""
        with self.cond:
            if self.dynamic_sampling and max(group.rewards) == min(group.rewards):
                self.dropped_zero_std += 1
                self._removed_locked(1, batch=False)
            else:
                self._groups.append(group)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer died: wake the trainer and re-raise `error` from `take`."""
        with self.cond:
            self._error = error
            self.cond.notify_all()

    def _removed_locked(self, groups: int, batch: bool) -> None:
        for listener in self.removal_listeners:
            listener(groups, batch)

    def __len__(self) -> int:
        with self.cond:
            return len(self._groups)

    def _drop_stale_locked(self, trainer_version: int) -> int:
        keep = deque(g for g in self._groups if trainer_version - g.version <= self.max_staleness)
        dropped = len(self._groups) - len(keep)
        if dropped:
            self.dropped_stale_tokens += sum(g.n_sampled_tokens for g in self._groups
                                             if trainer_version - g.version > self.max_staleness)
            self._groups = keep
            self.dropped_stale += dropped
            self._removed_locked(dropped, batch=False)  # the producer refills what was dropped
            self.cond.notify_all()
        return dropped

    def take(self, n: int, trainer_version: int, timeout_s: float) -> list[Group]:
        """Block until `n` fresh-enough groups are queued, then pop them (oldest first)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self._error is not None:
                    raise self._error
                self._drop_stale_locked(trainer_version)
                if len(self._groups) >= n:
                    # Oldest version first: requests finish out of order, and a group that waits behind newer
                    # ones may become too stale for the next batch. Then data order, so that a batch does not
                    # depend on which request finished first (a resumed run trains the same batches).
                    self._groups = deque(sorted(self._groups, key=lambda g: (g.version, g.index)))
                    out = [self._groups.popleft() for _ in range(n)]
                    if self.scale_rewards == "batch":
                        scale_by_batch_std(out)
                    self.batches_taken += 1
                    self._removed_locked(n, batch=True)
                    self.cond.notify_all()
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    zero_std = f", {self.dropped_zero_std} dropped so far by dynamic_sampling (every completion " \
                        f"of each got the same reward: make the reward finer or the prompts easier, or turn it off)" \
                        if self.dropped_zero_std else ""
                    raise TimeoutError(f"no rollout batch after {timeout_s:.0f} s ({len(self._groups)}/{n} groups "
                                       f"queued{zero_std}); is the inference server generating?")
                self.cond.wait(timeout=min(remaining, 1.0))
