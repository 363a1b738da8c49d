"""Malformed YAML, in a config file or in a `--key value` override, is a ConfigError naming where it is broken
(the CLI prints it as one `asyncgrpo: error:` line), not a PyYAML traceback."""

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError


def test_a_config_file_that_is_not_yaml_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("learning_rate: 1e-5\n  lora_r: 8\n")  # the second line is indented under a scalar
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig.load(path)
    assert err.value.field == "--config"
    assert str(path) in str(err.value) and "line 2, column 9" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no PyYAML traceback chained


def test_an_override_that_is_not_yaml_names_the_key_and_how_to_quote_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", str(tmp_path),
                                    "--reward_kwargs", "{a: [1"])
    assert err.value.field == "reward_kwargs"
    assert "'{a: [1'" in str(err.value) and "--reward_kwargs '{name: value}'" in str(err.value)


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("max_steps: [1\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncgrpo: error: config `--config`:") and "Traceback" not in err
