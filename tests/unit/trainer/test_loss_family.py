"""The GRPO loss family (loss_type, GSPO, delta, CISPO), the off-policy correction and the safety clamp, each against
numbers worked out by hand from the formula (written out in the comments), not recomputed with the same code."""

import logging
import math

import pytest
import torch
from advantage_reference import group_advantages

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.trainer.loss import LOG_RATIO_BOUND, LossSpec, grpo_loss, importance_weights, loss_normaliser

EPS = dict(epsilon_low=0.2, epsilon_high=0.2)


# ---- safety --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("behaviour", [-math.inf, -100.0])
def test_absurd_behaviour_logprob_on_a_zero_advantage_token_gives_no_nan(behaviour):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[behaviour, -2.0]])
    terms = grpo_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 2), LossSpec(**EPS), normaliser=2.0)
    terms.loss.backward()
    assert terms.loss.item() == 0.0  # A = 0: nothing to learn, and not NaN (before the clamp: inf * 0)
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    assert torch.isfinite(terms.ratio_sum) and terms.ratio_sum.item() == pytest.approx(math.exp(LOG_RATIO_BOUND) + 1.0)


def test_absurd_behaviour_logprob_on_a_masked_token_gives_no_nan():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    terms = grpo_loss(logp, torch.tensor([[-math.inf, -2.0]]), torch.tensor([1.0]), torch.tensor([[0.0, 1.0]]),
                      LossSpec(**EPS), normaliser=1.0)
    terms.loss.backward()
    assert terms.loss.item() == -1.0 and torch.equal(logp.grad, torch.tensor([[0.0, -1.0]]))  # ratio 1 on token 2
    assert math.isfinite(terms.is_ratio_max.item()) and math.isfinite(terms.behaviour_kl_sum.item())


def test_negative_advantage_with_log_ratio_12_is_unbounded_without_delta_and_bounded_with_it():
    # One token, A = -1, log r = 12 (r = e^12 = 162754.8), normaliser 1.
    # Plain: loss = -min(r A, clip(r) A) = max(r, 1.2) = r, d loss / d logp = r: the 1.6e5 x gradient.
    old = torch.tensor([[-12.5]])
    logp = torch.tensor([[-0.5]], requires_grad=True)
    plain = grpo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), LossSpec(**EPS), normaliser=1.0)
    plain.loss.backward()
    assert logp.grad.item() == pytest.approx(162754.79, rel=1e-5)
    # delta = 4: loss = -min(min(r, 4) A, clip(r) A) = max(4, 1.2) = 4, constant in logp: gradient 0, counted clipped.
    logp.grad = None
    dual = grpo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), LossSpec(delta=4.0, **EPS), normaliser=1.0)
    dual.loss.backward()
    assert dual.loss.item() == pytest.approx(4.0) and logp.grad.item() == 0.0 and dual.clipped_tokens.item() == 1.0
    # Below delta it is the plain surrogate: r = 2 -> loss = max(2, 1.2) = 2, gradient r = 2.
    logp2 = torch.tensor([[math.log(2.0) - 12.5]], requires_grad=True)
    grpo_loss(logp2, old, torch.tensor([-1.0]), torch.ones(1, 1), LossSpec(delta=4.0, **EPS),
              normaliser=1.0).loss.backward()
    assert logp2.grad.item() == pytest.approx(2.0)


def test_delta_leaves_positive_advantages_alone():
    # A = +1, r = 1.1 (inside the clip): loss = -1.1, gradient -1.1, with or without delta = 1.05 (< r).
    old = torch.tensor([[0.0]])
    logp = torch.tensor([[math.log(1.1)]], requires_grad=True)
    terms = grpo_loss(logp, old - 0.0, torch.tensor([1.0]), torch.ones(1, 1), LossSpec(delta=4.0, **EPS),
                      normaliser=1.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-1.1) and logp.grad.item() == pytest.approx(-1.1)


