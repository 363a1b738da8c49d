"""Held-out evaluation through the inference server: completions of a served model, scored by the reward.

Used by `asyncgrpo demo` and the benchmarks to measure a base model or a trained adapter as vLLM serves it, so the
figure includes everything between the trainer and the server.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from asyncgrpo.data import PromptRow
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.scoring import decode_completion


def evaluate_served(client, model: str, rows: list[PromptRow], tokenizer, scorer: RewardScorer, *,
                    max_tokens: int, temperature: float = 0.0, n: int = 1, concurrency: int = 16) -> float:
    """Mean reward of `n` completions per held-out prompt from `model` on the server (temperature 0 = greedy)."""

    def one(row: PromptRow) -> float:
        completions = client.complete(model, row.prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature)
        texts = [decode_completion(tokenizer, c.token_ids) for c in completions]
        columns = {k: [v] * n for k, v in row.columns.items()}
        total, _ = scorer.score([row.prompt] * n, texts, columns)
        return sum(total) / n

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        scores = list(pool.map(one, rows))
    return sum(scores) / len(scores)
