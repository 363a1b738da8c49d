"""A TRL GRPOConfig YAML loads as a TRL user writes it: TRL's names mean the same thing here, values asyncgrpo cannot
honour are refused one line each with the fix, every problem of a file comes in one message, and an unknown key gets
a suggestion only when it is a close look-alike."""

import re
from pathlib import Path

import pytest
from fakes import cfg

from asyncgrpo import trl_compat
from asyncgrpo.cli import main
from asyncgrpo.config import AsyncGRPOConfig, reference
from asyncgrpo.errors import ConfigError, ConfigErrors

REPO = Path(__file__).resolve().parents[2]

# What a TRL user runs with `trl grpo --config grpo.yaml` (TRL's docs and recipes: ModelConfig, ScriptArguments and
# GRPOConfig keys in one file), unchanged but for the paths.
TRL_YAML = """\
# Model arguments
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
model_revision: main
dtype: bfloat16
trust_remote_code: false
use_peft: true
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_modules: all-linear
lora_task_type: CAUSAL_LM

# Data arguments
dataset_name: {data}
reward_funcs:
- asyncgrpo.toy.larger_reward

# GRPO trainer config
bf16: true
use_vllm: true
vllm_mode: server
vllm_server_host: 0.0.0.0
vllm_server_port: 8000
vllm_server_timeout: 240
vllm_gpu_memory_utilization: 0.7
vllm_importance_sampling_correction: true
vllm_importance_sampling_mode: token_truncate
vllm_importance_sampling_clip_max: 2.0
do_eval: false
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
learning_rate: 1.0e-05
log_level: info
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
warmup_steps: 0.1
max_prompt_length: 512
max_completion_length: 1024
max_steps: -1
num_generations: 8
num_train_epochs: 1
optim: adamw_torch
adam_epsilon: 1.0e-08
output_dir: {out}
overwrite_output_dir: true
per_device_train_batch_size: 16
push_to_hub: false
remove_unused_columns: false
resume_from_checkpoint: false
save_strategy: steps
save_steps: 50
save_total_limit: 2
seed: 42
temperature: 1.0
top_k: 0
repetition_penalty: 1.0
beta: 0.0
loss_type: dapo
scale_rewards: true
mask_truncated_completions: true
"""


def load_trl(tmp_path, extra: str = "") -> AsyncGRPOConfig:
    path = tmp_path / "grpo.yaml"
    text = TRL_YAML.format(data=tmp_path / "train.jsonl", out=tmp_path / "out") + extra
    path.write_text(text.replace("overwrite_output_dir: true\n", ""))  # an unsupported key, tested below
    return AsyncGRPOConfig.load(path)


def test_a_trl_grpo_yaml_loads_as_written_with_every_key_meaning_what_it_means_in_trl(tmp_path):
    c = load_trl(tmp_path)
    assert (c.use_lora, c.torch_dtype, c.lora_r, c.lora_alpha) == (True, "bfloat16", 16, 32.0)
    assert c.lora_target_modules == ["all-linear"]  # lora.py hands PEFT the word itself
    assert c.vllm_server_base_url == "http://127.0.0.1:8000"  # TRL's host 0.0.0.0 is this machine
    assert c.vllm_importance_sampling_cap == 2.0  # TRL's new name for the cap
    assert c.reward_funcs == ["asyncgrpo.toy:larger_reward"]  # TRL's dotted path
    assert (c.num_train_epochs, c.warmup_steps, c.save_steps, c.resume_from_checkpoint) == (1.0, 0.1, 50, None)
    assert c.lora_adapter_path == str(tmp_path / "out" / "adapters")  # TRL files have no such key
    assert (c.gradient_accumulation_steps, c.seed, c.scale_rewards) == (2, 42, "group")


def test_trl_keys_asyncgrpo_has_no_equivalent_for_are_named_without_a_wrong_suggestion(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML.format(data=tmp_path / "t.jsonl", out=tmp_path) + "per_device_eval_batch_size: 8\n")
    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig.load(path)
    assert [e.field for e in err.value.errors] == ["overwrite_output_dir", "per_device_eval_batch_size"]
    assert "did you mean" not in str(err.value) and "no equivalent" in str(err.value)