# ---- loss_type: aggregation ------------------------------------------------------------------------------------------
# Two sequences on-policy (ratio 1): sequence 0 has 2 tokens and A = +1, sequence 1 has 3 tokens and A = -2.
# Per-token surrogate -r A: value -A, gradient -A. Sum of per-token values: 2 * (-1) + 3 * 2 = 4.
LOGP = [[-1.0, -2.0, 0.0], [-0.5, -1.0, -1.5]]
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -2.0])


def _run(loss_type, normaliser, **kw):
    logp = torch.tensor(LOGP, requires_grad=True)
    terms = grpo_loss(logp, logp.detach(), ADV, MASK, LossSpec(loss_type=loss_type, **{**EPS, **kw}),
                      normaliser=normaliser)
    terms.loss.backward()
    return terms.loss.item(), logp.grad


@pytest.mark.parametrize("loss_type, normaliser, value, row0, row1", [
    ("dapo", 5.0, 4 / 5, -1 / 5, 2 / 5),  # token mean over the 5 tokens
    ("bnpo", 5.0, 4 / 5, -1 / 5, 2 / 5),  # one micro-batch: its own token mean, the same here
    ("grpo", 2.0, (-1 + 2) / 2, -1 / (2 * 2), 2 / (3 * 2)),  # sequence means -1 and +2, then their mean
    ("dr_grpo", 2 * 4.0, 4 / 8, -1 / 8, 2 / 8),  # token sum / (2 sequences x max_completion_length 4)
])
def test_loss_type_aggregates_as_trl_documents(loss_type, normaliser, value, row0, row1):
    loss, grad = _run(loss_type, normaliser)
    assert loss == pytest.approx(value)
    assert torch.allclose(grad, torch.tensor([[row0, row0, 0.0], [row1, row1, row1]]))


def test_cispo_weights_the_logprob_by_the_detached_capped_ratio():
    # On-policy the weight is 1: loss = -sum(A logp) / 5 = -((-1 - 2) + (-2)(-0.5 - 1 - 1.5)) / 5 = -(-3 + 6) / 5.
    loss, grad = _run("cispo", 5.0, epsilon_high=5.0)
    assert loss == pytest.approx(-0.6)
    assert torch.allclose(grad, torch.tensor([[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]]))
    # r = 6 > epsilon_high 5: the weight is 5, and the token keeps a gradient (-5 A), where PPO's clip gives none.
    old = torch.tensor([[-1.0 - math.log(6.0)]])
    logp = torch.tensor([[-1.0]], requires_grad=True)
    terms = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1),
                      LossSpec(loss_type="cispo", epsilon_low=0.2, epsilon_high=5.0), normaliser=1.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(5.0) and logp.grad.item() == pytest.approx(-5.0)
    assert terms.clipped_tokens.item() == 1.0
    logp.grad = None
    grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), LossSpec(**EPS), normaliser=1.0).loss.backward()
    assert logp.grad.item() == 0.0


def _spec(loss_type: str) -> LossSpec:
    return LossSpec(loss_type=loss_type, max_completion_length=16, **EPS)


def test_loss_normaliser_per_loss_type():
    kw = dict(global_tokens=40.0, global_sequences=8.0, micro_tokens=6.0, micro_batches=3, world=2)
    assert loss_normaliser(_spec("dapo"), **kw) == 20.0 and loss_normaliser(_spec("cispo"), **kw) == 20.0  # 40 / 2
    assert loss_normaliser(_spec("grpo"), **kw) == 4.0  # 8 / 2
    assert loss_normaliser(_spec("dr_grpo"), **kw) == 64.0  # 8 x 16 / 2
    assert loss_normaliser(_spec("bnpo"), **kw) == 18.0  # 6 x 3
    assert loss_normaliser(_spec("dapo"), **{**kw, "global_tokens": 0.0}) > 0  # all masked: no division by zero


