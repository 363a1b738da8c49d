import dataclasses
from pathlib import Path

import pytest
from fakes import cfg

from asyncgrpo.config import AsyncGRPOConfig, field_docs, reference_markdown
from asyncgrpo.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_unset_adapter_path_is_under_output_dir_and_an_empty_one_names_the_fix():
    assert cfg(output_dir="/tmp/run7", lora_adapter_path=None).lora_adapter_path == "/tmp/run7/adapters"
    with pytest.raises(ConfigError) as err:
        cfg(use_lora=True, lora_adapter_path="")
    assert err.value.field == "lora_adapter_path"
    assert "set lora_adapter_path" in str(err.value)


def test_unknown_key_suggests_the_close_match():
    with pytest.raises(ConfigError) as err:
        cfg(learning_rat=1e-3)
    assert err.value.field == "learning_rat"
    assert "did you mean `learning_rate`" in str(err.value)


def test_wrong_type_names_field_and_expected_type():
    with pytest.raises(ConfigError) as err:
        cfg(max_steps="ten")
    assert err.value.field == "max_steps"
    assert "expected an integer, got 'ten'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        cfg(use_lora="yes")
    assert "expected true or false" in str(err.value)


def test_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError) as err:
        cfg(per_device_train_batch_size=12, num_generations=8)
    assert err.value.field == "per_device_train_batch_size"
    assert "multiple of 8" in str(err.value)


@pytest.mark.parametrize("key,value,field", [
    ("max_staleness", -1, "max_staleness"), ("num_generations", 1, "num_generations"),
    ("sync_pause_mode", "later", "sync_pause_mode"), ("temperature", 0.0, "temperature"),
    ("reward_funcs", ["no_colon"], "reward_funcs"), ("vllm_server_base_url", "localhost:8000", "vllm_server_base_url"),
])
def test_bad_values_name_their_field(key, value, field):
    with pytest.raises(ConfigError) as err:
        cfg(**{key: value})
    assert err.value.field == field
    assert "Fix:" in str(err.value)


def test_yaml_file_plus_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: toy\nlora_adapter_path: /tmp/a\nlearning_rate: 1e-5\nmax_steps: 7\n")
    config = AsyncGRPOConfig.load(path, ["--max_steps", "9", "--learning_rate=3e-4",
                                      "--lora_target_modules", "q_proj,v_proj", "--epsilon_high", "0.28"])
    assert config.max_steps == 9
    assert config.learning_rate == pytest.approx(3e-4)
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.epsilon_upper == pytest.approx(0.28)
    assert AsyncGRPOConfig.load(path).learning_rate == pytest.approx(1e-5)  # YAML reads 1e-5 as a string


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        AsyncGRPOConfig.load(tmp_path / "nope.yaml")


def test_api_key_comes_from_the_environment_and_is_never_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_VLLM_API_KEY", "s3cret-key")
    config = cfg()
    assert config.api_key == "s3cret-key"
    config.save(tmp_path / "saved.yaml")
    assert "s3cret-key" not in (tmp_path / "saved.yaml").read_text()


def test_every_field_is_documented():
    docs = field_docs()
    names = [f.name for f in dataclasses.fields(AsyncGRPOConfig)]
    assert sorted(docs) == sorted(names)
    assert all(len(d) > 10 for d in docs.values())


def test_shipped_configs_validate():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        config = AsyncGRPOConfig.load(path)
        assert config.use_lora and config.lora_adapter_path


def test_configuration_page_documents_every_config_key():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert reference_markdown() in page  # regenerate: python scripts/update_readme_config.py
    assert "(docs/configuration.md)" in (REPO / "README.md").read_text()  # the front door links it


def test_num_iterations_must_be_positive_and_checkpoints_fall_between_batches():
    with pytest.raises(ConfigError) as err:
        cfg(num_iterations=0)
    assert err.value.field == "num_iterations"
    with pytest.raises(ConfigError) as err:
        cfg(num_iterations=3, save_steps=4)
    assert err.value.field == "save_steps"
    assert "not a multiple of num_iterations (3)" in str(err.value) and "use a multiple of 3" in str(err.value)
    assert cfg(num_iterations=3, weight_sync_steps=3, save_steps=6).save_steps == 6


def test_unset_max_inflight_requests_is_sized_from_batch_staleness_and_servers():
    assert cfg(max_staleness=0).inflight_requests(groups_per_step=32) == 32  # one step: nothing may run ahead
    assert cfg(max_staleness=1).inflight_requests(groups_per_step=32) == 64  # the next step's groups too
    assert cfg(max_staleness=3).inflight_requests(groups_per_step=32) == 64  # never more than two steps' worth
    servers = ",".join(f"http://10.0.0.{i}:8000" for i in range(1, 5))
    assert cfg(max_staleness=0, vllm_server_base_url=servers).inflight_requests(groups_per_step=2) == 8  # 2 each
    assert cfg(max_inflight_requests=5).inflight_requests(groups_per_step=32) == 5  # set: taken as it is
    with pytest.raises(ConfigError) as err:
        cfg(max_inflight_requests=0)
    assert err.value.field == "max_inflight_requests"


def test_groups_per_step_counts_every_rank_and_micro_step():
    config = cfg(per_device_train_batch_size=32, gradient_accumulation_steps=2, num_generations=8)
    assert config.groups_per_step(world_size=2) == 16  # 32 completions x 2 micro-steps x 2 ranks / 8 per group
