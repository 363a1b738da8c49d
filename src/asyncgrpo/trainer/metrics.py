"""One optimizer step's metrics, collected in one object under their TensorBoard names (docs/metrics.md).

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
    loss is divided by the world size: DDP averages the gradients over ranks, so the ranks' losses add up to it."""

    SUMS = ("loss", "clipped", "kl", "ratio", "is_ratio", "is_capped", "kl_behaviour", "masked", "entropy")
    MAXIMA = ("max_abs_log_ratio", "is_ratio_max")

    def __init__(self, world: int):
        self.world = world
        self.sums = dict.fromkeys(self.SUMS, 0.0)
        self.maxima = dict.fromkeys(self.MAXIMA, 0.0)
        self.entropy_hist = torch.zeros(ENTROPY_BINS, dtype=torch.float64)  # tokens per entropy bin, this rank

    def add(self, terms: LossTerms) -> None:
        """One micro-batch's terms."""
        for key, value in (("loss", float(terms.loss.detach()) / self.world), ("clipped", terms.clipped_tokens),
                           ("kl", terms.kl_sum), ("ratio", terms.ratio_sum), ("is_ratio", terms.is_ratio_sum),
                           ("is_capped", terms.is_capped_tokens), ("kl_behaviour", terms.behaviour_kl_sum),
                           ("masked", terms.masked_tokens)):
            self.sums[key] += float(value)
        if terms.entropy is not None and terms.entropy.numel():
            entropy = terms.entropy.float()
            self.sums["entropy"] += float(entropy.sum())
            self.entropy_hist += torch.histc(entropy, ENTROPY_BINS, 0.0, ENTROPY_MAX).cpu().double()
        self.maxima["max_abs_log_ratio"] = max(self.maxima["max_abs_log_ratio"], float(terms.max_abs_log_ratio))
        self.maxima["is_ratio_max"] = max(self.maxima["is_ratio_max"], float(terms.is_ratio_max))

    def reduced(self) -> tuple[dict[str, float], dict[str, float], list[float]]:
        """Collective: (sums, maxima, entropy histogram) over every rank, in two all-reduces."""
        summed = dist_sums([self.sums[k] for k in self.SUMS] + self.entropy_hist.tolist())
        sums = dict(zip(self.SUMS, summed[:len(self.SUMS)]))
        maxima = dict(zip(self.MAXIMA, dist_maxima([self.maxima[k] for k in self.MAXIMA])))
        return sums, maxima, summed[len(self.SUMS):]


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
    """What one optimizer step measured, by TensorBoard name; rank 0 hands `values` to the logger."""

    values: dict[str, float] = field(default_factory=dict)

    def _put(self, values: dict[str, float]) -> None:
        self.values.update({k: float(v) for k, v in values.items()})

    def batch(self, groups: list[Group], version: int, num_generations: int, waited_s: float) -> None:
        """Rank 0: what this step's batch holds (rewards, staleness against the trainer's `version` now, lengths),
        and how long the trainer waited for it."""
        staleness = [version - g.version for g in groups]
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        completions = len(groups) * num_generations
        self._put({"time/wait_for_data_s": waited_s, "reward/mean": rewards.mean(), "reward/std": rewards.std(),
                   "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
                   # TRL's name: groups of this batch whose rewards are all equal (0 with dynamic_sampling)
                   "reward/frac_reward_zero_std": sum(max(g.rewards) == min(g.rewards) for g in groups) / len(groups),
                   "completion/mean_length": sum(g.n_completion_tokens for g in groups) / completions,
                   # hit max_completion_length (left out of the loss with mask_truncated_completions)
                   "completion/truncated_fraction": sum(r == "length" for g in groups for r in g.finish_reasons)
                   / completions})
        episodes = [g for g in groups if g.loss_mask]
        if episodes:
            self._put(episode_values(episodes, version))
        for name, mean in reward_means([g.reward_parts for g in groups]).items():
            if mean is not None:  # None: the function applied to no completion of this batch
                self._put({f"reward/{name}": mean})

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
        self._put({"train/loss": sums["loss"], "train/clip_fraction": sums["clipped"] / per_token,
                   "train/kl": sums["kl"] / per_token, "train/ratio_mean": sums["ratio"] / per_token,
                   "train/tokens": n_tokens, "train/learning_rate": lr,
                   # Per token, trainer vs the server's behaviour logprobs: numerical noise when on-policy.
                   "train/max_abs_log_ratio": maxima["max_abs_log_ratio"],
                   # Off-policy: the IS ratio proximal (or current) / behaviour before any cap, the fraction of
                   # tokens the correction truncated or masked, and the k3 estimate of KL(behaviour || trainer).
                   "sampling/importance_sampling_ratio/mean": sums["is_ratio"] / per_token,
                   "sampling/importance_sampling_ratio/max": maxima["is_ratio_max"],
                   "sampling/is_capped_fraction": sums["is_capped"] / per_token,
                   "sampling/kl_behaviour": sums["kl_behaviour"] / per_token})

    def sync(self, gather_s: float, wait_previous_publish_s: float, gathered_bytes: int) -> None:
        """Rank 0: the weight sync's gather and its wait for the previous publish."""
        self._put({"sync/gather_s": gather_s, "sync/wait_previous_publish_s": wait_previous_publish_s,
                   "sync/gathered_bytes": gathered_bytes})

    def rollout(self, counters: dict[str, float], version: int) -> None:
        """Rank 0, after the step's sync: the rollout side's counters now and the policy version served."""
        self._put({**counters, "policy/version": version})

    @property
    def reward_mean(self) -> float:
        return self.values["reward/mean"]

    def log(self, logger, step: int) -> None:
        """Hand the values to `logger` (the rollout side: `log(values, step)` writes TensorBoard)."""
        logger.log(self.values, step)


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
