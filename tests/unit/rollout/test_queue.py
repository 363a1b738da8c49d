import dataclasses
import math
import threading

import pytest
import torch
from advantage_reference import group_advantages

from asyncgrpo.contracts import Group, centred_advantages, scale_by_batch_std
from asyncgrpo.rollout.queue import RolloutQueue


def group(version: int, tag: str = "") -> Group:
    return Group(prompt=tag or f"p{version}", prompt_ids=[1], completion_ids=[[2], [3]], behaviour_logprobs=[[-1.0], [-1.0]],
                 rewards=[1.0, 0.0], reward_parts={}, advantages=[0.7, -0.7], version=version, adapter="a")


def test_stale_groups_are_never_trained_on():
    q = RolloutQueue(max_staleness=1)
    for v in [0, 1, 2, 3, 3]:
        q.put(group(v))
    batch = q.take(3, trainer_version=3, timeout_s=1)
    assert [g.version for g in batch] == [2, 3, 3]
    assert q.dropped_stale == 2
    assert q.batches_taken == 1


def test_listeners_hear_stale_drops_as_drops_and_a_take_as_one_batch():
    """The schedule counts batches from these calls: a stale drop heard as a batch would shift every later request to
    the wrong batch (and so the wrong version)."""
    q = RolloutQueue(max_staleness=1)
    heard: list[tuple[int, bool]] = []
    q.removal_listeners.append(lambda groups, batch: heard.append((groups, batch)))
    for v in [0, 1, 2, 3, 3]:
        q.put(group(v))
    q.take(3, trainer_version=3, timeout_s=1)
    assert heard == [(2, False), (3, True)]
    sampling = RolloutQueue(max_staleness=1, dynamic_sampling=True)
    sampling.removal_listeners.append(lambda groups, batch: heard.append((groups, batch)))
    sampling.put(dataclasses.replace(group(0), rewards=[0.5, 0.5]))  # no spread: dropped at put, one group
    assert heard[2:] == [(1, False)] and len(sampling) == 0


def test_synchronous_queue_keeps_only_the_current_version():
    q = RolloutQueue(max_staleness=0)
    q.put(group(4))
    q.put(group(5))
    assert [g.version for g in q.take(1, trainer_version=5, timeout_s=1)] == [5]
    assert q.dropped_stale == 1


def test_take_waits_for_the_producer_and_keeps_order():
    q = RolloutQueue(max_staleness=2)
    q.put(group(0, "first"))
    t = threading.Thread(target=lambda: q.put(group(0, "second")))
    with q.cond:
        t.start()  # cannot put until take() releases the lock while waiting
    assert [g.prompt for g in q.take(2, trainer_version=0, timeout_s=15)] == ["first", "second"]
    t.join()


def test_producer_failure_reaches_the_trainer():
    q = RolloutQueue(max_staleness=1)
    q.fail(RuntimeError("server gone"))
    with pytest.raises(RuntimeError, match="server gone"):  # at once: the failure is checked before any wait
        q.take(1, trainer_version=0, timeout_s=0.01)


def test_take_times_out_with_a_message(take_within):
    q = RolloutQueue(max_staleness=1)
    with pytest.raises(TimeoutError, match="0/2 groups"):
        take_within(q, 2, timeout_s=0.01)


def test_take_serves_the_oldest_version_first_so_late_groups_are_not_wasted():
    q = RolloutQueue(max_staleness=1)
    q.put(group(3, "new"))
    q.put(group(2, "late-but-still-fresh"))
    assert [g.prompt for g in q.take(1, trainer_version=3, timeout_s=1)] == ["late-but-still-fresh"]
    assert q.dropped_stale == 0


def test_batches_taken_and_dropped_groups_add_up_over_calls():
    q = RolloutQueue(max_staleness=0)
    for version in (0, 0, 1, 1, 2, 2):
        q.put(group(version))
    assert [g.version for g in q.take(2, trainer_version=0, timeout_s=1)] == [0, 0]
    assert [g.version for g in q.take(1, trainer_version=2, timeout_s=1)] == [2]  # drops both version-1 groups
    q.put(group(1))
    assert [g.version for g in q.take(1, trainer_version=2, timeout_s=1)] == [2]  # and this late one
    assert (q.batches_taken, q.dropped_stale) == (3, 3)


