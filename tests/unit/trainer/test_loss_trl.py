"""Every loss knob against TRL's formula, re-implemented here on its own from TRL's GRPOTrainer (`_compute_loss`,
`get_off_policy_mask`, `get_high_entropy_mask`, the vLLM importance-sampling block): random batches, one process, one
micro-batch, log-ratios small enough that no bound of ours binds; loss and gradient must agree."""

import math

import pytest
import torch

from asyncgrpo.trainer.loss import LossSpec, grpo_loss, loss_normaliser


def trl_loss(lp, old, sampling, adv, mask, *, loss_type="dapo", level="token", eps_low=0.2, eps_high=0.28,
             delta=None, beta=0.0, ref=None, bias_kl=False, is_mode=None, clip_min=None, clip_max=3.0,
             opm=None, entropy=None, top_q=1.0, tau_pos=1.0, tau_neg=1.05, max_len=None):
    """TRL's loss for one process and one micro-batch (no gradient accumulation), written from its formulas."""
    adv = adv.unsqueeze(1)
    log_ratio = lp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if bias_kl:
            kl = kl * coef_1
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * lp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if opm is not None:
        kl_seq = ((sampling - lp.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        per_token = per_token * ((adv >= 0) | (kl_seq <= opm)).to(mask.dtype)
    if top_q < 1.0:
        threshold = torch.quantile(entropy[mask.bool()].float(), 1 - top_q)
        per_token = per_token * ((entropy * mask >= threshold) & mask.bool())
    if is_mode is not None:
        diff = (old - sampling) * mask
        if is_mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        if is_mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            low = clip_min if clip_min is not None else -math.inf
            ratio = ratio.masked_fill((ratio < low) | (ratio > clip_max), 0.0)
        per_token = per_token * ratio
    if beta:
        per_token = per_token + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    return (per_token * mask).sum() / mask.sum()  # dapo, cispo: the global token count (one process)


def batch(seed, b=6, t=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    old = behaviour + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    lp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    ref = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t) < lengths.unsqueeze(1)).to(torch.float64)
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    return lp, old, behaviour, ref, adv, mask, entropy


def ours(lp, old, behaviour, ref, adv, mask, entropy, *, proximal=True, **spec_kw):
    spec = LossSpec(epsilon_low=0.2, epsilon_high=spec_kw.pop("eps_high", 0.28), max_completion_length=7, **spec_kw)
    normaliser = loss_normaliser(spec, global_tokens=float(mask.sum()), global_sequences=float(mask.shape[0]),
                                 micro_tokens=float(mask.sum()), micro_batches=1, world=1)
    return grpo_loss(lp, behaviour, adv, mask, spec, normaliser=normaliser, ref_logprobs=ref,
                     proximal_logprobs=old if proximal else None, entropy=entropy).loss


CASES = [  # (our LossSpec keywords, TRL's keywords)
    *[({"loss_type": t}, {"loss_type": t}) for t in ("dapo", "grpo", "bnpo", "dr_grpo", "luspo", "sapo")],
    ({"loss_type": "cispo", "eps_high": 5.0}, {"loss_type": "cispo", "eps_high": 5.0}),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"loss_type": "grpo", "level": "sequence"}),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {"loss_type": "luspo", "level": "sequence"}),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence", "sapo_temperature_pos": 2.0,
      "sapo_temperature_neg": 0.5}, {"loss_type": "sapo", "level": "sequence", "tau_pos": 2.0, "tau_neg": 0.5}),
    ({"delta": 1.5}, {"delta": 1.5}),
    ({"beta": 0.1}, {"beta": 0.1}),
    ({"beta": 0.1, "use_bias_correction_kl": True}, {"beta": 0.1, "bias_kl": True}),
    ({"beta": 0.1, "use_bias_correction_kl": True, "loss_type": "grpo", "importance_sampling_level": "sequence"},
     {"beta": 0.1, "bias_kl": True, "loss_type": "grpo", "level": "sequence"}),
    ({"off_policy_mask_threshold": 0.05}, {"opm": 0.05}),
    ({"top_entropy_quantile": 0.3}, {"top_q": 0.3}),
    ({"top_entropy_quantile": 0.5, "loss_type": "grpo"}, {"top_q": 0.5, "loss_type": "grpo"}),
    *[({"is_mode": m, "is_cap": 1.3}, {"is_mode": m, "clip_max": 1.3}) for m in
      ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")],
    *[({"is_mode": m, "is_cap": 1.3, "is_clip_min": 0.8}, {"is_mode": m, "clip_max": 1.3, "clip_min": 0.8}) for m in
      ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")],
    ({"is_mode": "token_mask", "is_cap": 1.5, "off_policy_mask_threshold": 0.05, "top_entropy_quantile": 0.6,
      "beta": 0.05, "use_bias_correction_kl": True},
     {"is_mode": "token_mask", "clip_max": 1.5, "opm": 0.05, "top_q": 0.6, "beta": 0.05, "bias_kl": True}),
    ({"is_mode": "sequence_truncate", "is_cap": 1.5, "off_policy_mask_threshold": 0.05, "delta": 2.0},
     {"is_mode": "sequence_truncate", "clip_max": 1.5, "opm": 0.05, "delta": 2.0}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mine, theirs", CASES, ids=[str(c[0]) for c in CASES])
def test_loss_and_gradient_equal_trls_on_random_batches(mine, theirs, seed):
    lp, old, behaviour, ref, adv, mask, entropy = batch(seed)
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    got = ours(a, old, behaviour, ref, adv, mask, entropy, **mine)
    want = trl_loss(b, old, behaviour, adv, mask, ref=ref, entropy=entropy, max_len=7, **theirs)
    got.backward()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(a.grad, b.grad * mask, rtol=1e-9, atol=1e-12)


def test_the_cases_reach_the_clip_the_cap_the_masks_and_both_advantage_signs():
    # The comparison above means something only if the random batches exercise every branch.
    lp, old, behaviour, _, adv, mask, entropy = batch(0)
    ratio = torch.exp(lp - old)[mask > 0]
    assert (ratio > 1.28).any() and (ratio < 0.8).any() and (ratio > 1.5).any()
    assert (adv > 0).any() and (adv < 0).any()
    is_ratio = torch.exp(old - behaviour)[mask > 0]
    assert (is_ratio > 1.3).any() and (is_ratio < 0.8).any()
    dropped = kept = 0
    for seed in (0, 1, 2):  # the off-policy mask drops some sequence and keeps a negative one in some batch
        lp, _, behaviour, _, adv, mask, _ = batch(seed)
        kl_seq = ((behaviour - lp) * mask).sum(1) / mask.sum(1)
        dropped += int(((kl_seq > 0.05) & (adv < 0)).sum())
        kept += int(((kl_seq <= 0.05) & (adv < 0)).sum())
    assert dropped and kept


def test_the_bias_corrected_kl_caps_its_ratio_at_delta_where_trl_does_not():
    # A departure, on purpose: TRL multiplies the KL by the uncapped ratio; with delta (our default) it is capped there
    # like the surrogate's, so the KL's weight is bounded too. Below delta the two agree.
    lp = torch.tensor([[-0.1, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-2.0, -1.2]], dtype=torch.float64)  # ratios e^1.9 = 6.7 (above delta 3) and e^0.2 = 1.22
    ref = torch.tensor([[-0.5, -0.8]], dtype=torch.float64)
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28, beta=1.0, use_bias_correction_kl=True, delta=3.0)
    terms = grpo_loss(lp, old, torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), spec, normaliser=1.0,
                      ref_logprobs=ref)
    d = (ref - lp).detach()
    k3 = torch.exp(d) - d - 1
    assert terms.loss.item() == pytest.approx(float(k3[0, 0] * 3.0 + k3[0, 1] * math.exp(0.2)))
