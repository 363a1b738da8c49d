import asyncio
import threading

import numpy as np
import pytest

from asyncgrpo.errors import ConfigError, RewardFunctionError
from asyncgrpo.rewards import RewardScorer, accepted_kwargs, reward_means


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


# ---- None = "not applicable" ------------------------------------------------------------------------------------
def only_even_rows(prompts, completions, row, **kw):
    return [1.0 if r % 2 == 0 else None for r in row]


def only_odd_rows(prompts, completions, row, **kw):
    return [10.0 if r % 2 else None for r in row]


def never_applies(prompts, completions, **kw):
    return [None] * len(completions)


def nan_reward(prompts, completions, **kw):
    return [float("nan")] * len(completions)


def numpy_reward(prompts, completions, **kw):
    return [np.float32(0.5)] * len(completions)


def test_none_means_not_applicable_total_is_the_weighted_sum_over_applicable_functions():
    s = RewardScorer([f"{__name__}:only_even_rows", f"{__name__}:length_reward"], weights=[2.0, 0.5])
    total, parts = s.score(["p"] * 3, ["a", "bb", "ccc"], {"row": [0, 1, 2]})
    assert parts == {"only_even_rows": [1.0, None, 1.0], "length_reward": [1.0, 2.0, 3.0]}
    assert total == [2.0 + 0.5, 1.0, 2.0 + 1.5]  # row 1: only length_reward applies, no renormalisation


def test_per_function_means_skip_none():
    parts = [{"a": [1.0, None], "b": [None, None]}, {"a": [0.0, None], "b": [None, None]}]
    assert reward_means(parts) == {"a": 0.5, "b": None}  # b applied to nothing: no mean, not 0


def test_a_completion_no_function_applies_to_is_an_error_or_the_fallback():
    s = RewardScorer([f"{__name__}:only_even_rows", f"{__name__}:never_applies"])
    with pytest.raises(RewardFunctionError) as err:
        s.score(["p", "q"], ["a", "b"], {"row": [0, 1]})
    assert "no reward function applies to 1 completion(s)" in str(err.value)
    assert "'q'" in str(err.value) and "reward_fallback" in str(err.value)
    s = RewardScorer([f"{__name__}:only_even_rows", f"{__name__}:only_odd_rows"])
    assert s.score(["p", "q"], ["a", "b"], {"row": [0, 1]})[0] == [1.0, 10.0]
    s = RewardScorer([f"{__name__}:never_applies"], fallback=-0.5)
    assert s.score(["p", "q"], ["a", "b"], {})[0] == [-0.5, -0.5] and s.fallbacks == 2


def test_nan_is_still_an_error_and_numpy_floats_are_accepted():
    with pytest.raises(RewardFunctionError, match="returned nan; return a finite float"):
        RewardScorer([f"{__name__}:nan_reward"]).score(["p"], ["a"], {})
    assert RewardScorer([f"{__name__}:numpy_reward"]).score(["p"], ["a"], {})[0] == [0.5]


# ---- what reaches the functions --------------------------------------------------------------------------------------
def echo_extras(prompts, completions, completion_ids, parsed=None, **kw):
    return [len(ids) + (100.0 if p and p.get("content") == "4" else 0.0) for ids, p in zip(completion_ids, parsed)]


def test_completion_ids_and_parsed_messages_reach_the_functions():
    s = RewardScorer([f"{__name__}:echo_extras"])
    total, _ = s.score(["p", "p"], ["4", "x"], {}, completion_ids=[[1, 2], [3]],
                       parsed=[{"role": "assistant", "content": "4"}, None])
    assert total == [102.0, 1.0]


def scaled(prompts, completions, *, factor: float = 1.0, **kw):
    return [factor * len(c) for c in completions]


def test_reward_kwargs_are_bound_by_name_or_reference_and_typos_are_config_errors():
    assert RewardScorer([f"{__name__}:scaled"], kwargs={"scaled": {"factor": 3.0}}).score(["p"], ["ab"], {})[0] == [6.0]
    by_ref = RewardScorer([f"{__name__}:scaled"], kwargs={f"{__name__}:scaled": {"factor": 0.5}})
    assert by_ref.score(["p"], ["ab"], {})[0] == [1.0]
    with pytest.raises(ConfigError) as err:
        RewardScorer([f"{__name__}:scaled"], kwargs={"scaled": {"facter": 3.0}})
    assert err.value.field == "reward_kwargs" and "no argument(s) ['facter']; it takes ['factor']" in str(err.value)


async def async_length_reward(prompts, completions, **columns):
    await asyncio.sleep(0)  # a real await: the function is a coroutine function, run to completion by the scorer
    return [float(len(c)) for c in completions]


def test_an_async_reward_function_is_awaited_in_the_scoring_thread():
    s = RewardScorer([f"{__name__}:async_length_reward"], weights=[2.0])
    assert s.score(["p", "p"], ["ab", "abcd"], {}) == ([4.0, 8.0], {"async_length_reward": [2.0, 4.0]})
    results = []
    thread = threading.Thread(target=lambda: results.append(s.score(["p"], ["abc"], {})[0]))  # as request threads do
    thread.start()
    thread.join()
    assert results == [[6.0]]


def trl_logging_reward(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL reward function: shapes by the step, logs a metric and an extra column."""
    log_metric("mean_length", sum(len(c) for c in completions) / len(completions))
    log_extra("doubled", [c * 2 for c in completions])
    return [float(trainer_state.global_step)] * len(completions)


def state_only_reward(prompts, completions, trainer_state):
    return [trainer_state.max_steps / 10] * len(completions)


def test_trl_reward_kwargs_reach_the_functions_that_take_them_and_what_they_log_is_kept_until_taken():
    s = RewardScorer([f"{__name__}:trl_logging_reward", f"{__name__}:state_only_reward", f"{__name__}:length_reward"])
    s.state.global_step, s.state.max_steps = 12, 30
    total, parts = s.score(["p", "p"], ["ab", "abcd"], {})
    assert parts == {"trl_logging_reward": [12.0, 12.0], "state_only_reward": [3.0, 3.0], "length_reward": [2.0, 4.0]}
    s.score(["p"], ["abcdef"], {})
    metrics, extra = s.logged.take()
    assert metrics == {"mean_length": [3.0, 6.0]} and extra == {"doubled": ["abab", "abcdabcd", "abcdefabcdef"]}
    assert s.logged.take() == ({}, {})  # taken once


def test_only_the_trl_arguments_a_function_names_or_takes_through_kwargs_are_passed():
    assert accepted_kwargs(state_only_reward) == {"trainer_state"}
    assert accepted_kwargs(length_reward) == {"trainer_state", "log_metric", "log_extra"}
    assert accepted_kwargs(lambda prompts, completions, answer: None) == set()
