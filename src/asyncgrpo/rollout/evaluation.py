"""Held-out evaluation through an inference server: completions of a served model or adapter, scored by the reward.

One function serves the trainer's evaluation every `eval_steps` (rollout/side.py, under the live adapter) and the
demo's and benchmarks' before/after figures, so each figure includes everything between the trainer and the server.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.scoring import GroupScorer


@dataclass
class EvalResult:
    """Mean and std of the total reward over every completion, and each function's mean where it applied."""

    reward: float
    reward_std: float
    per_function: dict[str, float]
    completions: int

    def metrics(self) -> dict[str, float]:
        """TRL's evaluation names, as its trackers show them."""
        return {"eval/reward": self.reward, "eval/reward_std": self.reward_std,
                **{f"eval/rewards/{name}/mean": mean for name, mean in self.per_function.items()}}


def evaluate_served(client, model: str, rows: list[PromptRow], scorer: GroupScorer, *, max_tokens: int,
                    temperature: float = 0.0, n: int = 1, concurrency: int = 16) -> EvalResult:
    """`n` completions per held-out prompt from `model` on the server (temperature 0 = greedy), each group scored
    as training scores it (`scorer.score_group`: the same decoding, chat form and reward functions)."""

    def one(row: PromptRow) -> tuple[list[float], dict[str, list]]:
        completions = client.complete(model, row.prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature)
        return scorer.score_group(row, [c.token_ids for c in completions], [c.finish_reason for c in completions])

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        scored = list(pool.map(one, rows))
    totals = [r for rewards, _ in scored for r in rewards]
    parts: dict[str, list[float]] = {}
    for _, group_parts in scored:
        for name, values in group_parts.items():
            parts.setdefault(name, []).extend(v for v in values if v is not None)
    return EvalResult(reward=statistics.fmean(totals),
                      reward_std=statistics.stdev(totals) if len(totals) > 1 else 0.0,
                      per_function={name: statistics.fmean(v) for name, v in parts.items() if v},
                      completions=len(totals))
