import pytest

from asyncgrpo.contracts import centred_advantages, scored_advantages


def test_a_group_scored_for_batch_scaling_is_only_centred_until_its_batch_is_taken():
    rewards = [1.0, 0.0, 0.0, 0.0]
    assert scored_advantages(rewards, "batch") == [0.75, -0.25, -0.25, -0.25]
    assert scored_advantages(rewards, "none") == [0.75, -0.25, -0.25, -0.25]
    assert scored_advantages(rewards, "group") == pytest.approx([0.75 / 0.5001] + [-0.25 / 0.5001] * 3)
    assert scored_advantages(rewards, "group") == centred_advantages(rewards, "group")
