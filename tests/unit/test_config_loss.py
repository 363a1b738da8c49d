"""Config keys of the loss family, the off-policy correction and the staleness promise: TRL's names and values,
errors that name the key and the fix."""

import pytest
from fakes import cfg

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.admission import version_needed


def test_defaults_bound_the_unclipped_ratio_with_delta_3_and_keep_the_rest_of_the_loss():
    c = cfg()
    assert (c.loss_type, c.importance_sampling_level, c.scale_rewards, c.delta) == ("dapo", "token", "group", 3.0)
    assert c.vllm_importance_sampling_correction is False and c.mask_truncated_completions is False
    assert c.lr_scheduler_type == "linear" and c.num_warmup_steps == 0  # TRL's and transformers' schedule


def test_scale_rewards_takes_trls_booleans_and_names():
    assert cfg(scale_rewards=True).scale_rewards == "group"
    assert cfg(scale_rewards=False).scale_rewards == "none"
    assert cfg(scale_rewards="batch").scale_rewards == "batch"
    with pytest.raises(ConfigError, match=r"config `scale_rewards`: unknown value 'bacth'.*did you mean batch"):
        cfg(scale_rewards="bacth")


def test_scale_rewards_override_from_the_command_line():
    c = AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/a", "--scale_rewards",
                                    "false"])
    assert c.scale_rewards == "none"


@pytest.mark.parametrize("values, key, fix", [
    ({"loss_type": "dr-grpo"}, "loss_type", "did you mean dr_grpo"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level", "token, sequence"),
    ({"vllm_importance_sampling_mode": "truncate"}, "vllm_importance_sampling_mode", "token_truncate"),
    ({"loss_type": "cispo"}, "epsilon_high", "epsilon_high: 5.0"),
    ({"delta": 1.1}, "delta", "`delta: null`"),
    ({"vllm_importance_sampling_cap": 0.5}, "vllm_importance_sampling_cap", "3.0"),
    ({"lr_scheduler_type": "cosine_with_restarts"}, "lr_scheduler_type", "constant, constant_with_warmup"),
])
def test_bad_loss_keys_name_the_key_and_the_fix(values, key, fix):
    with pytest.raises(ConfigError, match=f"config `{key}`") as err:
        cfg(**values)
    assert fix in str(err.value)


def test_cispo_with_its_cap_and_gspo_are_accepted():
    assert cfg(loss_type="cispo", epsilon_high=5.0).epsilon_upper == 5.0
    assert cfg(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
    assert cfg(delta=4.0, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask")


@pytest.mark.parametrize("num_iterations", [1, 2, 3, 4])
@pytest.mark.parametrize("weight_sync_steps", [1, 2, 3, 4])
def test_max_staleness_0_is_accepted_exactly_when_every_batch_is_sampled_by_the_weights_it_trains_from(
        num_iterations, weight_sync_steps):
    """Batch b first trains at step b x num_iterations; with max_staleness 0 the producer samples it from version
    version_needed(b), which is the trainer's weights after step version_needed(b) x weight_sync_steps. Accepted
    configs must make the two the same weights for every batch; refused ones must have a batch where they differ."""
    try:
        c = cfg(max_staleness=0, num_iterations=num_iterations, weight_sync_steps=weight_sync_steps,
                save_steps=0)
    except ConfigError as err:
        assert "config `max_staleness`" in str(err) and "weight_sync_steps" in str(err)
        c = AsyncGRPOConfig.__new__(AsyncGRPOConfig)  # the same rule, unvalidated, to show the mismatch
        c.num_iterations, c.weight_sync_steps, c.max_staleness = num_iterations, weight_sync_steps, 0
        assert any(version_needed(b, c) * weight_sync_steps != b * num_iterations for b in range(12))
        return
    for b in range(12):
        assert version_needed(b, c) * weight_sync_steps == b * num_iterations, b


@pytest.mark.parametrize("values, key, fix", [
    ({"vllm_importance_sampling_clip_min": 3.0}, "vllm_importance_sampling_clip_min", "below the cap"),
    ({"vllm_importance_sampling_clip_min": -0.5}, "vllm_importance_sampling_clip_min", "0.5"),
    ({"top_entropy_quantile": 0.0}, "top_entropy_quantile", "0.2"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile", "1.0"),
    ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold", "0.5"),
    ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg", "1.05"),
    ({"loss_type": "sapoo"}, "loss_type", "did you mean sapo"),
])
def test_trls_new_knobs_are_checked_naming_the_key_and_the_fix(values, key, fix):
    with pytest.raises(ConfigError, match=f"config `{key}`") as err:
        cfg(**values)
    assert fix in str(err.value)


def test_trls_new_knobs_take_trls_defaults_except_the_bias_corrected_kl():
    c = cfg()
    assert c.vllm_importance_sampling_clip_min is None and c.off_policy_mask_threshold is None
    assert c.top_entropy_quantile == 1.0
    assert (c.sapo_temperature_pos, c.sapo_temperature_neg, c.use_bias_correction_kl) == (1.0, 1.05, False)
    c = cfg(loss_type="sapo", vllm_importance_sampling_clip_min=0.5, off_policy_mask_threshold=0.5,
            top_entropy_quantile=0.2, use_bias_correction_kl=True)
    assert (c.loss_type, c.vllm_importance_sampling_clip_min, c.top_entropy_quantile) == ("sapo", 0.5, 0.2)


def test_the_default_delta_does_not_stand_in_the_way_of_cispos_cap_or_sapo():
    assert cfg(loss_type="cispo", epsilon_high=5.0).delta == 3.0  # cispo has no clip for delta to cut into
    assert cfg(loss_type="sapo", epsilon_high=4.0).delta == 3.0
    with pytest.raises(ConfigError, match="config `delta`.*delta: null"):
        cfg(epsilon_high=2.5)  # a clip range past the default delta: set delta above it, or null
    assert cfg(epsilon_high=2.5, delta=None).delta is None


def test_sequence_level_ratios_with_a_token_sum_loss_warn_as_trl_does(caplog):
    from asyncgrpo.trainer.loss import LossSpec

    with caplog.at_level("WARNING"):
        LossSpec.from_config(cfg(importance_sampling_level="sequence"))  # dapo sums tokens
    assert "weighs each sequence by its completion length" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        LossSpec.from_config(cfg(importance_sampling_level="sequence", loss_type="grpo"))
    assert caplog.text == ""
