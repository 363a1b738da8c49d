import pytest

from asyncgrpo.errors import ConfigError, RewardFunctionError
from asyncgrpo.rewards import RewardScorer


def length_reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def exploding_reward(prompts, completions, **kw):
    raise ValueError("cannot parse")


def short_reward(prompts, completions, **kw):
    return [1.0]


def test_weighted_sum_and_parts():
    s = RewardScorer([f"{__name__}:length_reward", "asyncgrpo.toy:larger_reward"], weights=[0.5, 2.0])
    total, parts = s.score(["01,03>"] * 2, ["3", "03"], {"answer": ["03", "03"]})
    assert parts == {"length_reward": [1.0, 2.0], "larger_reward": [0.0, 1.0]}
    assert total == [0.5, 1.0 + 2.0]


def test_raising_reward_names_function_and_sample():
    s = RewardScorer([f"{__name__}:exploding_reward"])
    with pytest.raises(RewardFunctionError) as err:
        s.score(["07+45="], ["52"], {})
    msg = str(err.value)
    assert "exploding_reward raised ValueError: cannot parse" in msg
    assert "'07+45='" in msg and "reward_fallback" in msg


def test_fallback_reward_is_used_and_counted():
    s = RewardScorer([f"{__name__}:exploding_reward"], fallback=-1.0)
    total, _ = s.score(["p", "p"], ["a", "b"], {})
    assert total == [-1.0, -1.0]
    assert s.fallbacks == 2


def test_wrong_number_of_rewards_is_an_error_even_with_fallback():
    s = RewardScorer([f"{__name__}:short_reward"], fallback=0.0)
    with pytest.raises(RewardFunctionError, match="returned 1 values for 2 completions"):
        s.score(["p", "p"], ["a", "b"], {})


def test_unknown_reward_function_is_a_config_error():
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        RewardScorer([f"{__name__}:nope"])
    with pytest.raises(ConfigError, match="cannot import module"):
        RewardScorer(["no_such_module_xyz:f"])
