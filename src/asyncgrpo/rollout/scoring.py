"""Turning one group's sampled token ids into rewards: decode, put in the form reward functions take, score.

The producer calls `score_group(row, completion_ids, finish_reasons)` on a `GroupScorer`: `InThreadScoring` here
(`reward_workers: 0`) or reward_pool.RewardPool (worker processes); rollout/build.py's make_group_scorer picks one.
Both run the same `score_group`, so they give the same rewards. This module imports neither torch nor transformers,
so that a reward worker starts without them.
"""

from __future__ import annotations

from typing import Protocol

from asyncgrpo.data import PromptRow, parse_completions
from asyncgrpo.rewards import RewardScorer


def decode_completion(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Token ids -> text; ids outside the tokenizer (padded vocab rows) decode to U+FFFD, so they score as wrong.
    `skip_special_tokens=False` keeps end-of-turn markers, which a response template needs to close regions."""
    size = len(tokenizer)
    pieces, run = [], []
    for i in ids:
        if i < size:
            run.append(i)
            continue
        pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        pieces.append("\ufffd")
        run = []
    pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return "".join(pieces)


def reward_inputs(tokenizer, response_template: dict | None, row: PromptRow,
                  ids: list[list[int]]) -> tuple[list, list | None]:
    """(completions, parsed) as reward functions get them: text for a text prompt; for a chat prompt TRL's
    conversational form `[{"role": "assistant", "content": text}]`, plus the parsed messages when the tokenizer
    has a response template (None where a completion could not be parsed)."""
    texts = [decode_completion(tokenizer, i) for i in ids]
    if not row.is_chat:
        return texts, None
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    if response_template is None:
        return completions, None
    raw = [decode_completion(tokenizer, i, skip_special_tokens=False) for i in ids]
    return completions, parse_completions(tokenizer, response_template, row.rendered, raw)


def score_group(scorer: RewardScorer, tokenizer, response_template: dict | None, row: PromptRow,
                completion_ids: list[list[int]], finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
    """Decode and score one group: what both `GroupScorer`s run, in a thread or in a worker process."""
    n = len(completion_ids)
    columns = {k: [v] * n for k, v in row.columns.items()}
    completions, parsed = reward_inputs(tokenizer, response_template, row, completion_ids)
    truncated = [reason == "length" for reason in finish_reasons]  # hit max_completion_length
    return scorer.score([row.prompt] * n, completions, columns, completion_ids=completion_ids, parsed=parsed,
                        truncated=truncated)


class GroupScorer(Protocol):
    """What the producer scores with: the same call whether scoring runs in its thread or in worker processes."""

    fallbacks: int  # completions scored with reward_fallback so far (reward/fallbacks_total)

    def score_group(self, row: PromptRow, completion_ids: list[list[int]],
                    finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
        """(total reward per completion, {function name: its rewards, None where it does not apply})."""

    def close(self) -> None:
        """Release what scoring holds (worker processes); safe to call twice."""


class InThreadScoring:
    """`reward_workers: 0`: decode and score in the calling thread (the producer's request threads)."""

    def __init__(self, scorer: RewardScorer, tokenizer, response_template: dict | None = None):
        self.scorer, self.tokenizer, self.response_template = scorer, tokenizer, response_template

    @property
    def fallbacks(self) -> int:
        return self.scorer.fallbacks

    def score_group(self, row: PromptRow, completion_ids: list[list[int]],
                    finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
        return score_group(self.scorer, self.tokenizer, self.response_template, row, completion_ids, finish_reasons)

    def close(self) -> None:
        pass