def test_a_normaliser_below_one_is_kept_and_an_unknown_loss_type_is_named():
    kw = dict(global_sequences=1.0, micro_tokens=1.0, micro_batches=1)
    # one completion token over 2 ranks: each rank divides by 0.5 (the floor only guards against 0)
    assert loss_normaliser(_spec("dapo"), global_tokens=1.0, world=2, **kw) == 0.5
    assert loss_normaliser(_spec("dapo"), global_tokens=0.0, world=2, **kw) == 1e-8
    with pytest.raises(AssertionError) as err:
        loss_normaliser(_spec("ppo"), global_tokens=1.0, world=1, **kw)
    assert str(err.value) == "unknown loss_type 'ppo'"


def test_the_loss_types_that_average_over_sequences_count_them():
    assert [t for t in ("dapo", "grpo", "dr_grpo", "bnpo", "cispo") if _spec(t).counts_sequences] == ["grpo", "dr_grpo"]


# ---- GSPO ------------------------------------------------------------------------------------------------------------
def test_sequence_level_ratios_are_per_sequence_over_its_own_unpadded_tokens():
    # Two sequences of 2 and 1 tokens (the rest padding, with junk logprobs): log r = [0.1, 0.3] -> s0 = exp(0.2),
    # and [0.5] -> s1 = exp(0.5); A = 1, epsilon 0.2 / 1.0 (nothing clipped), dapo over the 3 tokens.
    old = torch.full((2, 3), -1.0)
    logp = torch.tensor([[-0.9, -0.7, 5.0], [-0.5, 7.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    terms = grpo_loss(logp, old, torch.tensor([1.0, 1.0]), mask,
                      LossSpec(epsilon_low=0.2, epsilon_high=1.0, importance_sampling_level="sequence"), normaliser=3.0)
    s0, s1 = math.exp(0.2), math.exp(0.5)
    assert terms.ratio_sum.item() == pytest.approx(2 * s0 + s1, rel=1e-6)
    assert terms.loss.item() == pytest.approx(-(2 * s0 + s1) / 3, rel=1e-6)
    assert terms.clipped_tokens.item() == 0.0


def test_cispo_counts_only_tokens_above_the_cap_as_clipped():
    # ratios 1 (exactly the cap: not above it), 3 (above) and 0.5, with epsilon_high = 1
    old = torch.tensor([[-1.0, -1.0 - math.log(3.0), -1.0 + math.log(2.0)]])
    logp = torch.full((1, 3), -1.0)
    terms = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3),
                      LossSpec(loss_type="cispo", epsilon_low=0.2, epsilon_high=1.0), normaliser=3.0)
    assert terms.clipped_tokens.item() == 1.0


def test_delta_counts_a_token_clipped_only_above_delta_with_a_negative_advantage():
    # one token per sequence, delta = 1: (ratio 1, A -1) is not above delta; (ratio 3, A 0) has no advantage sign;
    # (ratio 3, A -1) is the one clipped
    old = torch.tensor([[-1.0], [-1.0 - math.log(3.0)], [-1.0 - math.log(3.0)]])
    logp = torch.full((3, 1), -1.0)
    terms = grpo_loss(logp, old, torch.tensor([-1.0, 0.0, -1.0]), torch.ones(3, 1), LossSpec(delta=1.0, **EPS),
                      normaliser=3.0)
    assert terms.clipped_tokens.item() == 1.0


def test_the_importance_weight_statistics_use_the_proximal_policy_not_the_current_one():
    prox = torch.tensor([[-1.0]])
    behaviour = prox - math.log(2.0)  # proximal / behaviour = 2
    logp = prox + math.log(1.5)  # the current policy moved on: current / behaviour would be 3
    terms = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1),
                      LossSpec(is_mode="token_truncate", is_cap=5.0, **EPS), normaliser=1.0, proximal_logprobs=prox)
    assert terms.is_ratio_sum.item() == pytest.approx(2.0) and terms.is_ratio_max.item() == pytest.approx(2.0)


