"""The GRPO loss family as pure functions over tensors: no model, no distributed state.

`LossSpec` holds what the loss takes from the config; `loss_normaliser` says what each micro-batch's summed loss is
divided by, `grpo_loss` computes the surrogate (+ KL, + importance weights, + TRL's masks) and its statistics; each
group brings its advantages (contracts.py). docs/losses.md explains each variant, when to use which, and every bound
the loss puts on a ratio.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from asyncgrpo.config import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES, GenerationSettings, LossSettings

log = logging.getLogger(__name__)

# Past this log-ratio the one unbounded term (the unclipped ratio of a negative advantage with `delta` unset) goes on
# linearly instead of exponentially, and statistics are reported at most e^20 (docs/losses.md, "Bounds").
LOG_RATIO_BOUND = 20.0
_LINEAR_SPAN = 2000.0
# verl's bound on the k3 KL estimate per token (its `low_var_kl`): the KL's value and gradient stop there.
KL_BOUND = 10.0

# Loss types that average over sequences: their normaliser needs the global number of sequences.
_PER_SEQUENCE = ("grpo", "dr_grpo", "sapo", "luspo")
# Loss types whose per-token loss is divided by its sequence's length (the mean per sequence, then over sequences).
_SEQUENCE_MEAN = ("grpo", "sapo")
# Loss types that sum token contributions: with sequence-level ratios each sequence weighs its length (TRL warns).
_TOKEN_SUMS = ("bnpo", "dr_grpo", "dapo", "cispo")


@dataclass
class LossSpecSettings(LossSettings, GenerationSettings):
    """The sections the loss reads: its own keys, and max_completion_length (dr_grpo's constant normaliser)."""


@dataclass(frozen=True)
class LossSpec:
    """Everything the loss takes from the config, fixed for a run. `is_mode` None: no importance weight (the
    off-policy correction is off); with it, the trainer also passes proximal logprobs. `max_completion_length` is
    only read by `dr_grpo`'s normaliser. Defaults are the loss function's, not the config's (`delta` unset here)."""

    epsilon_low: float
    epsilon_high: float
    loss_type: str = "dapo"
    beta: float = 0.0
    importance_sampling_level: str = "token"
    delta: float | None = None
    is_mode: str | None = None
    is_cap: float | None = 3.0
    is_clip_min: float | None = None
    max_completion_length: int | None = None
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    top_entropy_quantile: float = 1.0

    @classmethod
    def from_config(cls, cfg: LossSpecSettings) -> LossSpec:
        """The spec of an AsyncGRPOConfig (`epsilon_high` unset means `epsilon`); warns, as TRL does, when sequence-
        level ratios meet a loss type that sums tokens."""
        if cfg.importance_sampling_level == "sequence" and cfg.loss_type in _TOKEN_SUMS:
            log.warning("importance_sampling_level is `sequence` but loss_type %s sums per-token contributions, which "
                        "weighs each sequence by its completion length instead of optimising the per-sequence "
                        "objective; GSPO's setup is loss_type: grpo", cfg.loss_type)
        if cfg.loss_type == "luspo" and cfg.importance_sampling_level != "sequence":
            log.warning("loss_type luspo is defined with importance_sampling_level: sequence (its paper's setup)")
        return cls(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_upper, loss_type=cfg.loss_type, beta=cfg.beta,
                   importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                   is_mode=cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else None,
                   is_cap=cfg.vllm_importance_sampling_cap, is_clip_min=cfg.vllm_importance_sampling_clip_min,
                   max_completion_length=cfg.max_completion_length,
                   off_policy_mask_threshold=cfg.off_policy_mask_threshold,
                   use_bias_correction_kl=cfg.use_bias_correction_kl, sapo_temperature_pos=cfg.sapo_temperature_pos,
                   sapo_temperature_neg=cfg.sapo_temperature_neg, top_entropy_quantile=cfg.top_entropy_quantile)

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

    @property
    def needs_entropy(self) -> bool:
        """The loss keeps only the highest-entropy tokens (`top_entropy_quantile` < 1)."""
        return self.top_entropy_quantile < 1.0


def loss_normaliser(spec: LossSpec, *, global_tokens: float, global_sequences: float, micro_tokens: float,
                    micro_batches: int, world: int) -> float:
    """What one micro-batch's summed (per-token or, for `grpo`/`sapo`, per-sequence) loss is divided by, so that the
    gradients summed over micro-batches and averaged over ranks (DDP/FSDP/ZeRO average) give TRL's aggregate:

    - dapo, cispo: the mean over every completion token of the global batch (global tokens / world);
    - grpo, sapo: the mean over sequences of each sequence's token mean (global sequences / world; `grpo_loss`
      divides each token by its sequence's length first);
    - luspo: the mean over sequences of each sequence's token sum (global sequences / world);
    - dr_grpo: the sum over tokens divided by sequences x max_completion_length (a constant: no length bias);
    - bnpo: each micro-batch's own token mean, averaged over micro-batches and ranks (TRL: "local batch")."""
    loss_type = spec.loss_type
    if loss_type in ("dapo", "cispo"):
        value = global_tokens / world
    elif loss_type in ("grpo", "sapo", "luspo"):
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
    # current policy) / behaviour, before it is capped (reported at most e^LOG_RATIO_BOUND).
    is_ratio_sum: torch.Tensor | float = 0.0
    is_ratio_max: torch.Tensor | float = 0.0
    is_capped_tokens: torch.Tensor | float = 0.0  # tokens whose IS weight was truncated or masked
    behaviour_kl_sum: torch.Tensor | float = 0.0  # k3 estimate of KL(behaviour || trainer), summed over tokens
    masked_tokens: torch.Tensor | float = 0.0  # tokens the off-policy mask or the entropy quantile left out
    entropy: torch.Tensor | None = None  # (N,) the trainer's entropy at each masked token, when it was computed


def _log(value: float | None, default: float) -> float:
    """log(value), `default` (+-inf) for None, -inf for 0."""
    return default if value is None else (math.log(value) if value > 0 else -math.inf)


def _exp_linear_beyond(x: torch.Tensor, bound: float) -> torch.Tensor:
    """exp(x) up to `bound`, then the tangent line there (same value and slope), with a gradient of at most e^bound.
    The line stops LINEAR_SPAN past `bound` so that even an infinite x stays finite (inf x 0 would be NaN); no real
    log-ratio gets there (log pi - log mu <= 1000 with the producer's floor of -1000 on mu)."""
    top = math.exp(bound)
    return torch.where(x <= bound, torch.exp(x.clamp(max=bound)), top * (1.0 + (x - bound).clamp(0.0, _LINEAR_SPAN)))


def _stat_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))


def importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str, cap: float | None, clip_min: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's vLLM importance-sampling correction, no gradient. All (B, T); returns (weights, ratios for statistics,
    out of bounds): the ratio proximal / behaviour per token (`token_*`) or per sequence (`sequence_*`: the sum of the
    sequence's token log-ratios, exponentiated, broadcast to its tokens); `*_truncate` clamps it to [clip_min, cap],
    `*_mask` sets ratios outside it to 0. Computed in log space: no ratio overflows, whatever the log-ratios."""
    assert mode in IS_MODES, f"unknown importance sampling mode {mode!r}"
    with torch.no_grad():
        diff = torch.where(mask > 0, proximal_logprobs - behaviour_logprobs, 0.0)
        if mode.startswith("sequence"):
            diff = diff.sum(dim=1, keepdim=True).expand_as(diff)  # the product of the ratios, before any bound
        high, low = _log(cap, math.inf), _log(clip_min, -math.inf)
        out = (diff > high) | (diff < low)
        bounded = torch.exp(diff.clamp(min=low, max=high if cap is not None else LOG_RATIO_BOUND))
        weights = bounded if mode.endswith("truncate") else bounded.masked_fill(out, 0.0)
        return weights, _stat_ratio(diff), out


def off_policy_mask(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2): (B, 1), 0 for a sequence with a negative advantage whose mean
    per-token log(behaviour / trainer) exceeds `threshold`, else 1. No gradient."""
    with torch.no_grad():
        kl = torch.where(mask > 0, behaviour_logprobs - logprobs, 0.0).sum(dim=1, keepdim=True)
        kl = kl / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return ((advantages.unsqueeze(1) >= 0) | (kl <= threshold)).to(logprobs.dtype)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL's `top_entropy_quantile`: 1 on the masked tokens whose entropy is at or above the (1 - quantile) quantile
    of this micro-batch's masked tokens, else 0. entropy, mask: (B, T)."""
    valid = mask > 0
    if not valid.any():
        return torch.zeros_like(mask)
    threshold = torch.quantile(entropy[valid].float(), 1.0 - quantile)
    return ((entropy >= threshold) & valid).to(mask.dtype)


def _policy_term(log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, spec: LossSpec):
    """Per-token surrogate loss (B, T) and whether each token's ratio was clipped, from the log-ratio; no exp of an
    unbounded argument, so neither the loss nor its gradient overflows."""
    if spec.loss_type == "cispo":
        # MiniMax-M1 / TRL: the ratio, capped at epsilon_high and detached, weights the policy-gradient term.
        capped = torch.exp(log_ratio.clamp(max=math.log(spec.epsilon_high))).detach()
        return -capped * adv * logprobs, log_ratio > math.log(spec.epsilon_high)
    if spec.loss_type == "sapo":
        # TRL's SAPO: a soft gate 4/tau * sigmoid(tau (r - 1)) instead of the clip. Past log r = 20 the gate is 1 and
        # its slope below e^-(4e8): the cap changes nothing representable.
        tau = torch.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv, torch.zeros_like(log_ratio, dtype=torch.bool)
    # PPO's -min(r A, clip(r, 1-el, 1+eh) A), delta capping r in the first term, written per advantage sign:
    # A > 0: A * min(r, 1+eh); A < 0: A * clamp(r, 1-el, delta) (no upper bound without delta).
    up = math.log1p(spec.epsilon_high)
    low = _log(1.0 - spec.epsilon_low, -math.inf)
    positive = torch.exp(log_ratio.clamp(max=up))
    if spec.delta is not None:
        negative = torch.exp(log_ratio.clamp(min=low, max=math.log(spec.delta)))
    else:
        negative = _exp_linear_beyond(log_ratio.clamp(min=low), LOG_RATIO_BOUND)
    per_token = -torch.where(adv > 0, positive, negative) * adv
    was_clipped = ((log_ratio < low) & (adv < 0)) | ((log_ratio > up) & (adv > 0))
    if spec.delta is not None:
        was_clipped = was_clipped | ((log_ratio > math.log(spec.delta)) & (adv < 0))
    return per_token, was_clipped


def _kl_term(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """verl's bounded k3 estimate of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - pi clamped to +-20, the
    result clamped to at most KL_BOUND (it is >= 0 already)."""
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return (torch.exp(d) - d - 1.0).clamp(max=KL_BOUND)


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
    entropy: torch.Tensor | None = None,
) -> LossTerms:
    """Surrogate of the chosen `spec.loss_type` (+ optional k3 KL to the reference policy).

    logprobs, behaviour_logprobs, mask, ref_logprobs, proximal_logprobs, entropy: (B, T); advantages: (B,).
    `normaliser` is what the summed loss is divided by (`loss_normaliser`: for the default `dapo`, the global
    batch's completion-token count per rank, so that micro-batches and ranks add up to one token-level mean).
    The ratio is pi / proximal when `proximal_logprobs` is given, else pi / behaviour; `spec.importance_sampling_level:
    sequence` replaces it by the sequence's geometric mean ratio (GSPO), from the unclamped token log-ratios.
    `spec.delta` caps the unclipped ratio; `spec.is_mode` weights each token by proximal / behaviour
    (`importance_weights`); `spec.off_policy_mask_threshold` and `spec.top_entropy_quantile` (with `entropy`) leave
    tokens out, as TRL does (the normaliser is unchanged).
    """
    assert spec.loss_type in LOSS_TYPES and spec.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS
    mask = mask.to(logprobs.dtype)
    valid = mask > 0
    base = behaviour_logprobs if proximal_logprobs is None else proximal_logprobs
    log_ratio = torch.where(valid, logprobs - base, 0.0)  # (B, T); 0 on padding: nothing there reaches an exp
    if spec.importance_sampling_level == "sequence":
        seq = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
        log_ratio = seq.expand_as(log_ratio)
    adv = advantages.unsqueeze(1)  # (B, 1)
    per_token, was_clipped = _policy_term(log_ratio, logprobs, adv, spec)
    kept = torch.ones_like(mask)
    if spec.off_policy_mask_threshold is not None:
        kept = kept * off_policy_mask(logprobs, behaviour_logprobs, advantages, mask, spec.off_policy_mask_threshold)
    if spec.needs_entropy:
        assert entropy is not None, "top_entropy_quantile < 1 needs the per-token entropy"
        kept = kept * high_entropy_mask(entropy, mask, spec.top_entropy_quantile)
    per_token = per_token * kept
    stats_base = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
    is_w, is_ratio, capped = importance_weights(stats_base, behaviour_logprobs, mask, mode=spec.is_mode or
                                                "token_truncate", cap=spec.is_cap, clip_min=spec.is_clip_min)
    if spec.importance_weighted:
        per_token = per_token * is_w
    kl = torch.zeros_like(per_token)
    if spec.needs_reference:
        assert ref_logprobs is not None, "beta > 0 needs reference logprobs"
        kl = _kl_term(ref_logprobs, logprobs)
        if spec.use_bias_correction_kl:  # TRL: the KL times the (differentiable) ratio; capped as the surrogate's
            kl = kl * torch.exp(log_ratio.clamp(max=_log(spec.delta, LOG_RATIO_BOUND)))
        per_token = per_token + spec.beta * kl
    if spec.loss_type in _SEQUENCE_MEAN:  # each sequence's token mean, then (via the normaliser) over sequences
        per_token = per_token / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    loss = torch.where(valid, per_token, 0.0).sum() / normaliser
    with torch.no_grad():
        behaviour_log_ratio = torch.where(valid, logprobs.detach() - behaviour_logprobs, 0.0)
        b = behaviour_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        k3 = torch.where(valid, torch.exp(b) - 1.0 - b, 0.0)
        return LossTerms(
            loss=loss,
            n_tokens=mask.sum(),
            clipped_tokens=(was_clipped & valid).to(mask.dtype).sum(),
            kl_sum=torch.where(valid, kl.detach(), 0.0).sum(),
            ratio_sum=torch.where(valid, _stat_ratio(log_ratio.detach()), 0.0).sum(),
            max_abs_log_ratio=behaviour_log_ratio.abs().max() if mask.numel() else mask.sum(),
            is_ratio_sum=torch.where(valid, is_ratio, 0.0).sum(),
            is_ratio_max=torch.where(valid, is_ratio, 0.0).max() if mask.numel() else mask.sum(),
            is_capped_tokens=(capped & valid).to(mask.dtype).sum() if spec.importance_weighted else mask.new_zeros(()),
            behaviour_kl_sum=k3.sum(),
            masked_tokens=((kept < 1) & valid).to(mask.dtype).sum(),
            entropy=None if entropy is None else entropy.detach()[valid],
        )
