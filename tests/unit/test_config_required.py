"""No silent defaults: a run names its model, its prompts and its reward, or chooses the toy world in so many words
(`model_name_or_path: toy`, `dataset_name: toy`); a key left out is an error naming it and the fix, together with
every other problem of the file."""

import pytest
from fakes import cfg

from asyncgrpo.config import TOY_REWARD, AsyncGRPOConfig
from asyncgrpo.errors import ConfigError, ConfigErrors


def load(tmp_path, text: str) -> AsyncGRPOConfig:
    path = tmp_path / "run.yaml"
    path.write_text(f"lora_adapter_path: {tmp_path / 'adapters'}\n{text}")
    return AsyncGRPOConfig.load(path)


def test_a_gsm8k_config_without_reward_funcs_is_refused_not_trained_on_the_toy_reward(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: openai/gsm8k\n")
    assert err.value.field == "reward_funcs" and "is required" in str(err.value)
    assert "reward_funcs: [asyncgrpo.rewards:math_accuracy]" in str(err.value)


def test_each_missing_key_is_named_with_its_fix_beside_the_files_other_problems(tmp_path):
    with pytest.raises(ConfigErrors) as err:
        load(tmp_path, "learning_rat: 1e-5\n")
    assert [e.field for e in err.value.errors] == ["model_name_or_path", "dataset_name", "reward_funcs",
                                                    "learning_rat"]
    message = str(err.value)
    assert "`model_name_or_path: toy`" in message and "`dataset_name: toy`" in message


def test_a_model_without_prompts_names_dataset_name(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "model_name_or_path: /models/qwen\nreward_funcs: [asyncgrpo.rewards:math_accuracy]\n")
    assert err.value.field == "dataset_name"


def test_the_toy_world_is_chosen_by_naming_it():
    def named(**values):
        return AsyncGRPOConfig.from_dict({"lora_adapter_path": "/tmp/adapters", **values})

    toy = named(model_name_or_path="toy")
    assert (toy.dataset_name, toy.reward_funcs) == ("toy", [TOY_REWARD])
    shaped = named(model_name_or_path="shape:qwen2.5-1.5b", dataset_name="toy")  # a real shape on the toy's prompts
    assert shaped.reward_funcs == [TOY_REWARD]
    own = named(model_name_or_path="toy", reward_funcs=["asyncgrpo.rewards:format_reward"])
    assert own.reward_funcs == ["asyncgrpo.rewards:format_reward"]


def test_an_environment_may_bring_the_reward_and_one_without_get_reward_is_refused_where_it_is_loaded():
    from asyncgrpo.rollout.build import make_group_scorer

    env = cfg(model_name_or_path="/models/qwen", dataset_name="rows.jsonl", environment_factory="agent_tools:Counter")
    assert env.reward_funcs == [] and env.task_problems() == []
    no_reward = cfg(model_name_or_path="/models/qwen", dataset_name="rows.jsonl",
                    environment_factory="agent_tools:NoReward")
    with pytest.raises(ConfigError) as err:
        make_group_scorer(no_reward, tokenizer=None, response_template=None)
    assert err.value.field == "reward_funcs" and "get_reward()" in str(err.value)


def test_a_config_built_in_code_may_wait_for_its_model_but_the_trainer_refuses_it_without():
    from asyncgrpo.trainer.recipe import GRPORecipe

    config = AsyncGRPOConfig(lora_adapter_path="/tmp/adapters")  # TRL style: the model comes with the trainer
    assert [e.field for e in config.task_problems()] == ["model_name_or_path", "dataset_name", "reward_funcs"]
    with pytest.raises(ConfigErrors):
        GRPORecipe(config)
