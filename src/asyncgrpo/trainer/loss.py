"""The GRPO loss family as pure functions over tensors: no model, no distributed state.

`LossSpec` holds what the loss takes from the config; `loss_normaliser` says what each micro-batch's summed loss is
divided by, `grpo_loss` computes the clipped surrogate (+ KL, + importance weights) and its statistics, and
`group_advantages` is the tensor form of the group-relative advantage. docs/losses.md explains each variant and when
to use which; docs/trainer-internals.md how this departs from the GRPO paper and why log-ratios are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.config import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES, SCALE_REWARDS

# Log-ratios are clamped to this bound before `exp` (docs/trainer-internals.md: why 20, and why it never changes a
# finite loss).
LOG_RATIO_BOUND = 20.0

# Loss types that average over sequences: their normaliser needs the global number of sequences.
_PER_SEQUENCE = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class LossSpec:
    """Everything the loss takes from the config, fixed for a run. `is_mode` None: no importance weight (the
    off-policy correction is off); with it, the trainer also passes proximal logprobs. `max_completion_length` is
    only read by `dr_grpo`'s normaliser."""

    epsilon_low: float
    epsilon_high: float
    loss_type: str = "dapo"
    beta: float = 0.0
    importance_sampling_level: str = "token"
    delta: float | None = None
    is_mode: str | None = None
    is_cap: float = 3.0
    max_completion_length: int | None = None

    @classmethod
    def from_config(cls, cfg) -> LossSpec:
        """The spec of an AsyncGRPOConfig (`epsilon_high` unset means `epsilon`)."""
        return cls(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_upper, loss_type=cfg.loss_type, beta=cfg.beta,
                   importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                   is_mode=cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else None,
                   is_cap=cfg.vllm_importance_sampling_cap, max_completion_length=cfg.max_completion_length)

    @property
    def counts_sequences(self) -> bool:
        """The normaliser needs the global batch's number of sequences (`global_sequences`)."""
        return self.loss_type in _PER_SEQUENCE

    @property
    def needs_reference(self) -> bool:
        """A KL term: the trainer computes reference logprobs (the adapter switched off)."""
        return self.beta > 0.0

    @property
    def importance_weighted(self) -> bool:
        """The off-policy correction is on: tokens are weighted by proximal / behaviour, and the trainer keeps the
        proximal logprobs (its own at the batch's first pass)."""
        return self.is_mode is not None


