"""One optimizer step's metrics, collected in one object under their tracker names (docs/metrics.md).

`StepMetrics` gathers what the batch held, what the optimizer step measured, how long the weight sync took and the
rollout side's counters, each through a small named method, and hands them to the logger. `LossTotals` adds up a
rank's loss statistics over its micro-batches and reduces them over ranks in two collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncgrpo.contracts import Group
from asyncgrpo.distributed import dist_maxima, dist_sums
from asyncgrpo.rewards import reward_means
from asyncgrpo.trainer.loss import LossTerms

# The entropy histogram's bins (nats): fixed, so that ranks add theirs up in one all-reduce. 16 nats is the entropy of
# a uniform distribution over 8.9M tokens; a quantile read from the histogram is within one bin (1/16 nat).
ENTROPY_BINS = 256
ENTROPY_MAX = 16.0
ENTROPY_QUANTILES = (0.1, 0.5, 0.9)

# The run summary's counters (run_summary.json key -> the rollout side's counter).
SUMMARY_COUNTERS = {"dropped_stale": "queue/dropped_stale_total", "dropped_zero_std": "queue/dropped_zero_std_total",
                    "lost_groups": "rollout/lost_groups_total", "resent_groups": "rollout/resent_groups_total"}


def summary_counters(counters: dict[str, float]) -> dict[str, float]:
    """The rollout side's counters (`RolloutInterface.stats()`) the run summary records, under its keys."""
    return {key: counters[name] for key, name in SUMMARY_COUNTERS.items()}


class LossTotals:
    """This rank's loss statistics over its micro-batches: sums (per-token statistics, the loss) and maxima. The
    loss is divided by the world size: DDP averages the gradients over ranks, so the ranks' losses add up to it.
    They add up on the device the terms are on (float64): the host reads them once per step, in `reduced`, not once
    per statistic and micro-batch (each read waits for the GPU to finish everything queued before it)."""

    SUMS = ("loss", "clipped", "kl", "ratio", "is_ratio", "is_capped", "kl_behaviour", "masked", "entropy")
    MAXIMA = ("max_abs_log_ratio", "is_ratio_max")

    def __init__(self, world: int):
        self.world = world
        self._sums: torch.Tensor | None = None  # (len(SUMS),), on the first micro-batch's device
        self._maxima: torch.Tensor | None = None  # (len(MAXIMA),)
        self._entropy_hist: torch.Tensor | None = None  # (ENTROPY_BINS,) tokens per entropy bin, this rank

    def add(self, terms: LossTerms) -> None:
        """One micro-batch's terms (no host sync)."""
        device = terms.loss.device
        if self._sums is None:
            self._sums = torch.zeros(len(self.SUMS), dtype=torch.float64, device=device)
            self._maxima = torch.zeros(len(self.MAXIMA), dtype=torch.float64, device=device)
            self._entropy_hist = torch.zeros(ENTROPY_BINS, dtype=torch.float64, device=device)
        entropy = terms.entropy.float() if terms.entropy is not None and terms.entropy.numel() else None
        self._sums += _stacked(device, terms.loss.detach().double() / self.world, terms.clipped_tokens, terms.kl_sum,
                               terms.ratio_sum, terms.is_ratio_sum, terms.is_capped_tokens, terms.behaviour_kl_sum,
                               terms.masked_tokens, entropy.sum() if entropy is not None else 0.0)
        self._maxima = torch.maximum(self._maxima, _stacked(device, terms.max_abs_log_ratio, terms.is_ratio_max))
        if entropy is not None:
            self._entropy_hist += torch.histc(entropy, ENTROPY_BINS, 0.0, ENTROPY_MAX).double()

    def reduced(self) -> tuple[dict[str, float], dict[str, float], list[float]]:
        """Collective: (sums, maxima, entropy histogram) over every rank, in two all-reduces, after one read of this
        rank's totals from its device."""
        n, bins = len(self.SUMS), ENTROPY_BINS
        local = ([0.0] * (n + bins + len(self.MAXIMA)) if self._sums is None else
                 torch.cat([self._sums, self._entropy_hist, self._maxima]).tolist())  # the step's one host sync
        summed = dist_sums(local[:n + bins])
        sums = dict(zip(self.SUMS, summed[:n]))
        maxima = dict(zip(self.MAXIMA, dist_maxima(local[n + bins:])))
        return sums, maxima, summed[n:]


