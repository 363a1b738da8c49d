import dataclasses
import threading

import pytest

from asyncgrpo.contracts import Group, centred_advantages, scale_by_batch_std
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.trainer.batching import pack_by_tokens, split_by_tokens


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


def sized(index: int, prompt_len: int, completion_lens: list[int]) -> Group:
    return Group(prompt=f"p{index}", prompt_ids=[1] * prompt_len, completion_ids=[[2] * n for n in completion_lens],
                 behaviour_logprobs=[[-1.0] * n for n in completion_lens], rewards=[0.0] * len(completion_lens),
                 reward_parts={}, advantages=[0.0] * len(completion_lens), version=0, adapter="a", index=index)


def test_split_by_tokens_gives_each_rank_as_many_groups_and_about_as_many_tokens():
    # A sequence is prompt + completion: long groups cost 2 x (4 + 50) = 108, short ones 2 x (2 + 5) = 14.
    # Contiguous halves would give rank 0 all four long groups (432 tokens) and rank 1 the short ones (56).
    groups = [sized(i, 4, [50, 50]) for i in range(4)] + [sized(i, 2, [5, 5]) for i in range(4, 8)]
    shares = split_by_tokens(groups, 2)
    tokens = [sum(len(g.prompt_ids) + len(c) for g in share for c in g.completion_ids) for share in shares]
    assert [len(s) for s in shares] == [4, 4]
    assert tokens == [244, 244]
    assert sorted(g.index for s in shares for g in s) == list(range(8))  # every group exactly once
    assert all([g.index for g in s] == sorted(g.index for g in s) for s in shares)  # batch order kept
    assert split_by_tokens(groups, 1) == [groups]
    with pytest.raises(ValueError, match="8 groups do not split evenly over 3 ranks"):
        split_by_tokens(groups, 3)


def _padded(batch, lengths):
    return len(batch) * max(lengths[i] for i in batch)


def test_token_budget_packs_every_sequence_exactly_once_within_the_budget():
    lengths = [5, 40, 12, 12, 90, 7, 33, 20, 8, 61, 3, 25]
    packed = pack_by_tokens(lengths, budget=80)
    assert sorted(i for b in packed for i in b) == list(range(len(lengths)))
    assert all(_padded(b, lengths) <= 80 for b in packed if len(b) > 1)
    assert [b for b in packed if _padded(b, lengths) > 80] == [[4]]  # 90 tokens: alone, over the budget
    # sorted by length: padding is what a micro-batch of similar lengths leaves, far less than an unsorted split
    padding = sum(_padded(b, lengths) - sum(lengths[i] for i in b) for b in packed)
    assert padding < 0.25 * sum(lengths)
    assert len(packed) < len(lengths)  # sequences share micro-batches


def test_token_budget_split_reaches_the_count_every_rank_runs_and_stays_within_budget():
    lengths = [10] * 8
    assert [len(b) for b in pack_by_tokens(lengths, budget=80)] == [8]
    for count in (1, 2, 3, 5, 8):
        packed = pack_by_tokens(lengths, budget=80, count=count)
        assert len(packed) == count
        assert sorted(i for b in packed for i in b) == list(range(8))
        assert all(_padded(b, lengths) <= 80 for b in packed)
    with pytest.raises(AssertionError):
        pack_by_tokens(lengths, budget=80, count=9)  # more micro-batches than sequences: a caller bug


def test_split_by_tokens_places_the_largest_groups_first_and_never_overfills_a_rank():
    # Costs (one completion each, no prompt) 2, 5, 3, 3, 4, 3 over 2 ranks of 3 groups. Largest first, each to the
    # least-loaded rank with room: 5 -> r0, 4 -> r1, 3 -> r1, 3 -> r0, 3 -> r1 (now full), 2 -> r0: 10 and 10.
    # (In data order it would be 8 / 12, smallest first 9 / 11.)
    groups = [sized(i, 0, [n]) for i, n in enumerate([2, 5, 3, 3, 4, 3])]
    shares = split_by_tokens(groups, 2)
    assert [[g.index for g in s] for s in shares] == [[0, 1, 3], [2, 4, 5]]
    # One huge group and three small ones: the small ones may not all go to the emptier rank.
    shares = split_by_tokens([sized(i, 0, [n]) for i, n in enumerate([10, 1, 1, 1])], 2)
    assert [[g.index for g in s] for s in shares] == [[0, 3], [1, 2]]


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
              adapter="pol-v3", finish_reasons=["stop", "length", "stop"], index=9, masked=[False, True, False])
    one = g.completion(1)
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


def test_reaching_the_count_halves_the_micro_batch_of_largest_padded_size_never_a_lone_sequence():
    # lengths 10, 6, 6, 6, 2 in a budget of 20 pack as [10, 6] (padded 2 x 10 = 20) and [6, 6, 2] (3 x 6 = 18)
    lengths = [10, 6, 6, 6, 2]
    assert pack_by_tokens(lengths, budget=20) == [[0, 1], [2, 3, 4]]
    assert pack_by_tokens(lengths, budget=20, count=3) == [[0], [1], [2, 3, 4]]  # the 20, not the 18 (nor the last)
    # [50] alone is over the budget and largest, but one sequence cannot be halved: [10, 10] is
    assert pack_by_tokens([50, 10, 10], budget=40, count=3) == [[0], [1], [2]]


@pytest.mark.parametrize("rewards", [[1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.3, 2.5, -1.0, 0.7, 0.7, 4.0, 0.0, 1.5],
                                     [1.0] * 8])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_centred_advantages_are_the_loss_group_advantages_in_plain_python(rewards, scale):
    import torch

    from asyncgrpo.trainer.loss import group_advantages

    expected = group_advantages(torch.tensor([rewards], dtype=torch.float64), scale=scale)[0].tolist()
    assert centred_advantages(rewards, scale) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert centred_advantages([1.0, 0.0, 0.0, 0.0], "group") == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001] +
                                                                              [-0.25 / 0.5001] * 2)


def test_a_group_of_one_has_no_spread_so_its_scaled_advantage_is_nan_as_in_the_loss():
    import math

    import torch

    from asyncgrpo.trainer.loss import group_advantages

    with pytest.warns(UserWarning, match="degrees of freedom"):  # torch says so too (config refuses groups of one)
        assert math.isnan(group_advantages(torch.tensor([[0.7]], dtype=torch.float64), scale="group")[0, 0].item())
    assert math.isnan(centred_advantages([0.7], "group")[0])  # not a ZeroDivisionError
    assert centred_advantages([0.7], "none") == [0.0]


def test_centred_advantages_refuse_batch_scaling_which_needs_the_whole_batch():
    with pytest.raises(AssertionError, match="not 'batch'"):
        centred_advantages([1.0, 0.0], "batch")
