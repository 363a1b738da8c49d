"""When the producer may start generating a batch: the version the trainer will hold at its first step, less the
staleness allowed."""

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.scheduler import version_needed


def cfg(**kw):
    return AsyncGRPOConfig.from_dict({"lora_adapter_path": "/tmp/adapters", **kw})


def test_synchronous_batches_wait_for_the_version_that_trains_them():
    c = cfg(max_staleness=0)
    assert [version_needed(b, c) for b in range(4)] == [0, 1, 2, 3]


def test_one_step_of_staleness_lets_the_next_batch_start_one_version_early():
    c = cfg(max_staleness=1)
    assert [version_needed(b, c) for b in range(4)] == [-1, 0, 1, 2]


def test_num_iterations_with_one_publish_per_batch_keeps_staleness_in_batches():
    # Batch b is trained at steps 3b..3b+2 and published after them: version b trains it.
    assert [version_needed(b, cfg(num_iterations=3, weight_sync_steps=3, max_staleness=0)) for b in range(4)] == \
        [0, 1, 2, 3]
    assert [version_needed(b, cfg(num_iterations=3, weight_sync_steps=3, max_staleness=1)) for b in range(4)] == \
        [-1, 0, 1, 2]


def test_num_iterations_with_a_publish_every_step_counts_every_step_as_a_version():
    # Batch b first trains at step 3b = version 3b: with max_staleness 1 it starts during the previous batch's
    # last pass only.
    c = cfg(num_iterations=3, weight_sync_steps=1, max_staleness=1)
    assert [version_needed(b, c) for b in range(4)] == [-1, 2, 5, 8]


def test_request_seeds_are_fixed_numbers_below_2_to_the_31():
    """A resumed run must send the same seeds as the run it continues, and vLLM takes a signed 32-bit seed."""
    from asyncgrpo.rollout.producer import request_seed

    assert request_seed(3, 5, 8) == 3 * 1_000_003 + 5 * 8
    assert request_seed(3000, 0, 8) == 3_000_009_000 - 2**31  # wraps at 2**31, not 2**32
    assert all(0 <= request_seed(s, i, 16) < 2**31 for s in (0, 7, 10**6) for i in (0, 1, 10**9))


def test_a_publish_every_other_step_rounds_the_version_down():
    # Batch b trains at step b; with a publish every 2 steps the trainer then holds version b // 2, less 1 of staleness.
    c = cfg(weight_sync_steps=2, max_staleness=1)  # (0 with this pair is refused: config.py)
    assert [version_needed(b, c) for b in range(5)] == [-1, -1, 0, 0, 1]
