"""The loss's masks and bounds exactly at their edges: a value at a threshold, a bound of 0 or none, a one-token
sequence, log-ratios past the +-20 safety bound. Each expected value is worked out by hand in the comment beside it."""

import math

import pytest
import torch

from asyncgrpo.trainer.loss import (LOG_RATIO_BOUND, LossSpec, grpo_loss, high_entropy_mask, importance_weights,
                                    off_policy_mask)

ONE = torch.ones(1, 1)


def test_behaviour_kl_stops_growing_past_the_log_ratio_bound_on_both_sides():
    # k3 = e^b - 1 - b with b clamped to [-20, 20]: at b = -30 it is e^-20 + 19, at b = +30 e^20 - 21 (both finite).
    def k3_at(log_ratio):
        logp = torch.tensor([[-1.0]])
        terms = grpo_loss(logp, logp - log_ratio, torch.tensor([1.0]), ONE, LossSpec(0.2, 0.2), normaliser=1.0)
        return terms.behaviour_kl_sum.item()

    assert k3_at(-30.0) == pytest.approx(math.exp(-LOG_RATIO_BOUND) + LOG_RATIO_BOUND - 1.0)
    assert k3_at(30.0) == pytest.approx(math.exp(LOG_RATIO_BOUND) - 1.0 - LOG_RATIO_BOUND)
    assert k3_at(-30.0) == pytest.approx(k3_at(-20.0)) and k3_at(30.0) == pytest.approx(k3_at(20.0))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_no_cap_leaves_ratios_unbounded_above_but_never_overflows(mode):
    # cap None: nothing is out of bounds above; the weight of log-ratio 30 stops at e^20 (e^30 would be exact but
    # the bound keeps a weight from reaching inf at log-ratios past ~88), log-ratio 1 keeps e^1.
    proximal = torch.tensor([[0.0, 0.0]])
    behaviour = torch.tensor([[-30.0, -1.0]])
    weights, _, out = importance_weights(proximal, behaviour, torch.ones(1, 2), mode=mode, cap=None)
    assert not out.any()
    assert weights[0, 0].item() == pytest.approx(math.exp(LOG_RATIO_BOUND)) and math.isfinite(weights[0, 0].item())
    assert weights[0, 1].item() == pytest.approx(math.e)


def test_a_ratio_exactly_at_clip_min_is_inside_and_a_clip_min_of_zero_is_no_bound():
    # On policy (log-ratio 0) with clip_min 1.0: the ratio 1 is at the bound, not below it: weight 1, not masked.
    zeros = torch.zeros(1, 3)
    weights, _, out = importance_weights(zeros, zeros, torch.ones(1, 3), mode="token_mask", cap=3.0, clip_min=1.0)
    assert not out.any() and torch.equal(weights, torch.ones(1, 3))
    # clip_min 0: log(0) = -inf, no lower bound: ratios e^-5 and e^-40 stay in, with their own weights.
    behaviour = torch.tensor([[5.0, 40.0, 0.0]])
    weights, _, out = importance_weights(zeros, behaviour, torch.ones(1, 3), mode="token_mask", cap=3.0, clip_min=0.0)
    assert not out.any()
    assert weights[0].tolist() == pytest.approx([math.exp(-5.0), math.exp(-40.0), 1.0], rel=1e-5)


def test_off_policy_mask_at_its_edges():
    adv_neg, adv_zero = torch.tensor([-1.0]), torch.tensor([0.0])
    # One token, log(behaviour / trainer) = 0.6 > threshold 0.5, negative advantage: masked (the mean over one
    # token is the token itself).
    logp, behaviour = torch.tensor([[-1.6]]), torch.tensor([[-1.0]])
    assert off_policy_mask(logp, behaviour, adv_neg, ONE, 0.5).item() == 0.0
    # The same sequence with advantage 0: kept (only negative advantages are masked).
    assert off_policy_mask(logp, behaviour, adv_zero, ONE, 0.5).item() == 1.0
    # On policy, threshold 0: the mean log-ratio 0 is at the threshold, not over it: kept.
    assert off_policy_mask(behaviour, behaviour, adv_neg, ONE, 0.0).item() == 1.0


def test_top_entropy_quantile_keeps_a_token_exactly_at_the_threshold():
    # Quantile 0.5 over entropies 1, 2, 3: threshold = the median = 2, and tokens at or above it are kept.
    entropy = torch.tensor([[1.0, 2.0, 3.0]])
    assert high_entropy_mask(entropy, torch.ones(1, 3), 0.5).tolist() == [[0.0, 1.0, 1.0]]