def test_sequence_level_ratio_is_the_geometric_mean_over_the_sequence():
    # log r = [0.1, 0.3]: s = exp(0.2) = 1.221403. A = 1, epsilon_high 0.3 (unclipped), dapo over 2 tokens:
    # loss = -(s + s) / 2 = -s; d s / d logp_t = s / 2, so each gradient is -s / 2 = -0.610701.
    old = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-0.9, -0.7]], requires_grad=True)
    terms = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2),
                      LossSpec(epsilon_low=0.2, epsilon_high=0.3, importance_sampling_level="sequence"), normaliser=2.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-1.221403, rel=1e-6)
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.610701), rtol=1e-5)
    # Token level the second token (r = e^0.3 = 1.35 > 1.3) is clipped: the sequence ratio keeps it.
    logp.grad = None
    grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), LossSpec(epsilon_low=0.2, epsilon_high=0.3),
              normaliser=2.0).loss.backward()
    assert logp.grad[0, 1].item() == 0.0


# ---- off-policy correction -------------------------------------------------------------------------------------------
def test_importance_weights_truncate_or_mask_per_token_and_per_sequence():
    prox = torch.zeros(1, 2)
    behaviour = torch.tensor([[-math.log(4.0), math.log(2.0)]])  # ratios prox / behaviour: 4 and 0.5
    mask = torch.ones(1, 2)
    w, ratio, capped = importance_weights(prox, behaviour, mask, mode="token_truncate", cap=3.0)
    assert torch.allclose(w, torch.tensor([[3.0, 0.5]])) and torch.allclose(ratio, torch.tensor([[4.0, 0.5]]))
    assert capped.tolist() == [[True, False]]
    w, _, _ = importance_weights(prox, behaviour, mask, mode="token_mask", cap=3.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.5]]))
    w, _, _ = importance_weights(prox, behaviour, mask, mode="sequence_truncate", cap=3.0)  # 4 x 0.5 = 2, all tokens
    assert torch.allclose(w, torch.tensor([[2.0, 2.0]]))
    w, _, capped = importance_weights(prox, behaviour, mask, mode="sequence_mask", cap=1.5)  # 2 > 1.5: masked
    assert torch.equal(w, torch.zeros(1, 2)) and capped.all()


def test_the_importance_weight_cap_defaults_to_3():
    # the default of config.py's vllm_importance_sampling_cap: a proximal/behaviour ratio of 3.5 is weighted 3
    prox = torch.tensor([[-1.0]])
    behaviour = prox - math.log(3.5)
    logp = prox.clone().requires_grad_()
    grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1), LossSpec(is_mode="token_truncate", **EPS),
              normaliser=1.0, proximal_logprobs=prox).loss.backward()
    assert logp.grad.item() == pytest.approx(-3.0)


@pytest.mark.parametrize("bad", [dict(loss_type="ppo"), dict(importance_sampling_level="tokens")])
def test_an_unknown_loss_type_or_importance_sampling_level_is_refused(bad):
    logp = torch.tensor([[-1.0]])
    with pytest.raises(AssertionError):
        grpo_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 1), LossSpec(**EPS, **bad), normaliser=1.0)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_capped_ratio():
    # First pass: logp = proximal, so r = 1 (no clip) and the gradient is -w A / N with w = min(prox/behaviour, 3):
    # ratios 4 and 0.5 -> weights 3 and 0.5; A = 1, N = 2: gradients -1.5 and -0.25.
    prox = torch.tensor([[-1.0, -1.0]])
    behaviour = prox - torch.tensor([[math.log(4.0), math.log(0.5)]])
    logp = prox.clone().requires_grad_()
    terms = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2),
                      LossSpec(is_mode="token_truncate", is_cap=3.0, **EPS), normaliser=2.0, proximal_logprobs=prox)
    terms.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -0.25]]))
    assert terms.is_ratio_sum.item() == pytest.approx(4.5) and terms.is_ratio_max.item() == pytest.approx(4.0)
    assert terms.is_capped_tokens.item() == 1.0 and terms.clipped_tokens.item() == 0.0
    # Without the correction the first token's ratio against the behaviour policy is 4 > 1.2: clipped, no gradient.
    logp.grad = None
    grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), LossSpec(**EPS), normaliser=2.0).loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    # A later pass that moved 1.5x past the proximal policy is clipped against it (the trust region is kept).
    moved = (prox + math.log(1.5)).requires_grad_()
    later = grpo_loss(moved, behaviour, torch.tensor([1.0]), torch.ones(1, 2),
                      LossSpec(is_mode="token_truncate", is_cap=3.0, **EPS), normaliser=2.0, proximal_logprobs=prox)
    later.loss.backward()
    assert torch.equal(moved.grad, torch.zeros(1, 2)) and later.clipped_tokens.item() == 2.0


