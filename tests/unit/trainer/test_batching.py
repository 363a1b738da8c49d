"""Batching: a batch's groups dealt to ranks by tokens, completions packed into micro-batches within a token budget,
groups collated into padded tensors, and those tensors moved to the training device."""

import pytest
import torch

from asyncgrpo.contracts import Group
from asyncgrpo.trainer.batching import collate, pack_by_tokens, split_by_tokens, to_device


# ---- shares per rank and micro-batches by tokens --------------------------------------------------------------------
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


def test_reaching_the_count_halves_the_micro_batch_of_largest_padded_size_never_a_lone_sequence():
    # lengths 10, 6, 6, 6, 2 in a budget of 20 pack as [10, 6] (padded 2 x 10 = 20) and [6, 6, 2] (3 x 6 = 18)
    lengths = [10, 6, 6, 6, 2]
    assert pack_by_tokens(lengths, budget=20) == [[0, 1], [2, 3, 4]]
    assert pack_by_tokens(lengths, budget=20, count=3) == [[0], [1], [2, 3, 4]]  # the 20, not the 18 (nor the last)
    # [50] alone is over the budget and largest, but one sequence cannot be halved: [10, 10] is
    assert pack_by_tokens([50, 10, 10], budget=40, count=3) == [[0], [1], [2]]


# ---- collated tensors ----------------------------------------------------------------------------------------------
def _group(prompt, completions, behaviour, advantages):
    return Group(prompt="", prompt_ids=prompt, completion_ids=completions, behaviour_logprobs=behaviour,
                 rewards=[0.0] * len(completions), reward_parts={}, advantages=advantages, version=0, adapter="")


def test_collate_aligns_behaviour_and_mask_with_the_completion_tokens():
    batch = collate([_group([5, 6, 7], [[8, 9], [10]], [[-0.5, -1.5], [-2.0]], [1.0, -1.0])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # Position t scores token t+1: the completion starts after prompt position 2.
    assert batch["mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch["behaviour"].tolist() == [[0, 0, -0.5, -1.5], [0, 0, -2.0, 0]]
    assert batch["advantages"].tolist() == [1.0, -1.0]


def test_every_tensor_of_a_batch_moves_to_the_training_device():
    batch = collate([_group([5, 6], [[8, 9]], [[-0.5, -1.5]], [1.0])], pad_id=0)
    moved = to_device(batch, torch.device("meta"))  # not the CPU, as a GPU is
    assert set(moved) == set(batch) == {"input_ids", "attention_mask", "behaviour", "mask", "advantages"}
    assert {t.device.type for t in moved.values()} == {"meta"}
    assert {k: t.dtype for k, t in moved.items()} == {k: t.dtype for k, t in batch.items()}
    assert to_device(batch, "cpu")["mask"] is batch["mask"]  # no copy where the batch already is


def test_an_episodes_tool_and_template_tokens_are_context_not_loss():
    # prompt [5, 6]; completion: two sampled ids, two tool ids (mask 0, logprob 0.0), one sampled id
    g = Group(prompt="p", prompt_ids=[5, 6], completion_ids=[[7, 8, 9, 10, 11]],
              behaviour_logprobs=[[-0.5, -0.25, 0.0, 0.0, -2.0]], rewards=[1.0], reward_parts={}, advantages=[1.0],
              version=3, adapter="a", loss_mask=[[1, 1, 0, 0, 1]], versions=[[3] * 5])
    batch = collate([g], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    # position t scores token t+1: the completion starts at position 1
    assert batch["mask"].tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]]
    assert batch["behaviour"].tolist() == [[0.0, -0.5, -0.25, 0.0, 0.0, -2.0]]
    masked = collate([Group(**{**g.__dict__, "masked": [True]})], pad_id=0)  # mask_truncated_completions still wins
    assert masked["mask"].sum() == 0
