"""`asyncgrpo check` validates without training (every problem at once, or the resolved config); every default that
differs from TRL's is listed with its reason, and a config written for TRL is told, once at start, which of them it
left out."""

import dataclasses

import pytest
import yaml

from asyncgrpo import trl_compat
from asyncgrpo.cli import main
from asyncgrpo.config import AsyncGRPOConfig, defaults, trl_notice
from asyncgrpo.errors import ConfigError

# TRL's defaults (GRPOConfig and ModelConfig of TRL 1.x) for the keys asyncgrpo reads under the same meaning; the keys
# transformers' TrainingArguments holds are read from the installed transformers below, with TRL's overrides.
TRL_GRPO = {
    "num_generations": 8, "num_generations_eval": None, "max_completion_length": 512, "temperature": 1.0,
    "top_p": 1.0, "chat_template_kwargs": None, "vllm_server_timeout": 240.0, "beta": 0.0, "num_iterations": 1,
    "epsilon": 0.2, "delta": None, "epsilon_high": None, "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0,
    "importance_sampling_level": "token", "reward_weights": None, "scale_rewards": "group", "loss_type": "dapo",
    "mask_truncated_completions": False, "top_entropy_quantile": 1.0, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_cap": 3.0,
    "vllm_importance_sampling_clip_min": None, "off_policy_mask_threshold": None, "use_bias_correction_kl": False,
    "log_completions": False, "num_completions_to_print": None, "use_lora": False, "lora_r": 16, "lora_alpha": 32,
    "lora_dropout": 0.05, "lora_target_modules": None, "dataset_config": None, "dataset_train_split": "train",
    # TRL's overrides of TrainingArguments (GRPOConfig's note), and bf16 on by default, which is our torch_dtype
    "learning_rate": 1e-6, "logging_steps": 10, "gradient_checkpointing": True, "torch_dtype": "bf16 autocast",
}


def trl_default(key, ta):
    if key in TRL_GRPO:
        return TRL_GRPO[key]
    if key == "max_steps":  # -1: the epochs
        return ta["num_train_epochs"]
    return ta.get(key, "no TRL default")


def test_every_default_that_differs_from_trls_is_listed_with_a_reason_and_no_other():
    from transformers import TrainingArguments

    ta = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    ours = defaults()
    compared = [k for k in ours if k in TRL_GRPO or k in ta or k == "max_steps"]
    differ = {k for k in compared if trl_default(k, ta) != ours[k]}
    differ -= {"num_train_epochs", "warmup_ratio"}  # the epochs are max_steps' entry; warmup_ratio: 0 in both
    assert differ == set(trl_compat.TRL_DEFAULTS)
    assert all(len(entry.why) > 20 for entry in trl_compat.TRL_DEFAULTS.values())


def test_a_trl_config_is_told_the_defaults_it_left_out_and_ours_is_told_nothing():
    trl = {"model_name_or_path": "toy", "use_peft": True, "bf16": True, "seed": 42, "save_strategy": "no"}
    notice = trl_notice(trl)
    assert "learning_rate: 1e-05 (TRL: `1e-6`)" in notice and "gradient_checkpointing" in notice
    for given in ("seed", "torch_dtype", "use_lora", "save_steps"):  # set, under our name or TRL's
        assert f"\n  {given}:" not in notice, given
    assert trl_notice({"model_name_or_path": "toy", "seed": 42}) is None  # a config of ours


def _trl_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("model_name_or_path: toy\nuse_peft: true\nbf16: true\nlearning_rate: 1.0e-5\n"
                    f"output_dir: {tmp_path / 'out'}\n")
    return path


def test_check_prints_the_resolved_config_and_a_trl_files_defaults(tmp_path, capsys):
    assert main(["check", "--config", str(_trl_file(tmp_path)), "--max_steps", "7", "--no_use_peft", "--use_peft"]) == 0
    out, err = capsys.readouterr()
    resolved = yaml.safe_load(out)
    assert (resolved["max_steps"], resolved["torch_dtype"], resolved["reward_funcs"]) == (
        7, "bfloat16", ["asyncgrpo.toy:larger_reward"])
    assert AsyncGRPOConfig.from_dict(resolved).to_dict() == resolved  # what check prints loads as it is
    assert "is valid" in err and "gradient_checkpointing: False (TRL: `true`)" in err and "learning_rate:" not in err


def test_check_reports_every_problem_at_once_and_exits_nonzero(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("dataset_name: openai/gsm8k\nlearning_rat: 1e-5\nnum_generations: 1\n")
    assert main(["check", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    for key in ("model_name_or_path", "reward_funcs", "learning_rat", "num_generations"):
        assert f"config `{key}`" in err, key
    assert "4 problems" in err


def test_check_imports_what_the_config_names(tmp_path, capsys):
    code = main(["check", "--model_name_or_path", "toy", "--reward_funcs", "no_such_module_xyz:fn",
                 "--environment_factory", "agent_tools:no_such_environment"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and "config `environment_factory`" in err and "2 problems" in err


@pytest.mark.parametrize("rank,told", [("0", 1), ("1", 0)])
def test_train_tells_a_trl_config_its_defaults_once_on_rank_0_before_the_trainer_is_built(
        tmp_path, capsys, monkeypatch, rank, told):
    import asyncgrpo.trainer.recipe as recipe

    class Stop:
        def __init__(self, cfg, **kwargs):
            raise ConfigError("stop", "the test stops here", "none")

    monkeypatch.setattr(recipe, "GRPORecipe", Stop)
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--config", str(_trl_file(tmp_path))]) == 2
    assert capsys.readouterr().err.count("take asyncgrpo's defaults, not TRL's") == told
