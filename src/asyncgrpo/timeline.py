"""Busy/idle timelines, recorded cheaply in memory: a list of (start, end) `time.monotonic()` intervals.

Two are recorded on rank 0 (see `trainer.py` and `rollout/producer.py`):
- the trainer's *idle* intervals: time spent waiting on the rollout queue for the next batch;
- the inference servers' *busy* intervals: time during which at least one generation request is in flight.

The arithmetic (union, clipping to a window, fractions) is plain functions, so that it is tested without a server.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (empty or inverted intervals are dropped)."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def clip(intervals: Iterable[Interval], t0: float, t1: float) -> list[Interval]:
    """The parts of `intervals` inside the window [t0, t1]."""
    return [(max(s, t0), min(e, t1)) for s, e in intervals if min(e, t1) > max(s, t0)]


def covered_seconds(intervals: Iterable[Interval], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by at least one interval (overlaps counted once)."""
    return sum(e - s for s, e in merge(clip(intervals, t0, t1)))


def fraction(intervals: Iterable[Interval], t0: float, t1: float) -> float:
    """The fraction of the window [t0, t1] covered by `intervals` (0 for an empty window)."""
    if t1 <= t0:
        return 0.0
    return covered_seconds(intervals, t0, t1) / (t1 - t0)


def complement(intervals: Iterable[Interval], t0: float, t1: float) -> list[Interval]:
    """The gaps of [t0, t1] that no interval covers (e.g. idle time from busy intervals)."""
    gaps, cursor = [], t0
    for s, e in merge(clip(intervals, t0, t1)):
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < t1:
        gaps.append((cursor, t1))
    return gaps


class Timeline:
    """Thread-safe recorder of intervals. `span()` records one interval around a block; `enter()`/`exit()` record
    the time during which a counter is above zero (e.g. "any request in flight" across many threads). Only the
    newest `max_intervals` are kept (a few MB at the default), so a run of any length stays bounded; a snapshot of
    a window older than those misses what was dropped."""

    def __init__(self, clock=time.monotonic, max_intervals: int = 100_000):
        self.clock = clock
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self._depth = 0
        self._opened = 0.0
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self.intervals.append((start, end))

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._opened = self.clock()
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self.intervals.append((self._opened, self.clock()))

    def snapshot(self, t0: float, t1: float) -> list[Interval]:
        """Merged intervals inside [t0, t1], including one still open at t1."""
        with self._lock:
            items = list(self.intervals)
            if self._depth > 0:
                items.append((self._opened, t1))
        return merge(clip(items, t0, t1))


class span:
    """`with span(timeline): ...` records the block's duration as one interval of `timeline`."""

    def __init__(self, timeline: Timeline | None):
        self.timeline = timeline

    def __enter__(self):
        if self.timeline is not None:
            self._t0 = self.timeline.clock()
        return self

    def __exit__(self, *exc) -> None:
        if self.timeline is not None:
            self.timeline.add(self._t0, self.timeline.clock())