@pytest.mark.parametrize("trl,value,ours,expected", [
    ("use_peft", True, "use_lora", True),
    ("dtype", "bfloat16", "torch_dtype", "bfloat16"),
    ("model_init_kwargs", {"dtype": "float16"}, "torch_dtype", "float16"),
    ("bf16", True, "torch_dtype", "bfloat16"),
    ("fp16", True, "torch_dtype", "float16"),
    ("bf16", False, "torch_dtype", "float32"),
    ("vllm_importance_sampling_clip_max", 5.0, "vllm_importance_sampling_cap", 5.0),
    ("vllm_importance_sampling_cap", 5.0, "vllm_importance_sampling_cap", 5.0),  # the old name is kept
    ("resume_from_checkpoint", True, "resume_from_checkpoint", "latest"),
    ("resume_from_checkpoint", False, "resume_from_checkpoint", None),
    ("vllm_server_port", 8123, "vllm_server_base_url", "http://127.0.0.1:8123"),
    ("reward_funcs", ["accuracy_reward"], "reward_funcs", ["trl.rewards:accuracy_reward"]),
    ("reward_funcs", "my_lib.rewards.fn", "reward_funcs", ["my_lib.rewards:fn"]),
])
def test_each_trl_name_sets_the_key_of_the_same_meaning(trl, value, ours, expected):
    assert getattr(cfg(**{trl: value}), ours) == expected


def test_save_strategy_steps_takes_save_steps_or_transformers_default_and_no_turns_saving_off():
    assert cfg(save_strategy="steps", save_steps=20).save_steps == 20
    assert cfg(save_strategy="steps").save_steps == 500
    assert cfg(save_strategy="no", save_steps=20).save_steps == 0
    with pytest.raises(ConfigError) as err:
        cfg(save_strategy="epoch")
    assert err.value.field == "save_strategy" and "save_strategy: steps" in str(err.value)


def test_num_train_epochs_runs_unless_max_steps_is_given_and_counts_steps_from_the_rows():
    assert cfg(num_train_epochs=2).num_train_epochs == 2.0
    assert cfg(num_train_epochs=2, max_steps=-1).num_train_epochs == 2.0
    given = cfg(num_train_epochs=2, max_steps=7)  # transformers: max_steps wins
    assert (given.num_train_epochs, given.max_steps) == (None, 7)
    with pytest.raises(ConfigError, match="num_train_epochs is not set"):
        cfg(max_steps=-1)
    # 1.5 epochs of 100 prompts, 8 prompts per step (64 completions / 8 x 1 rank), each batch trained twice
    c = cfg(num_train_epochs=1.5, per_device_train_batch_size=64, num_iterations=2, save_steps=0)
    assert c.steps_for_epochs(rows=100, world_size=1) == 38  # ceil(1.5 x 100 x 2 / 8) = ceil(37.5)
    assert c.steps_for_epochs(rows=100, world_size=2) == 19  # twice the prompts per step


def test_warmup_steps_below_one_is_a_fraction_of_max_steps():
    assert cfg(lr_scheduler_type="linear", warmup_steps=0.1, max_steps=25).num_warmup_steps == 3  # ceil(2.5)
    assert cfg(lr_scheduler_type="linear", warmup_steps=4.0, max_steps=25).num_warmup_steps == 4
    assert cfg(lr_scheduler_type="linear", warmup_ratio=0.2, max_steps=25).num_warmup_steps == 5


def test_all_linear_reaches_peft_as_its_shorthand():
    from types import SimpleNamespace

    import torch

    from asyncgrpo.lora import lora_config

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert lora_config(cfg(lora_target_modules="all-linear"), model).target_modules == "all-linear"
    assert lora_config(SimpleNamespace(**{**vars(cfg()), "lora_target_modules": ["q_proj"]}),
                       model).target_modules == {"q_proj"}


@pytest.mark.parametrize("key,value,words", [
    ("use_vllm", False, "always generates on vLLM servers"),
    ("vllm_mode", "colocate", "cannot run vLLM inside the training processes"),
    ("top_k", 50, "full distribution"),
    ("optim", "adafactor", "AdamW"),
    ("push_to_hub", True, "hf upload"),
    ("use_dora", True, "DoRA"),
])
def test_a_value_asyncgrpo_cannot_honour_is_one_line_saying_why_and_what_to_use(key, value, words):
    with pytest.raises(ConfigError) as err:
        cfg(**{key: value})
    assert err.value.field == key and words in str(err.value) and "Fix:" in str(err.value)
    assert "\n" not in str(err.value)


