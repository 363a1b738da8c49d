"""The arithmetic of `asyncgrpo bench rank0` on hand-made step records (no server, no trainer)."""

from types import SimpleNamespace

from asyncgrpo.bench.rank0 import StepClock


def clock_with(steps):
    clock = StepClock(SimpleNamespace(train_step=lambda: None))
    clock.steps = [{"start": s, "end": e, "wall_s": e - s, "wait_s": w, "cpu_s": c} for s, e, w, c in steps]
    return clock


def test_busy_step_time_leaves_out_the_queue_wait_and_the_warm_up_steps():
    clock = clock_with([(0.0, 5.0, 4.0, 0.1),  # warm-up: slow, not counted
                        (5.5, 6.5, 0.5, 0.2),  # 0.5 s busy
                        (7.0, 8.5, 0.0, 0.4)])  # 1.5 s busy
    summary = clock.summary(warmup=1)
    assert summary["measured_steps"] == 2
    assert summary["step_s"] == 1.0  # (0.5 + 1.5) / 2
    # the loop from the end of the warm-up to the last step, less the waits: (8.5 - 5.0 - 0.5) / 2
    assert summary["loop_s"] == 1.5
    assert summary["wait_s"] == 0.25 and summary["train_thread_cpu_s"] == 0.3


def test_the_clock_records_each_step_and_its_wait_from_the_step_stats():
    stats = SimpleNamespace(values={"time/wait_for_data_s": 0.0})
    trainer = SimpleNamespace(train_step=lambda: stats)
    clock = StepClock(trainer)
    assert trainer.train_step() is stats and trainer.train_step() is stats
    assert len(clock.steps) == 2 and all(s["wait_s"] == 0.0 and s["end"] >= s["start"] for s in clock.steps)
