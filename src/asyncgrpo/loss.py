"""GRPO loss: pure functions over tensors, no model, no distributed state.

Departures from the GRPO paper (as in DAPO / TRL's default "token-level" aggregation):
- the importance ratio is taken against the *behaviour* logprobs the inference server reported for the
  sampled tokens, not against a recomputed "old" policy: with asynchronous rollouts the server's policy is
  the one that actually produced the tokens;
- the surrogate is averaged over all completion tokens of the global batch (token level), not per sequence;
- the clip range may be asymmetric (`epsilon`, `epsilon_high`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages. rewards: (G, N) for G groups of N completions -> (G, N)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target token. logits: (B, T, V), targets: (B, T) -> (B, T), in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossTerms:
    """The loss and detached statistics; sums are over masked tokens, so callers can reduce across ranks."""

    loss: torch.Tensor
    n_tokens: torch.Tensor
    clipped_tokens: torch.Tensor
    kl_sum: torch.Tensor
    ratio_sum: torch.Tensor
    max_abs_log_ratio: torch.Tensor  # max over masked tokens of |log pi - log behaviour|: 0 when on-policy and exact


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    normaliser: float,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """Token-level clipped surrogate (+ optional k3 KL to the reference policy).

    logprobs, behaviour_logprobs, mask, ref_logprobs: (B, T); advantages: (B,).
    `normaliser` is the number of completion tokens the loss is averaged over (the global batch's count,
    so that micro-batches and ranks add up to one token-level mean).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    per_token = -torch.min(unclipped, clipped)  # (B, T)
    kl = torch.zeros_like(per_token)
    if beta > 0.0:
        assert ref_logprobs is not None, "beta > 0 needs reference logprobs"
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator: >= 0, unbiased for KL(pi || ref)
        per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / normaliser
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
        return LossTerms(
            loss=loss,
            n_tokens=mask.sum(),
            clipped_tokens=(was_clipped.to(mask.dtype) * mask).sum(),
            kl_sum=(kl.detach() * mask).sum(),
            ratio_sum=(ratio.detach() * mask).sum(),
            max_abs_log_ratio=((logprobs.detach() - behaviour_logprobs).abs() * mask).max() if mask.numel()
            else mask.sum(),
        )