def _stacked(device: torch.device, *values: torch.Tensor | float) -> torch.Tensor:
    """`values` as one float64 vector on `device`: tensors stay on the device (no copy through the host), numbers
    are filled in there."""
    return torch.stack([v.detach().to(device=device, dtype=torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                        else torch.full((), float(v), dtype=torch.float64, device=device) for v in values])


def histogram_quantile(hist: list[float], q: float, top: float = ENTROPY_MAX) -> float:
    """The q-quantile of values counted in `hist` (equal bins over [0, top]), linear within its bin; 0 if empty."""
    total = sum(hist)
    if total <= 0:
        return 0.0
    width, seen = top / len(hist), 0.0
    for i, count in enumerate(hist):
        if count > 0 and seen + count >= q * total:
            return (i + (q * total - seen) / count) * width
        seen += count
    return top


@dataclass
class StepMetrics:
    """What one optimizer step measured, by tracker name; rank 0 hands `values` to the logger. Quantities TRL's
    GRPOTrainer logs too carry its names as its trackers show them (`train/` before each: transformers adds it)."""

    values: dict[str, float] = field(default_factory=dict)

    def _put(self, values: dict[str, float]) -> None:
        self.values.update({k: float(v) for k, v in values.items()})

    def batch(self, groups: list[Group], version: int, num_generations: int, waited_s: float) -> None:
        """Rank 0: what this step's batch holds (rewards, staleness against the trainer's `version` now, lengths),
        and how long the trainer waited for it."""
        staleness = [version - g.version for g in groups]
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        completions = sum(len(g.completion_ids) for g in groups)  # an agent's episode may make several
        lengths = [len(c) for g in groups for c in g.completion_ids]
        self._put({"time/wait_for_data_s": waited_s, "train/reward": rewards.mean(), "train/reward_std": rewards.std(),
                   "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
                   # groups of this batch whose rewards are all equal (0 with dynamic_sampling)
                   "train/frac_reward_zero_std": sum(max(g.rewards) == min(g.rewards) for g in groups) / len(groups),
                   "train/completions/mean_length": sum(lengths) / completions,
                   "train/completions/min_length": min(lengths), "train/completions/max_length": max(lengths),
                   # hit max_completion_length (left out of the loss with mask_truncated_completions)
                   "train/completions/clipped_ratio": sum(r == "length" for g in groups for r in g.finish_reasons)
                   / completions})
        episodes = [g for g in groups if g.loss_mask]
        if episodes:
            self._put(episode_values(episodes, version))
        for name, mean in reward_means([g.reward_parts for g in groups]).items():
            if mean is not None:  # None: the function applied to no completion of this batch
                self._put({f"train/rewards/{name}/mean": mean})

    def micro_batches(self, count: int) -> None:
        """This rank's micro-batches for a new batch (the same count on every rank with a token budget)."""
        self._put({"train/micro_batches": count})

    def grad_norm(self, norm: float) -> None:
        self._put({"train/grad_norm": norm})

    def optimiser(self, sums: dict[str, float], maxima: dict[str, float], n_tokens: float, lr: float,
                  entropy_hist: list[float] | None = None) -> None:
        """The step's loss statistics over every rank (`LossTotals.reduced`), per token of the global batch, with
        its token count and the learning rate it used; the entropy's mean and quantiles when it was computed."""
        per_token = max(n_tokens, 1.0)  # every token masked (e.g. all truncated): statistics of nothing are 0
        if entropy_hist is not None and sum(entropy_hist) > 0:
            # The trainer's per-token entropy on the completion tokens (TRL's `entropy`), and its spread.
            self._put({"train/entropy": sums["entropy"] / per_token,
                       **{f"train/entropy_p{round(q * 100)}": histogram_quantile(entropy_hist, q)
                          for q in ENTROPY_QUANTILES}})
        if sums.get("masked"):  # tokens off_policy_mask_threshold or top_entropy_quantile left out of the loss
            self._put({"train/masked_fraction": sums["masked"] / per_token})
        self._put({"train/loss": sums["loss"], "train/clip_ratio/region_mean": sums["clipped"] / per_token,
                   "train/kl": sums["kl"] / per_token, "train/ratio_mean": sums["ratio"] / per_token,
                   "train/tokens": n_tokens, "train/learning_rate": lr,
                   # Per token, trainer vs the server's behaviour logprobs: numerical noise when on-policy.
                   "train/max_abs_log_ratio": maxima["max_abs_log_ratio"],
                   # Off-policy: the IS ratio proximal (or current) / behaviour before any cap, the fraction of
                   # tokens the correction truncated or masked, and the k3 estimate of KL(behaviour || trainer).
                   "train/sampling/importance_sampling_ratio/mean": sums["is_ratio"] / per_token,
                   "train/sampling/importance_sampling_ratio/max": maxima["is_ratio_max"],
                   "train/sampling/is_capped_fraction": sums["is_capped"] / per_token,
                   "train/sampling/kl_behaviour": sums["kl_behaviour"] / per_token})

    def sync(self, gather_s: float, wait_previous_publish_s: float, gathered_bytes: int) -> None:
        """Rank 0: the weight sync's gather and its wait for the previous publish."""
        self._put({"sync/gather_s": gather_s, "sync/wait_previous_publish_s": wait_previous_publish_s,
                   "sync/gathered_bytes": gathered_bytes})

    def rollout(self, counters: dict[str, float], version: int) -> None:
        """Rank 0, after the step's sync: the rollout side's counters now and the policy version served."""
        self._put({**counters, "policy/version": version})

    @property
    def reward_mean(self) -> float:
        return self.values["train/reward"]

    def log(self, logger, step: int) -> None:
        """Hand the values to `logger` (the rollout side: `log(values, step)` writes every tracker)."""
        logger.log(self.values, step)


@dataclass
class RunLoss:
    """The steps' losses over one `train()` call, for the `training_loss` it returns: their mean over the steps this
    call ran, as transformers' Trainer computes it (steps a resumed checkpoint had trained are not counted; every step
    counts, logged or not; 0.0 when no step ran). Every rank holds the same value: each step's loss is reduced."""

    total: float = 0.0
    steps: int = 0

    def add(self, step_loss: float) -> None:
        self.total += step_loss
        self.steps += 1

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else 0.0


def turns(loss_mask: list[int]) -> int:
    """Model turns of one episode: the runs of sampled tokens (1s) in its loss mask."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def episode_values(groups: list[Group], version: int) -> dict[str, float]:
    """Per-step statistics of a batch's episodes (docs/metrics.md): turns, tokens (all, and sampled ones), the
    fraction truncated and the oldest token's staleness."""
    masks = [m for g in groups for m in g.loss_mask]
    n = len(masks)
    oldest = min((min(v) for g in groups for v in g.versions if v), default=version)
    return {"episode/turns_mean": sum(turns(m) for m in masks) / n,
            "episode/tokens_mean": sum(len(m) for m in masks) / n,
            "episode/sampled_tokens_mean": sum(sum(m) for m in masks) / n,
            "episode/truncated_fraction": sum(r == "length" for g in groups for r in g.finish_reasons) / n,
            "episode/token_staleness_max": version - oldest}
