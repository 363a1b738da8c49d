"""Rollout groups and the bounded, versioned queue between the producer and the trainer."""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Group:
    """One prompt and its `num_generations` completions, scored, with the policy version that made them."""

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]  # the server's logprob of each sampled token
    rewards: list[float]
    reward_parts: dict[str, list[float | None]]  # None: the function did not apply to that completion
    advantages: list[float]
    version: int  # policy version that was being served when the request was sent
    adapter: str  # adapter name that served the request
    finish_reasons: list[str] = field(default_factory=list)
    index: int = -1  # the prompt's position in the producer's data stream (orders a batch; checkpoints resume after it)
    masked: list[bool] = field(default_factory=list)  # completions left out of the loss (mask_truncated_completions)

    @property
    def n_completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def completion(self, j: int) -> Group:
        """This group with its j-th completion only (micro-batches packed by length split groups)."""
        return dataclasses.replace(self, completion_ids=[self.completion_ids[j]],
                                   behaviour_logprobs=[self.behaviour_logprobs[j]], rewards=[self.rewards[j]],
                                   advantages=[self.advantages[j]], finish_reasons=self.finish_reasons[j:j + 1],
                                   reward_parts={k: [v[j]] for k, v in self.reward_parts.items()},
                                   masked=self.masked[j:j + 1])


def centred_advantages(rewards: list[float], scale: str, eps: float = 1e-4) -> list[float]:
    """One group's advantages as `loss.group_advantages` computes them (reward - group mean, divided by the group's
    unbiased std + eps when `scale` is "group"), in plain Python: the producer runs this once per group, where a
    torch call cost more than the rest of the group's bookkeeping. Float64 here, float32 there (agree to ~1e-7)."""
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if scale == "none":
        return centred
    assert scale == "group", f"a group is scaled by its own std or not at all, not {scale!r}"
    std = math.sqrt(sum(c * c for c in centred) / (n - 1)) if n > 1 else math.nan  # torch: nan for one sample
    return [c / (std + eps) for c in centred]


def scale_by_batch_std(groups: list[Group], eps: float = 1e-4) -> None:
    """`scale_rewards: batch`: divide the groups' centred advantages by the std of every reward in the batch (torch's
    unbiased std, as TRL). In place; the producer centred each group when it was scored."""
    rewards = [r for g in groups for r in g.rewards]
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    for g in groups:
        g.advantages = [a / (std + eps) for a in g.advantages]


def split_by_tokens(groups: list[Group], parts: int) -> list[list[Group]]:
    """Deal `groups` to `parts` ranks: the same number each (every rank runs the same micro-steps and collectives)
    and about the same number of tokens (prompt + completion, what a forward costs). Largest groups first, each to
    the least-loaded rank with room; each share keeps the batch's order."""
    if len(groups) % parts:
        raise ValueError(f"{len(groups)} groups do not split evenly over {parts} ranks")
    room = len(groups) // parts
    cost = [sum(len(g.prompt_ids) + len(c) for c in g.completion_ids) for g in groups]
    load, members = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(groups)), key=lambda i: -cost[i]):
        rank = min((r for r in range(parts) if len(members[r]) < room), key=lambda r: load[r])
        load[rank] += cost[i]
        members[rank].append(i)
    return [[groups[i] for i in sorted(m)] for m in members]


def pack_by_tokens(lengths: list[int], budget: int, count: int | None = None) -> list[list[int]]:
    """Indices of sequences (of `lengths` tokens each) packed into micro-batches: longest first, each micro-batch a
    run of consecutive lengths whose padded size (sequences x its longest) is at most `budget`; a sequence longer than
    the budget goes alone. `count`: then the micro-batch of largest padded size is halved until there are exactly
    `count` (every rank must run the same number of forwards; halving keeps each within the budget)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packed: list[list[int]] = []
    for i in order:
        if packed and (len(packed[-1]) + 1) * lengths[packed[-1][0]] <= budget:
            packed[-1].append(i)
        else:
            packed.append([i])
    assert count is None or len(packed) <= count <= len(lengths), (len(packed), count, len(lengths))
    while count is not None and len(packed) < count:
        j = max((k for k in range(len(packed)) if len(packed[k]) > 1), key=lambda k: len(packed[k]) * lengths[packed[k][0]])
        half = len(packed[j]) // 2
        packed[j:j + 1] = [packed[j][:half], packed[j][half:]]
    return packed


class RolloutQueue:
    """Thread-safe queue of groups, taken oldest policy version first. `take` never returns a group more than `max_staleness` versions older
    than the trainer; such groups are discarded and counted in `dropped_stale`."""

    def __init__(self, max_staleness: int, scale_rewards: str = "group", dynamic_sampling: bool = False):
        self.max_staleness = max_staleness
        self.scale_rewards = scale_rewards  # `batch`: advantages are scaled over the batch `take` returns
        self.dynamic_sampling = dynamic_sampling  # drop groups whose rewards are all equal (DAPO)
        self.dropped_stale = 0
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