def group_advantages(rewards: torch.Tensor, scale: bool | str = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages. rewards: (G, N) for G groups of N completions -> (G, N).

    `scale` (TRL's `scale_rewards`): `group` (or True) divides by each group's reward std (GRPO), `batch` by the std
    of all rewards in `rewards` (PPO-Lite), `none` (or False) only subtracts the group mean (Dr. GRPO). Stds are
    torch's unbiased ones, plus `eps`."""
    mode = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
    assert mode in SCALE_REWARDS, f"unknown scale_rewards {scale!r}"
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "none":
        return centred
    std = rewards.std(dim=1, keepdim=True) if mode == "group" else rewards.std()
    return centred / (std + eps)


def loss_normaliser(spec: LossSpec, *, global_tokens: float, global_sequences: float, micro_tokens: float,
                    micro_batches: int, world: int) -> float:
    """What one micro-batch's summed (per-token or, for `grpo`, per-sequence) loss is divided by, so that the
    gradients summed over micro-batches and averaged over ranks (DDP/FSDP/ZeRO average) give TRL's aggregate:

    - dapo, cispo: the mean over every completion token of the global batch (global tokens / world);
    - grpo: the mean over sequences of each sequence's token mean (global sequences / world; `grpo_loss` divides
      each token by its sequence's length first);
    - dr_grpo: the sum over tokens divided by sequences x max_completion_length (a constant: no length bias);
    - bnpo: each micro-batch's own token mean, averaged over micro-batches and ranks (TRL: "local batch")."""
    loss_type = spec.loss_type
    if loss_type in ("dapo", "cispo"):
        value = global_tokens / world
    elif loss_type == "grpo":
        value = global_sequences / world
    elif loss_type == "dr_grpo":
        assert spec.max_completion_length, "dr_grpo needs max_completion_length"
        value = global_sequences * spec.max_completion_length / world
    elif loss_type == "bnpo":
        value = micro_tokens * micro_batches
    else:
        raise AssertionError(f"unknown loss_type {loss_type!r}")
    return max(value, 1e-8)  # a batch whose tokens are all masked (e.g. all truncated) contributes 0, not NaN


@dataclass
class LossTerms:
    """The loss and detached statistics; sums are over masked tokens, so callers can reduce across ranks."""

    loss: torch.Tensor
    n_tokens: torch.Tensor
    clipped_tokens: torch.Tensor
    kl_sum: torch.Tensor
    ratio_sum: torch.Tensor
    max_abs_log_ratio: torch.Tensor  # max over masked tokens of |log pi - log behaviour|: 0 when on-policy and exact
    # Off-policy statistics (0 when not computed). The IS ratio is proximal (or, without a proximal policy, the
    # current policy) / behaviour, before it is capped.
    is_ratio_sum: torch.Tensor | float = 0.0
    is_ratio_max: torch.Tensor | float = 0.0
    is_capped_tokens: torch.Tensor | float = 0.0  # tokens whose IS weight was truncated or masked
    behaviour_kl_sum: torch.Tensor | float = 0.0  # k3 estimate of KL(behaviour || trainer), summed over tokens


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str, cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's vLLM importance-sampling correction, no gradient. All (B, T); returns (weights, raw ratios, capped):
    the ratio proximal / behaviour per token (`token_*`) or per sequence (`sequence_*`: the product over the
    sequence's tokens, broadcast to them); `*_truncate` caps it at `cap`, `*_mask` sets ratios above `cap` to 0."""
    assert mode in IS_MODES, f"unknown importance sampling mode {mode!r}"
    with torch.no_grad():
        diff = torch.where(mask > 0, _clamped(proximal_logprobs - behaviour_logprobs), 0.0)
        if mode.startswith("sequence"):
            diff = _clamped(diff.sum(dim=1, keepdim=True)).expand_as(diff)
        ratio = torch.exp(diff)
        capped = ratio > cap
        weights = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(capped, 0.0)
        return weights, ratio, capped


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    *,
    normaliser: float,
    ref_logprobs: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """Clipped surrogate of the chosen `spec.loss_type` (+ optional k3 KL to the reference policy).

    logprobs, behaviour_logprobs, mask, ref_logprobs, proximal_logprobs: (B, T); advantages: (B,).
    `normaliser` is what the summed loss is divided by (`loss_normaliser`: for the default `dapo`, the global
    batch's completion-token count per rank, so that micro-batches and ranks add up to one token-level mean).
    The ratio is pi / proximal when `proximal_logprobs` is given, else pi / behaviour (today's default);
    `spec.importance_sampling_level: sequence` replaces it by the sequence's geometric mean ratio (GSPO).
    `spec.delta` caps the unclipped ratio (two-sided clip); `spec.is_mode`/`spec.is_cap` weight each token by the
    importance weight proximal / behaviour (`importance_weights`), None = no weight.
    """
    assert spec.loss_type in LOSS_TYPES and spec.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS
    mask = mask.to(logprobs.dtype)
    valid = mask > 0
    base = behaviour_logprobs if proximal_logprobs is None else proximal_logprobs
    log_ratio = torch.where(valid, _clamped(logprobs - base), 0.0)  # (B, T); 0 on padding: no inf * 0
    if spec.importance_sampling_level == "sequence":
        seq = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
        log_ratio = seq.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    if spec.loss_type == "cispo":
        # MiniMax-M1 / TRL: the ratio, capped at epsilon_high and detached, weights the policy-gradient term.
        per_token = -ratio.clamp(max=spec.epsilon_high).detach() * adv * logprobs
        was_clipped = (ratio > spec.epsilon_high) & valid
    else:
        unclipped = ratio if spec.delta is None else ratio.clamp(max=spec.delta)
        clipped = torch.clamp(ratio, 1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high) * adv
        per_token = -torch.min(unclipped * adv, clipped)  # (B, T)
        was_clipped = (((ratio < 1.0 - spec.epsilon_low) & (adv < 0))
                       | ((ratio > 1.0 + spec.epsilon_high) & (adv > 0)))
        if spec.delta is not None:
            was_clipped = was_clipped | ((ratio > spec.delta) & (adv < 0))
    stats_base = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
    is_w, is_ratio, capped = importance_weights(stats_base, behaviour_logprobs, mask,
                                                mode=spec.is_mode or "token_truncate", cap=spec.is_cap)
    if spec.importance_weighted:
        per_token = per_token * is_w
    kl = torch.zeros_like(per_token)
    if spec.needs_reference:
        assert ref_logprobs is not None, "beta > 0 needs reference logprobs"
        delta_ref = ref_logprobs - logprobs
        kl = torch.exp(delta_ref) - delta_ref - 1.0  # k3 estimator: >= 0, unbiased for KL(pi || ref)
        per_token = per_token + spec.beta * kl
    if spec.loss_type == "grpo":  # each sequence's token mean, then (via the normaliser) the mean over sequences
        per_token = per_token / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    loss = torch.where(valid, per_token, 0.0).sum() / normaliser
    with torch.no_grad():
        behaviour_log_ratio = torch.where(valid, logprobs.detach() - behaviour_logprobs, 0.0)
        k3 = torch.where(valid, torch.exp(_clamped(behaviour_log_ratio)) - 1.0 - _clamped(behaviour_log_ratio), 0.0)
        return LossTerms(
            loss=loss,
            n_tokens=mask.sum(),
            clipped_tokens=(was_clipped & valid).to(mask.dtype).sum(),
            kl_sum=torch.where(valid, kl.detach(), 0.0).sum(),
            ratio_sum=torch.where(valid, ratio.detach(), 0.0).sum(),
            max_abs_log_ratio=behaviour_log_ratio.abs().max() if mask.numel() else mask.sum(),
            is_ratio_sum=torch.where(valid, is_ratio, 0.0).sum(),
            is_ratio_max=torch.where(valid, is_ratio, 0.0).max() if mask.numel() else mask.sum(),
            is_capped_tokens=(capped & valid).to(mask.dtype).sum() if spec.importance_weighted else mask.new_zeros(()),
            behaviour_kl_sum=k3.sum(),
        )
