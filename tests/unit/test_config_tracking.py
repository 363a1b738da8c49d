"""The config keys of trackers, completions tables and evaluation: defaults, and each bad combination's error."""

import pytest
from fakes import cfg

from asyncgrpo.errors import ConfigError


def test_defaults_report_to_tensorboard_and_evaluate_nothing():
    c = cfg()
    assert c.report_to == ["tensorboard"] and c.eval_strategy == "no" and not c.log_completions
    assert cfg(report_to="wandb").report_to == ["wandb"]  # one name, as TRL's YAML writes it
    assert cfg(eval_strategy="steps", eval_dataset="toy", logging_steps=3).evaluation_interval == 3
    assert cfg(eval_strategy="steps", eval_dataset="toy", eval_steps=4).evaluation_interval == 4
    assert cfg(eval_steps=4).eval_strategy == "no"  # a TRL config's eval_steps alone evaluates nothing, as in TRL
    # Without eval_dataset, evaluation takes dataset_name's `dataset_test_split` (TRL's script argument and default).
    assert cfg(eval_strategy="steps").dataset_test_split == "test"


@pytest.mark.parametrize("values,key,fix", [
    ({"report_to": ["tensorbord"]}, "report_to", "use some of tensorboard, wandb"),
    ({"eval_strategy": "epoch"}, "eval_strategy", "use steps or no"),
    ({"eval_strategy": "steps", "dataset_name": "environment", "environment_factory": "agent_tools:Counter"},
     "eval_dataset", "name held-out prompts"),
    ({"eval_dataset": "toy"}, "eval_strategy", "set `eval_strategy: steps`"),
    ({"eval_strategy": "steps", "eval_dataset": "toy", "eval_steps": 3, "weight_sync_steps": 2, "save_steps": 0},
     "eval_steps", "use a multiple of 2"),
    ({"reward_funcs": ["no_colon"]}, "reward_funcs", "a checkpoint's path"),
    ({"num_completions_to_print": 0}, "num_completions_to_print", "use 1 or more"),
])
def test_a_bad_combination_names_the_key_and_the_fix(values, key, fix):
    with pytest.raises(ConfigError) as info:
        cfg(**values)
    assert info.value.field == key and fix in str(info.value)


def test_a_reward_model_directory_is_a_valid_reward_funcs_entry(tmp_path):
    assert cfg(reward_funcs=[str(tmp_path), "asyncgrpo.toy:larger_reward"]).reward_funcs[0] == str(tmp_path)
    assert cfg(reward_funcs=[str(tmp_path)], reward_kwargs={tmp_path.name: {"batch_size": 4}})  # keyed by its name
