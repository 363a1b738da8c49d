"""Attacks on the config file: values that are out of range, not finite, names that leave the adapter directory or
break a server, and URLs that carry credentials. Each is refused naming its key (and never echoing a password);
several at once are all reported in one error; good values pass."""

from __future__ import annotations

import typing

import pytest

from asyncgrpo.config import VALUE_RANGES, AsyncGRPOConfig
from asyncgrpo.errors import ConfigError, ConfigErrors

BAD = [
    ("learning_rate", "-1"), ("learning_rate", ".nan"), ("adam_beta1", "1.5"), ("lora_dropout", "1.5"),
    ("epsilon", ".nan"), ("temperature", ".inf"), ("vllm_request_timeout", "0"), ("vllm_request_timeout", "-1"),
    ("vllm_server_timeout", "-.inf"), ("reward_timeout", "0"), ("ddp_timeout", "0"), ("max_grad_norm", "-1"),
    ("beta", ".nan"), ("reward_weights", "[1.0, .nan]"), ("lora_name", '"../../x y"'), ("lora_name", '".hidden"'),
    ("lora_name", '"-flag"'), ("lora_name", '"a/b"'), ("vllm_server_base_url", '"http://user:hunter2@10.0.0.5:8000"'),
    ("adapter_receiver_url", '["http://:hunter2@10.0.0.5:8001"]'), ("vllm_server_base_url", '"http://10.0.0.5:99999"'),
]


def load(tmp_path, body: str) -> AsyncGRPOConfig:
    path = tmp_path / "attack.yaml"
    path.write_text(f"model_name_or_path: toy\nlora_adapter_path: {tmp_path / 'adapters'}\n{body}")
    return AsyncGRPOConfig.load(path)


@pytest.mark.parametrize("key, value", BAD)
def test_a_bad_value_is_refused_naming_its_key_and_never_the_password(tmp_path, key, value):
    extra = "adapter_delivery: http\n" if key == "adapter_receiver_url" else ""
    with pytest.raises(ConfigError) as error:
        load(tmp_path, f"{extra}{key}: {value}\n")
    assert error.value.field == key
    assert str(error.value).startswith(f"config `{key}`: ") and "Fix: " in str(error.value)
    assert "hunter2" not in str(error.value)


def test_a_url_with_credentials_names_the_environment_variables_to_use_instead(tmp_path):
    with pytest.raises(ConfigError) as error:
        load(tmp_path, 'vllm_server_base_url: "http://user:hunter2@10.0.0.5:8000"\n')
    assert "'http://***@10.0.0.5:8000'" in str(error.value)
    assert "ASYNCGRPO_VLLM_API_KEY" in str(error.value) and "ASYNCGRPO_ROLLOUT_KEY" in str(error.value)


def test_every_bad_value_of_a_file_is_reported_at_once_one_line_each(tmp_path):
    with pytest.raises(ConfigErrors) as error:
        load(tmp_path, "learning_rate: -1\nadam_beta1: 1.5\ntemperature: .inf\nlora_name: ../../x y\n")
    assert [e.field for e in error.value.errors] == ["temperature", "learning_rate", "adam_beta1", "lora_name"]
    assert error.value.field == "temperature"  # the first, for code that reads one key
    lines = str(error.value).splitlines()
    assert lines[0] == "4 config values are wrong:" and len(lines) == 5
    assert lines[1].startswith("  config `temperature`: is inf, not a finite number. Fix: ")
    assert lines[2].startswith("  config `learning_rate`: is -1.0, but must be > 0. Fix: ")
    assert lines[3].startswith("  config `adam_beta1`: is 1.5, but must be >= 0 and < 1. Fix: ")
    assert lines[4].startswith("  config `lora_name`: '../../x y' is not a name")


def test_good_values_at_the_edges_of_their_ranges_pass(tmp_path):
    config = load(tmp_path, "learning_rate: 1e-5\nadam_beta1: 0.0\nlora_dropout: 0.0\nepsilon: 0.2\n"
                  "temperature: 0.7\nvllm_request_timeout: 0.5\nlora_name: my-policy_v1.2\nmax_grad_norm: 0\n"
                  "vllm_server_base_url: https://vllm.internal:8443/\nreward_weights: [1.0, -0.5]\n"
                  "reward_funcs: [asyncgrpo.toy:larger_reward, asyncgrpo.rewards:length_penalty]\n")
    assert (config.learning_rate, config.adam_beta1, config.lora_name) == (1e-5, 0.0, "my-policy_v1.2")
    assert config.server_urls == ["https://vllm.internal:8443/"]


def types_in(hint) -> set:
    """Every type a hint names, through unions and lists: `list[float] | None` -> {list, float, NoneType}."""
    args = typing.get_args(hint)
    return {typing.get_origin(hint) or hint}.union(*(types_in(a) for a in args)) if args else {hint}


def test_every_numeric_key_has_a_range():
    hints = typing.get_type_hints(AsyncGRPOConfig)
    numeric = {name for name, hint in hints.items() if types_in(hint) & {int, float}}
    assert {"learning_rate", "reward_weights", "ddp_timeout", "max_prompt_length"} <= numeric  # the walk finds them
    assert numeric == set(VALUE_RANGES)