def test_a_timeout_after_dynamic_sampling_drops_says_how_many_and_what_to_change(take_within):
    q = RolloutQueue(max_staleness=0, dynamic_sampling=True)
    for rewards in ([1.0, 1.0], [0.0, 0.0], [1.0, 0.0]):
        q.put(dataclasses.replace(group(0), rewards=rewards))
    with pytest.raises(TimeoutError) as err:
        take_within(q, 2, timeout_s=0.01)
    message = str(err.value)
    for part in ("no rollout batch after 0 s", "(1/2 groups queued, 2 dropped so far by dynamic_sampling",
                 "make the reward finer or the prompts easier, or turn it off)", "is the inference server generating?"):
        assert part in message, part
    plain = RolloutQueue(max_staleness=0)
    with pytest.raises(TimeoutError) as err:
        take_within(plain, 2, timeout_s=0.01)
    assert "(0/2 groups queued)" in str(err.value) and "dynamic_sampling" not in str(err.value)


def test_one_completion_of_a_group_keeps_every_per_completion_field_of_that_completion_only():
    g = Group(prompt="p", prompt_ids=[1, 2], completion_ids=[[3], [4, 5], [6]],
              behaviour_logprobs=[[-0.1], [-0.2, -0.3], [-0.4]], rewards=[1.0, 0.5, 0.0],
              reward_parts={"a": [1.0, None, 0.0], "b": [0.0, 0.5, 0.0]}, advantages=[0.6, 0.1, -0.7], version=3,
              adapter="pol-v3", finish_reasons=["stop", "length", "stop"], index=9, masked=[False, True, False],
              loss_mask=[[1], [1, 0], [1]], versions=[[3], [2, 3], [3]])  # episodes: per-token mask and versions
    one = g.completion(1)
    assert (one.loss_mask, one.versions) == ([[1, 0]], [[2, 3]])
    assert (one.completion_ids, one.behaviour_logprobs, one.rewards, one.advantages) == \
        ([[4, 5]], [[-0.2, -0.3]], [0.5], [0.1])
    assert (one.finish_reasons, one.masked, one.reward_parts) == (["length"], [True], {"a": [None], "b": [0.5]})
    assert (one.prompt, one.prompt_ids, one.version, one.adapter, one.index) == ("p", [1, 2], 3, "pol-v3", 9)
    assert one.n_completion_tokens == 2 and g.n_completion_tokens == 4
    # without masks or finish reasons (mask_truncated_completions off; groups built in tests) the slices stay empty
    bare = dataclasses.replace(g, finish_reasons=[], masked=[]).completion(2)
    assert (bare.finish_reasons, bare.masked, bare.completion_ids) == ([], [], [[6]])


@pytest.mark.parametrize("rewards,advantages,expected", [
    # sample std of (1, 0) is sqrt(0.5); one reward alone has no spread: std 0, only eps divides
    ([[1.0, 0.0]], [[0.5, -0.5]], [[0.5 / (0.5 ** 0.5 + 1e-4), -0.5 / (0.5 ** 0.5 + 1e-4)]]),
    ([[1.0]], [[0.25]], [[0.25 / 1e-4]]),
])
def test_batch_scaling_uses_the_sample_std_of_every_reward_plus_eps(rewards, advantages, expected):
    groups = [dataclasses.replace(group(0), rewards=r, advantages=a, completion_ids=[[2]] * len(r)) for r, a in
              zip(rewards, advantages)]
    scale_by_batch_std(groups)
    assert [g.advantages for g in groups] == [pytest.approx(e, rel=1e-9) for e in expected]


@pytest.mark.parametrize("rewards", [[1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.3, 2.5, -1.0, 0.7, 0.7, 4.0, 0.0, 1.5],
                                     [1.0] * 8])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_centred_advantages_are_the_loss_group_advantages_in_plain_python(rewards, scale):
    expected = group_advantages(torch.tensor([rewards], dtype=torch.float64), scale=scale)[0].tolist()
    assert centred_advantages(rewards, scale) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert centred_advantages([1.0, 0.0, 0.0, 0.0], "group") == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001] +
                                                                              [-0.25 / 0.5001] * 2)


def test_a_group_of_one_has_no_spread_so_its_scaled_advantage_is_nan_as_in_the_loss():
    with pytest.warns(UserWarning, match="degrees of freedom"):  # torch says so too (config refuses groups of one)
        assert math.isnan(group_advantages(torch.tensor([[0.7]], dtype=torch.float64), scale="group")[0, 0].item())
    assert math.isnan(centred_advantages([0.7], "group")[0])  # not a ZeroDivisionError
    assert centred_advantages([0.7], "none") == [0.0]


def test_centred_advantages_refuse_batch_scaling_which_needs_the_whole_batch():
    with pytest.raises(AssertionError, match="not 'batch'"):
        centred_advantages([1.0, 0.0], "batch")
