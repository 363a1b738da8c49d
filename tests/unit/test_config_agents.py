"""The agent keys: references checked at load, combinations that cannot work refused naming the key, TRL's turn cap
read as ours."""

from __future__ import annotations

import pytest
from fakes import cfg

from asyncgrpo.errors import ConfigError


def test_no_tools_means_plain_completions():
    plain = cfg()
    assert not plain.uses_tools and plain.tools == [] and plain.environment_factory is None


def test_a_tool_reference_without_a_colon_names_the_key_and_the_form():
    with pytest.raises(ConfigError, match="tools.*package.module:name"):
        cfg(tools=["my_tools.lookup"])
    with pytest.raises(ConfigError, match="environment_factory"):
        cfg(environment_factory="my_env.Shop")


def test_reward_workers_are_refused_with_episodes_because_environments_live_in_the_rollout_process():
    with pytest.raises(ConfigError, match="reward_workers.*reward_workers: 0"):
        cfg(tools=["agent_tools:lookup"], reward_workers=2)


def test_raw_prompts_are_refused_with_tools():
    with pytest.raises(ConfigError, match="prompt_format"):
        cfg(environment_factory="agent_tools:Counter", prompt_format="raw")


def test_trls_max_tool_calling_iterations_is_read_as_one_more_model_turn():
    assert cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=3).max_turns == 4


@pytest.mark.parametrize("key,value", [("max_turns", 0), ("tool_timeout", 0), ("max_episode_tokens", 0)])
def test_agent_numbers_out_of_range_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        cfg(**{key: value})


def test_no_default_reward_is_added_beside_an_environment_but_plain_runs_keep_the_toy_reward():
    assert cfg(environment_factory="agent_tools:Counter").reward_funcs == []  # its get_reward() scores (TRL)
    assert cfg(tools=["agent_tools:lookup"]).reward_funcs == ["asyncgrpo.toy:larger_reward"]
    assert cfg().reward_funcs == ["asyncgrpo.toy:larger_reward"]
    assert cfg(environment_factory="agent_tools:Counter", reward_funcs=["agent_tools:messages_reward"]).reward_funcs \
        == ["agent_tools:messages_reward"]
    with pytest.raises(ConfigError, match="reward_funcs.*is empty"):
        cfg(reward_funcs=[])


def test_trls_max_tool_calling_iterations_unset_means_no_cap_of_its_own_and_a_contradicting_max_turns_is_refused():
    assert cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=None).max_turns == 8  # max_turns' default
    assert cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=0).max_turns == 1  # answer, no tool round
    assert cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=2, max_turns=3).max_turns == 3
    with pytest.raises(ConfigError, match="max_tool_calling_iterations.*max_turns is 5.*set only one"):
        cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=2, max_turns=5)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations.*-1"):
        cfg(tools=["agent_tools:lookup"], max_tool_calling_iterations=-1)


def test_a_run_without_a_dataset_needs_an_environment_and_max_steps_rather_than_epochs():
    assert cfg(dataset_name="environment", environment_factory="agent_tools:Counter").dataset_name == "environment"
    with pytest.raises(ConfigError, match="dataset_name.*environment_factory"):
        cfg(dataset_name="environment")
    with pytest.raises(ConfigError, match="num_train_epochs.*max_steps"):
        cfg(dataset_name="environment", environment_factory="agent_tools:Counter", num_train_epochs=1)


def test_tool_process_needs_tools_to_isolate():
    assert cfg(tools=["agent_tools:lookup"], tool_process=True).tool_process
    with pytest.raises(ConfigError, match="tool_process.*no `tools`"):
        cfg(environment_factory="agent_tools:Counter", tool_process=True)


def test_an_agent_function_brings_its_reward_and_excludes_the_built_in_loops_keys(monkeypatch):
    from asyncgrpo.config import AsyncGRPOConfig

    agent = AsyncGRPOConfig.from_dict({"model_name_or_path": "m", "dataset_name": "d.jsonl",
                                       "agent_function": "my_agent.run:episode"})
    assert agent.reward_funcs == [] and agent.uses_episodes and not agent.uses_tools and agent.task_problems() == []
    assert agent.agent_endpoint_host == "127.0.0.1" and agent.agent_endpoint_port == 0
    with pytest.raises(ConfigError, match="agent_function.*drop `tools`"):
        cfg(agent_function="my_agent.run:episode", tools=["agent_tools:lookup"])
    with pytest.raises(ConfigError, match="agent_function.*package.module:function"):
        cfg(agent_function="my_agent.run.episode")
    with pytest.raises(ConfigError, match="reward_workers"):
        cfg(agent_function="my_agent.run:episode", reward_workers=2)
    with pytest.raises(ConfigError, match="agent_endpoint_port"):
        cfg(agent_function="my_agent.run:episode", agent_endpoint_port=70000)


def test_an_agent_endpoint_beyond_loopback_needs_a_key(monkeypatch):
    monkeypatch.delenv("ASYNCGRPO_AGENT_KEY", raising=False)
    with pytest.raises(ConfigError, match="agent_endpoint_host.*ASYNCGRPO_AGENT_KEY"):
        cfg(agent_function="my_agent.run:episode", agent_endpoint_host="0.0.0.0")
    monkeypatch.setenv("ASYNCGRPO_AGENT_KEY", "k" * 32)
    assert cfg(agent_function="my_agent.run:episode", agent_endpoint_host="0.0.0.0").agent_endpoint_host == "0.0.0.0"
