"""A dataset path that does not exist is reported as a missing file, not as a hub access problem."""

import os

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import _load_split
from asyncgrpo.errors import ConfigError


@pytest.mark.parametrize("name", ["data/train.jsonl", "./prompts", "../elsewhere/train.parquet"])
def test_a_missing_relative_dataset_path_is_a_missing_file_with_its_resolved_path(tmp_path, name):
    cfg = AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters",
                                     "dataset_name": name,
                                     "reward_funcs": ["asyncgrpo.rewards:math_accuracy"]})
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError) as error:
            _load_split(cfg)
    finally:
        os.chdir(cwd)
    message = str(error.value)
    assert message.startswith(f"config `dataset_name`: file {name!r} does not exist (resolved to "
                              f"{str(tmp_path / name)!r}")
    assert "hub" not in message
