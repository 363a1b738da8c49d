"""Held-out evaluation through the inference server: greedy completions of a served model, scored."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .rewards import RewardScorer
from .rollout.producer import PromptRow, decode_completion


def evaluate_served(client, model: str, rows: list[PromptRow], tokenizer, scorer: RewardScorer,
                    max_tokens: int, concurrency: int = 16) -> float:
    """Mean reward of greedy (temperature 0) completions of `model` on the server, one per prompt."""

    def one(row: PromptRow) -> float:
        completion = client.complete(model, row.prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0)[0]
        text = decode_completion(tokenizer, completion.token_ids)
        columns = {k: [v] for k, v in row.columns.items()}
        total, _ = scorer.score([row.prompt], [text], columns)
        return total[0]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        scores = list(pool.map(one, rows))
    return sum(scores) / len(scores)
