"""Command-line overrides take TRL's forms, with transformers' HfArgumentParser as the reference: a boolean key alone
is true and `--no_key` false, a list key takes several values, `--a-b` is `--a_b`; a mistake names the key."""

from dataclasses import dataclass, field

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import AsyncGRPOConfig, parse_overrides
from asyncgrpo.errors import ConfigError

TOY = ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/adapters"]


def test_a_bare_boolean_before_another_key_is_true():
    config = AsyncGRPOConfig.load(None, [*TOY, "--use_peft", "--max_steps", "5", "--seeded_generation"])
    assert (config.use_lora, config.max_steps, config.seeded_generation) == (True, 5, True)


def test_a_list_key_takes_space_separated_values():
    config = AsyncGRPOConfig.load(None, [*TOY, "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "3"])
    assert (config.lora_target_modules, config.max_steps) == (["q_proj", "v_proj"], 3)
    servers = AsyncGRPOConfig.load(None, [*TOY, "--vllm_server_base_url", "http://10.0.0.1:8000",
                                          "http://10.0.0.2:8000"])
    assert servers.server_urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    trl = AsyncGRPOConfig.load(None, [*TOY, "--reward_funcs", "accuracy_reward", "think_format_reward"])
    assert trl.reward_funcs == ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"]


def test_trls_boolean_keys_and_spellings_are_read():
    config = AsyncGRPOConfig.load(None, [*TOY, "--bf16", "--use_vllm", "--no_publish_in_background",
                                         "--per-device-train-batch-size", "16", "--seeded_generation", "yes"])
    assert (config.torch_dtype, config.publish_in_background, config.per_device_train_batch_size,
            config.seeded_generation) == ("bfloat16", False, 16, True)


@dataclass
class _Reference:
    """A few keys of each kind, as HfArgumentParser reads them."""

    use_peft: bool = False
    publish_in_background: bool = True
    max_steps: int = 100
    lora_target_modules: list[str] = field(default_factory=list)
    per_device_train_batch_size: int = 8


@pytest.mark.parametrize("argv", [
    ["--use_peft", "--max_steps", "5"],
    ["--use_peft", "false", "--lora_target_modules", "q_proj", "v_proj"],
    ["--no_publish_in_background", "--per-device-train-batch-size", "16"],
    ["--max_steps=7", "--use_peft", "yes", "--publish_in_background", "0"],
])
def test_overrides_read_as_hf_argument_parser_reads_them(argv):
    from transformers import HfArgumentParser

    (expected,) = HfArgumentParser(_Reference).parse_args_into_dataclasses(argv)
    ours = parse_overrides(argv)
    assert {k: v for k, v in vars(expected).items() if k in ours} == ours


@pytest.mark.parametrize("argv,key,words", [
    (["--max_steps"], "max_steps", "has no value"),
    (["--max_steps", "5", "6"], "max_steps", "takes one value"),
    (["--use_peft", "maybe"], "use_peft", "expected true or false"),
    (["--no_use_peft", "true"], "no_use_peft", "takes no value"),
    (["max_steps", "5"], "max_steps", "is not an override"),
])
def test_a_malformed_override_names_its_key_and_the_form_to_use(argv, key, words):
    with pytest.raises(ConfigError) as err:
        parse_overrides(argv)
    assert err.value.field == key and words in str(err.value) and "Fix:" in str(err.value)


def test_train_reads_a_trl_command_line_up_to_the_config_check(tmp_path, capsys):
    # what a TRL user types; it gets as far as the config: the unknown key is the only complaint
    code = main(["train", "--model_name_or_path", "toy", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
                 "--max_steps", "5", "--bf16", "--output_dir", str(tmp_path), "--not_a_key", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "config `not_a_key`: unknown key" in err and "1 config" not in err and "is not an override" not in err


def test_a_trl_files_env_mapping_is_accepted_and_set_by_train(tmp_path, monkeypatch, capsys):
    import os

    import asyncgrpo.trainer.recipe as recipe

    seen = {}

    class Stop:
        def __init__(self, cfg, **kwargs):
            seen["value"] = os.environ.get("ASYNCGRPO_TEST_ENV")
            raise ConfigError("stop", "the test stops here", "none")

    monkeypatch.setattr(recipe, "GRPORecipe", Stop)
    monkeypatch.delenv("ASYNCGRPO_TEST_ENV", raising=False)
    path = tmp_path / "grpo.yaml"
    path.write_text("model_name_or_path: toy\nenv:\n  ASYNCGRPO_TEST_ENV: offline\n")
    assert main(["train", "--config", str(path)]) == 2
    assert seen == {"value": "offline"}
    monkeypatch.delenv("ASYNCGRPO_TEST_ENV", raising=False)
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "env": ["A=1"]})
    assert err.value.field == "env"
