"""The default configuration bounds every importance weight: log-ratios up to +-30 (ratios up to e^30) through every
loss type, importance-sampling mode and level give a finite loss and finite gradients no larger than the bounds
docs/losses.md states; and the cases where a clamp used to change a finite loss now agree with TRL's value."""

import math

import pytest
import torch

from asyncgrpo.config import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES, AsyncGRPOConfig
from asyncgrpo.trainer.loss import KL_BOUND, LossSpec, grpo_loss, importance_weights, loss_normaliser


def default_spec(**values) -> LossSpec:
    return LossSpec.from_config(AsyncGRPOConfig.from_dict({"model_name_or_path": "toy",
                                                           "lora_adapter_path": "/tmp/adapters", **values}))


def extreme_batch(seed: int, b: int = 8, t: int = 6):
    """Log-ratios spread over [-30, 30] against both the behaviour and the proximal policy, with padding."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(b, t, generator=g) * 40 - 0.01  # finite, above the producer's floor
    proximal = (behaviour + (torch.rand(b, t, generator=g) * 60 - 30)).clamp(max=0.0)
    lp = (proximal + (torch.rand(b, t, generator=g) * 60 - 30)).clamp(max=0.0)
    behaviour[0, 0], lp[0, 0] = -30.5, -0.5  # e^30 against the behaviour
    ref = lp + torch.rand(b, t, generator=g) * 60 - 30
    adv = torch.randn(b, generator=g) * 2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t) < lengths.unsqueeze(1)).float()
    entropy = torch.rand(b, t, generator=g) * 5
    return lp, behaviour, proximal, ref, adv, mask, entropy


CONFIGS = [{"loss_type": t, "importance_sampling_level": level, **({"epsilon_high": 5.0} if t == "cispo" else {})}
           for t in LOSS_TYPES for level in IMPORTANCE_SAMPLING_LEVELS]
MODES = [None, *IS_MODES]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("values", CONFIGS, ids=lambda v: f"{v['loss_type']}-{v['importance_sampling_level']}")
@pytest.mark.parametrize("extras", [{}, {"beta": 0.1}, {"beta": 0.1, "use_bias_correction_kl": True},
                                    {"off_policy_mask_threshold": 0.5, "top_entropy_quantile": 0.5}],
                         ids=["plain", "kl", "bias_kl", "masks"])
def test_default_config_bounds_every_weight_for_log_ratios_up_to_30(values, mode, extras):
    correction = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode} if mode else {}
    spec = default_spec(**values, **correction, **extras, max_completion_length=6)
    assert spec.delta == 3.0  # the default bounds the unclipped ratio
    for seed in range(3):
        lp, behaviour, proximal, ref, adv, mask, entropy = extreme_batch(seed)
        lp = lp.requires_grad_()
        terms = grpo_loss(lp, behaviour, adv, mask, spec, normaliser=1.0, ref_logprobs=ref,
                          proximal_logprobs=proximal if mode else None, entropy=entropy)
        terms.loss.backward()
        assert torch.isfinite(terms.loss), (values, mode, seed)
        assert torch.isfinite(lp.grad).all(), (values, mode, seed)
        # Per token, |d loss / d log pi| <= |A| x (largest surrogate weight) x (largest IS weight) + beta x (KL term):
        # weights: delta (3) for the clipped types, epsilon_high (5) for cispo's capped ratio times |log pi| (<= 70
        # here), 4/tau x sigmoid slope x r for sapo (< 2); IS weight <= the cap (3); the KL's slope (< 12.5, verl's
        # bound: k3 <= 10) plus, bias-corrected, k3 x ratio (<= 10 x 3).
        surrogate = {"cispo": 5.0 * 71.0, "sapo": 2.0}.get(spec.loss_type, 3.0)
        bound = adv.abs().max() * surrogate * (3.0 if mode else 1.0) + 0.1 * (12.5 * 3.0 + KL_BOUND * 3.0)
        assert lp.grad.abs().max() <= bound, (values, mode, seed, float(lp.grad.abs().max()))
        assert all(math.isfinite(float(v)) for v in (terms.is_ratio_max, terms.ratio_sum, terms.kl_sum,
                                                     terms.behaviour_kl_sum, terms.is_ratio_sum))


def test_no_nan_from_an_infinite_behaviour_logprob_on_a_token_that_weighs_nothing():
    for spec in (default_spec(), default_spec(delta=None)):
        lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        terms = grpo_loss(lp, torch.tensor([[-math.inf, -2.0]]), torch.tensor([0.0]), torch.ones(1, 2), spec,
                          normaliser=2.0)
        terms.loss.backward()
        assert terms.loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(1, 2))


def _one_token(log_ratio: float, adv: float, spec: LossSpec):
    lp = torch.tensor([[-0.0]], dtype=torch.float64, requires_grad=True)
    terms = grpo_loss(lp, torch.tensor([[-log_ratio]], dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                      torch.ones(1, 1), spec, normaliser=1.0)
    terms.loss.backward()
    return terms.loss.item(), lp.grad.item()


def test_delta_makes_a_negative_advantage_token_past_it_weigh_nothing_at_any_ratio():
    spec = default_spec()
    for log_ratio in (math.log(3.0) + 1e-6, 12.0, 20.1, 30.0, 900.0):
        assert _one_token(log_ratio, -1.0, spec) == pytest.approx((3.0, 0.0))
    assert _one_token(1.0, -1.0, spec) == pytest.approx((math.e, math.e))  # below delta: weight r, as TRL


def test_without_delta_the_weight_grows_continuously_and_stays_finite_past_e20():
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28)  # delta unset: no bound (up to e^20, then linear)
    below, above = _one_token(19.9, -1.0, spec), _one_token(20.1, -1.0, spec)
    assert below == pytest.approx((math.exp(19.9), math.exp(19.9)))
    assert above == pytest.approx((math.exp(20.0) * 1.1, math.exp(20.0)))  # the tangent at 20: no jump to 0
    loss, grad = _one_token(30.0, -1.0, spec)
    assert math.isfinite(loss) and grad == pytest.approx(math.exp(20.0))


def test_gspo_sums_token_log_ratios_before_any_bound_as_trl_does():
    # One token at log r 30 among ten: the sequence's log-ratio is 3. TRL: loss e^3 = 20.09, that token's gradient
    # e^3 / 10 = 2.0 (the old clamp at 20 per token gave 7.39 and 0).
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo", importance_sampling_level="sequence")
    behaviour = torch.full((1, 10), -1.0, dtype=torch.float64)
    lp = behaviour.clone()
    lp[0, 0] = behaviour[0, 0] + 30.0
    lp = lp.requires_grad_()
    terms = grpo_loss(lp, behaviour, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 10), spec,
                      normaliser=1.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(math.exp(3.0))
    assert lp.grad[0, 0].item() == pytest.approx(math.exp(3.0) / 10)


def test_sequence_mask_multiplies_token_ratios_before_any_bound():
    # Token log-ratios +25 and -21: the sequence's ratio is e^4 = 55 > the cap 3, so TRL masks it; clamping each
    # token to +-20 first (0 in sum) kept it.
    prox = torch.tensor([[-1.0, -22.0]])
    behaviour = torch.tensor([[-26.0, -1.0]])
    weights, ratio, out = importance_weights(prox, behaviour, torch.ones(1, 2), mode="sequence_mask", cap=3.0)
    assert weights.tolist() == [[0.0, 0.0]] and out.all() and ratio[0, 0].item() == pytest.approx(math.exp(4.0))
    weights, _, _ = importance_weights(prox, behaviour, torch.ones(1, 2), mode="sequence_truncate", cap=3.0)
    assert weights.tolist() == [[pytest.approx(3.0)] * 2]


def test_the_k3_kl_is_bounded_as_verl_bounds_it():
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28, beta=1.0)
    lp = torch.tensor([[-95.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-5.0, -1.5, -30.0]])  # ref - lp = 90 (k3 = e^90: inf in fp32), -0.5, -29
    terms = grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 3), spec, normaliser=1.0, ref_logprobs=ref)
    terms.loss.backward()
    small = math.exp(-0.5) + 0.5 - 1.0
    assert terms.loss.item() == pytest.approx(KL_BOUND + small + KL_BOUND)
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 1.0 - math.exp(-0.5), 0.0])


def test_statistics_stay_finite_whatever_the_ratio():
    spec = default_spec(vllm_importance_sampling_correction=True)
    lp = torch.tensor([[0.0]])
    terms = grpo_loss(lp, torch.tensor([[-900.0]]), torch.tensor([1.0]), torch.ones(1, 1), spec, normaliser=1.0,
                      proximal_logprobs=lp)
    assert math.isfinite(float(terms.is_ratio_max)) and float(terms.is_ratio_max) == pytest.approx(math.exp(20.0))
    assert float(terms.is_capped_tokens) == 1.0


def test_normalisers_of_the_new_loss_types_count_sequences():
    for loss_type in ("sapo", "luspo"):
        spec = LossSpec(epsilon_low=0.2, epsilon_high=0.2, loss_type=loss_type)
        assert spec.counts_sequences
        assert loss_normaliser(spec, global_tokens=100, global_sequences=8, micro_tokens=10, micro_batches=3,
                               world=2) == 4.0
