"""`asyncgrpo demo --world agent`: the training config it writes and the summary it prints (the run itself needs the
episode runner and a server: integration territory)."""

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo_agent import AGENT_KEYS, agent_config, load_agent_config, summary_lines

WORLD = SimpleNamespace(model_dir=Path("/cache/agent-x/model"), train_file=Path("/cache/agent-x/train.jsonl"))


def _resolve(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def test_config_names_the_toy_environment_reward_and_turn_budget():
    values = agent_config(WORLD)
    assert values["environment_factory"] == "asyncgrpo.toy.agent_task:LookupEnv" and values["tools"] == []
    assert values["max_turns"] == 5 and values["max_episode_tokens"] + 45 <= 256  # prompt + episode fit the model
    env = _resolve(values["environment_factory"])()
    assert callable(env.reset) and callable(env.lookup)
    reward = _resolve(values["reward_funcs"][0])
    assert reward([[{"role": "assistant", "content": "42"}]], answer=["42"]) == [1.0]
    assert values["model_name_or_path"] == "/cache/agent-x/model"
    assert values["dataset_name"] == "/cache/agent-x/train.jsonl"


def test_config_loads_with_the_episode_keys():
    values = agent_config(WORLD)
    cfg = load_agent_config(values)
    assert (cfg.max_turns, cfg.environment_factory, cfg.tools) == (5, "asyncgrpo.toy.agent_task:LookupEnv", [])
    assert (cfg.num_generations, cfg.max_completion_length, cfg.lora_name) == (8, 24, "demo-agent")
    assert set(AGENT_KEYS) <= set(values)


def test_summary_reports_success_turns_and_tool_calls_before_and_after():
    def figures(success, turns, calls):
        row = {"success": success, "turns_mean": turns, "tool_calls_mean": calls, "tool_errors": 3, "truncated": 0}
        return {"greedy": {**row, "success": success + 0.1}, "sampled": row}

    result = summary_lines(figures(0.25, 2.0, 1.5), figures(0.75, 3.0, 2.25))
    assert result["heldout_success_before"] == 0.25 and result["heldout_success_after"] == 0.75
    assert result["gain"] == 0.5 and result["heldout_greedy_success_after"] == 0.85
    assert (result["turns_per_episode_after"], result["tool_calls_per_episode_before"]) == (3.0, 1.5)
    assert "gain" not in summary_lines(figures(0.25, 2.0, 1.5), None)


def test_cli_offers_the_agent_world(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--world", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_agent_endpoint_flag_runs_the_toy_agent_as_an_openai_function_with_the_same_episode_budget():
    from asyncgrpo.demo_agent import AGENT_FUNCTION, endpoint_config
    from asyncgrpo.toy.agent_client import MAX_TURNS, TOOLS

    values = endpoint_config(agent_config(WORLD))
    cfg = load_agent_config(values)
    assert cfg.agent_function == AGENT_FUNCTION and callable(_resolve(AGENT_FUNCTION))
    assert (cfg.environment_factory, cfg.tools, cfg.reward_funcs) == (None, [], [])  # the agent's float is the reward
    assert cfg.max_turns == MAX_TURNS and cfg.max_episode_tokens == 200 and cfg.max_completion_length == 24
    assert [t["function"]["name"] for t in TOOLS] == ["lookup"]


def test_the_toy_openai_agent_words_tool_errors_as_the_episode_runner_does():
    from asyncgrpo.toy.agent_client import _lookup
    from asyncgrpo.toy.agent_task import LookupEnv, make_agent_split

    env = LookupEnv()
    env.latency_s = 0.0
    row = make_agent_split(0)[0][0]
    env.reset(**row)
    results = [_lookup(env, "lookup") for _ in range(row["hops"] + 1)]
    assert results[-2] == f"= {row['answer']}"
    assert results[-1] == '{"error": "ChainEndedError: the chain ended at %s; answer that value"}' % row["answer"]
    assert "no tool named 'find'" in _lookup(env, "find")
