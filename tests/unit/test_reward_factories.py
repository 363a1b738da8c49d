"""Reward factories from the config (TRL's `get_soft_overlong_punishment` shape): called with reward_kwargs, the
returned function scores; DAPO's soft overlong punishment by hand."""

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.rewards import RewardScorer, is_factory, load_reward_function, length_penalty, math_accuracy

REF = "asyncgrpo.rewards:get_soft_overlong_punishment"


def test_soft_overlong_punishment_by_hand():
    # max 10, cache 4: free up to 6 tokens; 8 tokens -> (6 - 8) / 4 = -0.5; 10 -> -1.0; 11 (over) -> -1.
    fn = load_reward_function(REF, {"max_completion_len": 10, "soft_punish_cache": 4})
    lengths = [5, 6, 7, 8, 10, 11]
    assert fn(completion_ids=[[0] * n for n in lengths]) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_a_factory_in_the_config_scores_through_the_scorer():
    cfg = AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "lora_adapter_path": "/tmp/a", "reward_funcs": [REF],
                                     "reward_kwargs": {"get_soft_overlong_punishment":
                                                       {"max_completion_len": 10, "soft_punish_cache": 4}}})
    scorer = RewardScorer(cfg.reward_funcs, cfg.reward_weights, cfg.reward_fallback, cfg.reward_kwargs)
    total, parts = scorer.score(["p", "p"], ["a", "b"], {}, completion_ids=[[1] * 8, [1] * 3])
    assert total == [-0.5, 0.0] and parts == {"get_soft_overlong_punishment": [-0.5, 0.0]}


def test_a_factory_without_its_arguments_is_a_config_error_naming_reward_kwargs():
    with pytest.raises(ConfigError, match=r"config `reward_kwargs`: reward factory .*get_soft_overlong_punishment"):
        load_reward_function(REF)


def test_reward_functions_are_not_mistaken_for_factories():
    assert is_factory(load_reward_function.__globals__["get_soft_overlong_punishment"])
    assert not is_factory(math_accuracy) and not is_factory(length_penalty)
    assert not is_factory(lambda completions, **kwargs: [0.0])  # TRL's think_format_reward shape
    assert not is_factory(lambda completion_ids, **kwargs: [0.0])  # what a factory returns
