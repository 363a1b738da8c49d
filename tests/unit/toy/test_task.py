"""The "which is larger" task: split sizes and determinism, prompt/answer format, and the exact-match reward."""

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.task import answer_text, distractor_text, larger_reward, make_split, prompt_text


def test_prompt_and_answers_are_zero_padded():
    assert prompt_text(7, 45) == "07,45>"
    assert answer_text(7, 45) == "45" and distractor_text(7, 45) == "07"
    assert answer_text(3, 1) == "03" and distractor_text(3, 1) == "01"
    assert answer_text(99, 98) == "99"


def test_split_covers_every_pair_of_different_numbers_once():
    train, heldout = make_split(seed=0)
    assert (len(train), len(heldout)) == (9400, 500)
    prompts = [r["prompt"] for r in train + heldout]
    assert len(set(prompts)) == 9900
    assert "07,07>" not in prompts
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in heldout)


def test_split_rows_agree_with_their_prompt():
    train, heldout = make_split(seed=0)
    for row in train[:50] + heldout[:50]:
        assert set(row) == {"prompt", "answer", "distractor"}
        a, b = int(row["prompt"][:2]), int(row["prompt"][3:5])
        assert row["prompt"] == f"{a:02d},{b:02d}>"
        assert int(row["answer"]) == max(a, b) and int(row["distractor"]) == min(a, b)


def test_split_is_deterministic_by_seed():
    assert make_split(seed=3) == make_split(seed=3)
    assert make_split(seed=3)[1] != make_split(seed=4)[1]


def test_split_honours_n_heldout():
    train, heldout = make_split(seed=0, n_heldout=100)
    assert (len(train), len(heldout)) == (9800, 100)
    assert heldout == make_split(seed=0, n_heldout=500)[1][:100]  # the held-out set is the head of one shuffle


@pytest.mark.parametrize("n_heldout", [0, 9900, -5])
def test_split_rejects_a_heldout_size_that_leaves_a_side_empty(n_heldout):
    with pytest.raises(ConfigError, match="n_heldout"):
        make_split(seed=0, n_heldout=n_heldout)


def test_reward_is_one_only_for_the_exact_answer():
    completions = ["45", "07", "045", "45.", "4 5", "", "\ufffd45"]
    assert larger_reward(["07,45>"] * 7, completions, ["45"] * 7) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_ignores_surrounding_whitespace():
    assert larger_reward(["07,45>"] * 3, [" 45", "45\n", "\t45 "], ["45"] * 3) == [1.0, 1.0, 1.0]


def test_reward_accepts_trl_conversational_completions_and_extra_columns():
    completions = [[{"role": "assistant", "content": "99"}], [{"role": "assistant", "content": "98"}]]
    rewards = larger_reward(["99,98>"] * 2, completions, ["99", "99"], distractor=["98", "98"], trainer_state=None)
    assert rewards == [1.0, 0.0]


def test_reward_rejects_mismatched_lengths_with_the_fix():
    with pytest.raises(ValueError, match="answer"):
        larger_reward(["07,45>"] * 2, ["45", "45"], ["45"])