def test_harmless_trl_keys_are_accepted_whatever_their_value():
    assert cfg(vllm_gpu_memory_utilization=0.9, vllm_tensor_parallel_size=4, do_train=True, log_level="debug",
               use_vllm=True, vllm_mode="server").vllm_server_base_url == "http://127.0.0.1:8000"


def test_bf16_beside_another_dtype_is_an_error_naming_both_ways_out():
    with pytest.raises(ConfigError) as err:
        cfg(bf16=True, dtype="float32")
    assert err.value.field == "bf16" and "`dtype: bfloat16`" in str(err.value) and "`bf16: false`" in str(err.value)
    with pytest.raises(ConfigError, match="both true"):
        cfg(bf16=True, fp16=True)
    with pytest.raises(ConfigError, match="keep one of them"):
        cfg(use_peft=True, use_lora=False)


def test_every_problem_of_a_file_comes_in_one_message(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: toy\nuse_vllm: false\nvllm_mode: colocate\nlearning_rat: 1e-5\n"
                    "max_steps: ten\n"
                    "num_generations: 1\nloss_type: ppo\nsync_mode: later\n")
    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig.load(path)
    fields = [e.field for e in err.value.errors]
    assert fields == ["use_vllm", "vllm_mode", "learning_rat", "max_steps", "num_generations"], fields
    assert "did you mean `learning_rate`?" in str(err.value)
    # once the values are right, every group of cross-field checks reports too
    path.write_text("model_name_or_path: toy\nloss_type: ppo\nsync_mode: later\nper_device_train_batch_size: 12\n")
    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig.load(path)
    assert [e.field for e in err.value.errors] == ["per_device_train_batch_size", "loss_type", "sync_mode"]


@pytest.mark.parametrize("key", ["num_train_epoch", "per_device_eval_batch_size", "eval_on_start", "vllm_server_url_x"])
def test_an_unknown_key_gets_no_suggestion_of_another_meaning(key):
    with pytest.raises(ConfigError) as err:
        cfg(**{key: 1})
    message = str(err.value)
    suggested = re.search(r"did you mean `(\w+)`", message)
    assert suggested is None or suggested.group(1) == "num_train_epochs", message


def test_train_help_lists_every_key_with_its_type_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name, kind, default, _ in reference():
        assert f"--{name} {kind} (default: {default})" in out
    assert "--warmup_steps float (default: 0)" in out and "--num_train_epochs float | None (default: None)" in out


def test_the_configuration_page_lists_every_trl_key_the_layer_reads():
    page = (REPO / "docs" / "configuration.md").read_text().split("## Every key")[0]
    keys = [*trl_compat.ALIASES, *trl_compat.AGREEING, *trl_compat.IGNORED, "save_strategy", "num_train_epochs",
            "bf16", "fp16", "model_init_kwargs", "vllm_server_host", "vllm_server_port", *trl_compat.TRL_REWARDS,
            "env", "max_tool_calling_iterations"]
    assert [k for k in keys if f"`{k}" not in page] == []


def test_no_key_this_project_reads_is_listed_as_a_trl_key_without_an_equivalent():
    import dataclasses

    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.trl_compat import TRL_ONLY

    assert TRL_ONLY.isdisjoint({f.name for f in dataclasses.fields(AsyncGRPOConfig)} | {"max_tool_calling_iterations"})


@pytest.mark.parametrize("model", ["/nfs/rm.v2/ckpt", "Skywork/Skywork-Reward-V2-Qwen3-0.6B"])
def test_a_reward_model_path_or_hub_id_with_a_dot_is_kept_as_written(model):
    funcs = cfg(reward_funcs=["asyncgrpo.rewards.math_accuracy", model]).reward_funcs
    assert funcs == ["asyncgrpo.rewards:math_accuracy", model]


def test_a_reward_model_directory_named_like_a_module_path_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rm.v2").mkdir()
    assert cfg(reward_funcs=["rm.v2"]).reward_funcs == ["rm.v2"]


@pytest.mark.parametrize("ref", ["/nfs/rm:v2/ckpt", "Skywork/Skywork-Reward-V2-Qwen3-0:6B", "my-lib:fn"])
def test_a_reward_function_reference_that_is_no_python_name_is_refused(ref):
    with pytest.raises(ConfigError) as err:
        cfg(reward_funcs=[ref])
    assert err.value.field == "reward_funcs" and ref in str(err.value)