def test_behaviour_kl_is_the_k3_estimate():
    # r = pi / behaviour = 2: k3 = r - 1 - log r = 2 - 1 - 0.693147 = 0.306853 per token.
    logp = torch.zeros(1, 2)
    terms = grpo_loss(logp, logp - math.log(2.0), torch.zeros(1), torch.ones(1, 2), LossSpec(**EPS), normaliser=2.0)
    assert terms.behaviour_kl_sum.item() == pytest.approx(2 * 0.306853, rel=1e-5)
    assert terms.is_capped_tokens.item() == 0.0  # no correction: nothing capped


# ---- scale_rewards ---------------------------------------------------------------------------------------------------
def test_scale_rewards_group_batch_none():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # centred: [[0.5, -0.5], [0, 0]]
    # group: std([1, 0]) = 0.707107 -> 0.5 / 0.707207 = 0.707007
    assert torch.allclose(group_advantages(r, "group")[0], torch.tensor([0.707007, -0.707007]), atol=1e-6)
    # batch: std([1, 0, 1, 1]) = sqrt(0.75 / 3) = 0.5 -> 0.5 / 0.5001 = 0.999800
    assert torch.allclose(group_advantages(r, "batch"), torch.tensor([[0.999800, -0.999800], [0.0, 0.0]]), atol=1e-6)
    assert torch.equal(group_advantages(r, "none"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert torch.equal(group_advantages(r, True), group_advantages(r, "group"))  # TRL's booleans
    assert torch.equal(group_advantages(r, False), group_advantages(r, "none"))


# ---- importance weights and statistics over padded batches -----------------------------------------------------------
def test_sequence_importance_weights_are_per_sequence_products_over_unpadded_tokens():
    # log(prox / behaviour): sequence 0 [0.5, 0.5, pad], sequence 1 [0.25, pad, pad]; padding holds junk
    prox = torch.tensor([[0.0, 0.0, 4.0], [0.0, 6.0, -3.0]])
    behaviour = torch.tensor([[-0.5, -0.5, 0.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weights, ratio, capped = importance_weights(prox, behaviour, mask, mode="sequence_truncate", cap=2.0)
    assert torch.allclose(ratio, torch.tensor([[math.e] * 3, [math.exp(0.25)] * 3]))
    assert torch.allclose(weights, torch.tensor([[2.0] * 3, [math.exp(0.25)] * 3]))
    assert capped.tolist() == [[True] * 3, [False] * 3]


def test_a_ratio_exactly_at_the_cap_is_not_capped():
    logp = torch.zeros(1, 2)
    weights, ratio, capped = importance_weights(logp, logp, torch.ones(1, 2), mode="token_mask", cap=1.0)
    assert capped.tolist() == [[False, False]] and weights.tolist() == [[1.0, 1.0]]


def test_importance_and_behaviour_statistics_leave_padding_out():
    # one sequence of 2 tokens + 1 padding token; proximal/behaviour ratios 0.5 and 0.25 (both below 1)
    prox = torch.tensor([[-1.0, -1.0, 0.0]])
    behaviour = prox + torch.tensor([[math.log(2.0), math.log(4.0), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    terms = grpo_loss(prox.clone(), behaviour, torch.tensor([1.0]), mask,
                      LossSpec(is_mode="token_truncate", is_cap=3.0, **EPS), normaliser=2.0, proximal_logprobs=prox)
    assert terms.is_ratio_sum.item() == pytest.approx(0.75) and terms.is_ratio_max.item() == pytest.approx(0.5)
    k3 = (0.5 - 1 - math.log(0.5)) + (0.25 - 1 - math.log(0.25))  # r - 1 - log r per token, padding left out
    assert terms.behaviour_kl_sum.item() == pytest.approx(k3, rel=1e-5)
    assert terms.is_capped_tokens.item() == 0.0 and terms.is_capped_tokens.dtype == mask.dtype


def test_without_an_importance_correction_no_token_counts_as_capped():
    behaviour = torch.tensor([[-1.0 - math.log(4.0)]])  # current / behaviour = 4, above the default cap
    terms = grpo_loss(torch.tensor([[-1.0]]), behaviour, torch.tensor([1.0]), torch.ones(1, 1), LossSpec(**EPS),
                      normaliser=1.0)
    assert terms.is_capped_tokens.item() == 0.0


def test_grpo_divides_a_one_token_sequence_by_one():
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    terms = grpo_loss(logp, logp.detach(), torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]),
                      LossSpec(loss_type="grpo", **EPS), normaliser=1.0)
    assert terms.loss.item() == pytest.approx(-2.0)  # -(ratio 1 x A 2) / 1 token


# ---- the spec a config gives ---------------------------------------------------------------------------------------
def test_loss_spec_from_config_picks_up_every_field():
    cfg = AsyncGRPOConfig.from_dict({
        "model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters", "epsilon": 0.11, "epsilon_high": 0.33,
        "loss_type": "dr_grpo",
        "beta": 0.05, "importance_sampling_level": "sequence", "delta": 4.5,
        "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_cap": 2.5, "max_completion_length": 77, "vllm_importance_sampling_clip_min": 0.25,
        "off_policy_mask_threshold": 0.6, "use_bias_correction_kl": True, "sapo_temperature_pos": 0.7,
        "sapo_temperature_neg": 1.3, "top_entropy_quantile": 0.4})
    assert LossSpec.from_config(cfg) == LossSpec(
        epsilon_low=0.11, epsilon_high=0.33, loss_type="dr_grpo", beta=0.05, importance_sampling_level="sequence",
        delta=4.5, is_mode="sequence_mask", is_cap=2.5, max_completion_length=77, is_clip_min=0.25,
        off_policy_mask_threshold=0.6, use_bias_correction_kl=True, sapo_temperature_pos=0.7,
        sapo_temperature_neg=1.3, top_entropy_quantile=0.4)
    spec = LossSpec.from_config(cfg)
    assert spec.counts_sequences and spec.needs_reference and spec.importance_weighted


@pytest.mark.parametrize(("loss_type", "level", "warned"), [
    ("luspo", "token", "luspo is defined with importance_sampling_level: sequence"),
    ("luspo", "sequence", None), ("grpo", "token", None),
    ("dapo", "sequence", "sums per-token contributions"), ("grpo", "sequence", None)])
def test_loss_spec_from_config_warns_only_on_a_mismatched_level(caplog, loss_type, level, warned):
    cfg = AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters",
                                     "loss_type": loss_type,
                                     "importance_sampling_level": level})
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.loss"):
        LossSpec.from_config(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (warned is not None) and all(warned in w for w in warnings)


def test_loss_spec_from_a_default_config_has_delta_3_no_correction_and_epsilon_high_falls_back_to_epsilon():
    spec = LossSpec.from_config(AsyncGRPOConfig.from_dict({"model_name_or_path": "toy",
                                                           "lora_adapter_path": "/tmp/adapters", "epsilon": 0.15}))
    assert (spec.epsilon_low, spec.epsilon_high, spec.loss_type) == (0.15, 0.15, "dapo")
    assert (spec.beta, spec.delta) == (0.0, 3.0)
    assert spec.is_mode is None and not spec.importance_weighted and not spec.needs_reference
    assert not spec.counts_sequences and spec.importance_sampling_level == "token"
    with pytest.raises(AttributeError):  # frozen: a run's spec does not change under it
        spec.beta = 1.0
