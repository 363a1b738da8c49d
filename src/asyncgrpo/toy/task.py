"""The toy task: which of two different 2-digit numbers is larger? Prompt `07,45>` (6 characters), answer `45`.

All 9,900 ordered pairs of different numbers exist; a seed shuffles them and the first `n_heldout` are held out.
Each row also carries the `distractor` (the smaller number): the warm-up teaches the model that the answer is
one of the two operands but, on purpose, mostly the wrong one, so that RL has a clear signal to learn from
(see asyncgrpo.toy.world).
"""

from __future__ import annotations

import random
import time
from typing import Any

from asyncgrpo.errors import ConfigError

N_PAIRS = 100 * 99
PROMPT_LENGTH = 6
"""Every prompt is `dd,dd>`: 6 characters, hence 6 tokens, so batches need no padding."""


def prompt_text(a: int, b: int) -> str:
    """The prompt for the pair (a, b), zero-padded: `prompt_text(7, 45) == "07,45>"`."""
    return f"{a:02d},{b:02d}>"


def answer_text(a: int, b: int) -> str:
    """The larger operand, zero-padded like the prompt: `answer_text(7, 45) == "45"`, `answer_text(3, 1) == "03"`."""
    return f"{max(a, b):02d}"


def distractor_text(a: int, b: int) -> str:
    """The smaller operand, zero-padded: the plausible wrong answer."""
    return f"{min(a, b):02d}"


def make_split(seed: int, n_heldout: int = 500) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """All pairs as rows `{"prompt": "07,45>", "answer": "45", "distractor": "07"}`, shuffled by `seed`;
    returns (train, heldout). The first `n_heldout` rows of the shuffle are held out, the rest are train."""
    if not 0 < n_heldout < N_PAIRS:
        raise ConfigError("n_heldout", f"must be between 1 and {N_PAIRS - 1}, got {n_heldout}", "use e.g. 500")
    pairs = [(a, b) for a in range(100) for b in range(100) if a != b]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": prompt_text(a, b), "answer": answer_text(a, b), "distractor": distractor_text(a, b)}
            for a, b in pairs]
    return rows[n_heldout:], rows[:n_heldout]


def _completion_text(completion: Any) -> str:
    """The text of a completion: a string, or (TRL's conversational form) a list of messages, last one wins."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(
        f"completion must be a string or a list of chat messages, got {type(completion).__name__}: {completion!r}"
    )


def larger_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL-style reward: 1.0 where the completion, stripped of surrounding whitespace, equals the answer, else 0.0.

    `answer` is the dataset column of the same name, one entry per completion; extra columns arrive in `kwargs`
    and are ignored. No partial credit: `"45 "` scores 1.0, `"045"`, `"45."` and the distractor score 0.0.
    """
    if len(completions) != len(answer):
        raise ValueError(
            f"larger_reward got {len(completions)} completions but {len(answer)} answers; "
            "pass the dataset's `answer` column repeated once per completion"
        )
    return [1.0 if _completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def slow_larger_reward(prompts: list[str], completions: list[str], answer: list[str], *,
                       ms_per_completion: float = 20.0, **kwargs: Any) -> list[float]:
    """`larger_reward` after `ms_per_completion` milliseconds of pure-Python CPU work per completion (thread CPU
    time, so the cost is the same however busy the machine is): the CPU-heavy reward of `asyncgrpo bench rank0`,
    standing in for a parser or checker written in Python. Like such code it holds the GIL all the while."""
    end = time.thread_time() + ms_per_completion / 1000 * len(completions)
    while time.thread_time() < end:
        pass
    return larger_reward(prompts, completions, answer)
