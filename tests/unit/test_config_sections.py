"""The config is flat for users (TRL's keys) and made of sections for the code: every key lives in exactly one section,
a section's copy holds its keys alone with the run's values, and every section's checks run in the composed config
(not only the first base's, which is what `self.check` would reach through the MRO)."""

from __future__ import annotations

import dataclasses

import pytest

from asyncgrpo.config import SECTIONS, AsyncGRPOConfig, EvalSettings, InferenceSettings, LossSettings, ModelSettings
from asyncgrpo.errors import ConfigError, ConfigErrors


def keys(kind) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]


def test_every_key_lives_in_exactly_one_section_in_the_flat_order():
    per_section = [name for section in SECTIONS for name in keys(section)]
    assert len(per_section) == len(set(per_section))
    assert per_section == keys(AsyncGRPOConfig)  # nothing of its own, and the sections' order is the keys' order


def test_a_section_copy_holds_its_keys_alone_with_the_runs_values():
    cfg = AsyncGRPOConfig(model_name_or_path="toy", epsilon=0.3, epsilon_high=0.4, vllm_request_timeout=33.0)
    loss = cfg.section(LossSettings)
    assert type(loss) is LossSettings
    assert (loss.epsilon, loss.epsilon_upper) == (0.3, 0.4)
    assert not hasattr(loss, "vllm_request_timeout")  # another section's key is not reachable from it
    inference = cfg.section(InferenceSettings)
    assert (inference.vllm_request_timeout, inference.server_urls) == (33.0, ["http://127.0.0.1:8000"])


def test_the_checks_of_the_first_and_the_last_section_both_run():
    # lora_adapter_path "" is ModelSettings' check (the last base), eval_strategy steps without eval_dataset is
    # EvalSettings' (an early base): both must be reported, each by its own section.
    with pytest.raises(ConfigErrors) as err:
        AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="", eval_strategy="steps")
    assert {e.field for e in err.value.errors} == {"lora_adapter_path", "eval_dataset"}


@pytest.mark.parametrize("section, values, field", [
    (ModelSettings, {"torch_dtype": "auto", "lora_adapter_path": "adapters"}, "torch_dtype"),
    (EvalSettings, {"eval_strategy": "epoch"}, "eval_strategy"),
    (LossSettings, {"loss_type": "ppo"}, "loss_type"),
])
def test_a_section_checks_its_own_choices_on_its_own(section, values, field):
    alone = section(**values)
    with pytest.raises(ConfigError) as err:
        section.check_all(alone)
    assert err.value.field == field
