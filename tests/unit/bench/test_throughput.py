"""The timeline arithmetic behind `asyncgrpo bench throughput`, and its plot, on hand-made timelines (no server)."""

import threading

import pytest
from fakes import Clock

from asyncgrpo.bench.throughput import plot_timelines, run_summary, step_history, timeline_record
from asyncgrpo.timeline import Timeline, complement, covered_seconds, fraction, merge, span


def test_merge_joins_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7), (9, 8)]) == [(0, 4), (5, 6)]


def test_fractions_count_overlaps_once_and_only_inside_the_window():
    busy = [(-1.0, 1.0), (2.0, 4.0), (3.0, 5.0), (9.0, 12.0)]
    assert covered_seconds(busy, 0.0, 10.0) == pytest.approx(1.0 + 3.0 + 1.0)
    assert fraction(busy, 0.0, 10.0) == pytest.approx(0.5)
    assert fraction(busy, 5.0, 5.0) == 0.0
    assert complement(busy, 0.0, 10.0) == [(1.0, 2.0), (5.0, 9.0)]
    assert complement([], 0.0, 2.0) == [(0.0, 2.0)]


def test_timeline_is_busy_while_any_request_is_in_flight():
    clock = Clock()
    t = Timeline(clock)
    clock.now = 1.0
    t.enter()  # request A
    clock.now = 2.0
    t.enter()  # request B overlaps A
    clock.now = 3.0
    t.exit()
    clock.now = 4.0
    t.exit()  # the server goes idle only now
    clock.now = 6.0
    t.enter()  # still open when the window ends
    assert t.snapshot(0.0, 7.0) == [(1.0, 4.0), (6.0, 7.0)]
    with span(t):
        clock.now = 6.5
    assert t.intervals[-1] == (6.0, 6.5)


def test_timeline_keeps_only_the_newest_intervals():
    clock = Clock()
    t = Timeline(clock, max_intervals=2)
    for start in (1.0, 3.0, 5.0):
        t.add(start, start + 1.0)
    assert list(t.intervals) == [(3.0, 4.0), (5.0, 6.0)]  # the oldest was dropped: memory stays bounded
    assert t.snapshot(0.0, 10.0) == [(3.0, 4.0), (5.0, 6.0)]


def test_timeline_enter_exit_is_thread_safe():
    t = Timeline()

    def worker():
        for _ in range(2000):
            t.enter()
            t.exit()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t._depth == 0
    assert all(e >= s for s, e in t.intervals)


def test_run_summary_reports_idle_fractions_staleness_and_rates():
    history = [{"staleness/mean": 0.0, "staleness/max": 0, "train/tokens": 100.0},
               {"staleness/mean": 1.0, "staleness/max": 1, "train/tokens": 300.0}]
    s = run_summary(staleness=1, steps=2, t0=10.0, t1=14.0, waits=[(10.0, 11.0)], busy=[(10.0, 11.0), (12.0, 13.0)],
                    history=history, generated_tokens=800)
    assert s["steps_per_s"] == 0.5
    assert s["trainer_idle_fraction"] == 0.25
    assert s["inference_idle_fraction"] == 0.5
    assert (s["staleness_mean"], s["staleness_max"]) == (0.5, 1)
    assert (s["generated_tokens_per_s"], s["trained_tokens_per_s"]) == (200.0, 100.0)


def test_plot_writes_a_png_from_recorded_timelines(tmp_path):
    sync = timeline_record(0, 100.0, 104.0, waits=[(100.0, 101.0), (102.0, 103.0)],
                           busy=[(100.0, 101.0), (102.0, 103.0)])
    assert sync["trainer_busy"] == [[1.0, 2.0], [3.0, 4.0]]
    assert sync["server_idle"] == [[1.0, 2.0], [3.0, 4.0]]
    overlap = timeline_record(1, 0.0, 2.5, waits=[(0.0, 0.5)], busy=[(0.0, 2.5)]) | {"steps_per_s": 1.6}
    out = plot_timelines([sync, overlap], tmp_path / "sub" / "timeline.png", title="test")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 2000


def test_step_history_reads_what_the_trainer_logged(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step, (stale, tokens) in enumerate([(0.0, 10.0), (1.0, 30.0)], start=1):
        writer.add_scalar("staleness/mean", stale, step)
        writer.add_scalar("train/tokens", tokens, step)
        writer.add_scalar("train/reward", 0.5, step)
    writer.close()
    assert step_history(tmp_path) == [{"staleness/mean": 0.0, "train/tokens": 10.0},
                                      {"staleness/mean": 1.0, "train/tokens": 30.0}]
