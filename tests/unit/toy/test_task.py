"""The addition task: split sizes and determinism, prompt/answer format, and the exact-match reward."""

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.task import addition_reward, answer_text, make_split, prompt_text


def test_prompt_is_zero_padded_and_answer_is_not():
    assert prompt_text(7, 45) == "07+45="
    assert answer_text(7, 45) == "52"
    assert prompt_text(0, 0) == "00+00="
    assert answer_text(0, 3) == "3"
    assert answer_text(99, 99) == "198"


def test_split_covers_all_ten_thousand_pairs_once():
    train, heldout = make_split(seed=0)
    assert len(train) == 9500
    assert len(heldout) == 500
    prompts = [r["prompt"] for r in train + heldout]
    assert len(set(prompts)) == 10_000
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in heldout)


def test_split_rows_are_prompt_answer_pairs_that_agree():
    train, heldout = make_split(seed=0)
    for row in train[:50] + heldout[:50]:
        assert set(row) == {"prompt", "answer"}
        a, b = int(row["prompt"][:2]), int(row["prompt"][3:5])
        assert row["prompt"] == f"{a:02d}+{b:02d}="
        assert row["answer"] == str(a + b)


def test_split_is_deterministic_by_seed():
    assert make_split(seed=3) == make_split(seed=3)
    assert make_split(seed=3)[1] != make_split(seed=4)[1]


def test_split_honours_n_heldout():
    train, heldout = make_split(seed=0, n_heldout=100)
    assert (len(train), len(heldout)) == (9900, 100)
    # The held-out set is the head of the same shuffle, so a smaller one is a prefix of a larger one.
    assert heldout == make_split(seed=0, n_heldout=500)[1][:100]


@pytest.mark.parametrize("n_heldout", [0, 10_000, -5])
def test_split_rejects_a_heldout_size_that_leaves_a_side_empty(n_heldout):
    with pytest.raises(ConfigError, match="n_heldout"):
        make_split(seed=0, n_heldout=n_heldout)


def test_reward_is_one_only_for_the_exact_answer():
    completions = ["52", "53", "052", "52.", "5 2", "", "\ufffd52"]
    rewards = addition_reward(["07+45="] * 7, completions, ["52"] * 7)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_ignores_surrounding_whitespace():
    rewards = addition_reward(["07+45="] * 3, [" 52", "52\n", "\t52 "], ["52"] * 3)
    assert rewards == [1.0, 1.0, 1.0]


def test_reward_accepts_trl_conversational_completions_and_extra_columns():
    completions = [[{"role": "assistant", "content": "198"}], [{"role": "assistant", "content": "19"}]]
    rewards = addition_reward(["99+99="] * 2, completions, ["198", "198"], trainer_state=None, other=[1, 2])
    assert rewards == [1.0, 0.0]


def test_reward_rejects_mismatched_lengths_with_the_fix():
    with pytest.raises(ValueError, match="answer"):
        addition_reward(["07+45="] * 2, ["52", "52"], ["52"])
