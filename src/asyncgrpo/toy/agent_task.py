"""The toy agent task: find the value behind a key in a hidden table that only the `lookup` tool can read.

A world seed draws the table: chains `key -> key -> ... -> value` of 1-4 hops (keys are two lowercase letters,
values two digits), short chains more often than long ones. A question is a chain's first key (`find qx`); the
answer is the value at its end, so it takes one `lookup` per hop. `LookupEnv` is the environment class (one
instance per episode), `lookup_reward` the reward. Imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import os
import random
import string
import time
from itertools import product
from typing import Any

from asyncgrpo.errors import ConfigError

KEYS: tuple[str, ...] = tuple("".join(p) for p in product(string.ascii_lowercase, repeat=2))
"""Every possible key, `aa` .. `zz` (676)."""

HOP_WEIGHTS: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
"""Probability of a chain of 1, 2, 3, 4 hops: turn counts are long-tailed."""

N_CHAINS = 300
"""Chains per table (about 600 of the 676 keys are used, so a mistyped key often exists and misleads)."""

LATENCY_ENV = "ASYNCGRPO_TOY_TOOL_LATENCY_S"
DEFAULT_LATENCY_S = 0.005
"""Simulated seconds per `lookup` call unless LATENCY_ENV or `LookupEnv.latency_s` says otherwise."""


def question_text(key: str) -> str:
    """The user message of a question: `question_text("qx") == "find qx"`."""
    return f"find {key}"


def draw_chains(rng: random.Random, keys: list[str], n_chains: int) -> list[list[str]]:
    """`n_chains` chains `[key, ..., key, value]` over distinct keys taken from `keys` (consumed), with hop
    counts drawn from HOP_WEIGHTS; the last element is a two-digit value."""
    chains = []
    for _ in range(n_chains):
        hops = rng.choices(range(1, len(HOP_WEIGHTS) + 1), weights=HOP_WEIGHTS)[0]
        if len(keys) < hops:
            raise ConfigError("n_chains", f"{n_chains} chains need more than the {len(KEYS)} keys",
                              f"use at most {N_CHAINS} chains")
        chains.append([keys.pop() for _ in range(hops)] + [f"{rng.randrange(100):02d}"])
    return chains


@functools.lru_cache(maxsize=8)
def make_table(seed: int) -> tuple[dict[str, str], tuple[tuple[str, ...], ...]]:
    """The world's hidden table `{key: next key or value}` and its chains, drawn from `seed` (cached)."""
    rng = random.Random(f"agent-table-{seed}")
    keys = list(KEYS)
    rng.shuffle(keys)
    chains = draw_chains(rng, keys, N_CHAINS)
    table = {chain[i]: chain[i + 1] for chain in chains for i in range(len(chain) - 1)}
    return table, tuple(tuple(c) for c in chains)


def chain_row(chain: tuple[str, ...] | list[str], seed: int) -> dict[str, Any]:
    """A dataset row for one chain: the chat prompt, the answer, and what the environment and metrics need."""
    return {"prompt": [{"role": "user", "content": question_text(chain[0])}], "answer": chain[-1],
            "key": chain[0], "hops": len(chain) - 1, "world_seed": seed}


def make_agent_split(seed: int, n_heldout: int = 100) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, heldout) rows, one per chain of the seed's table. Whole chains are held out, so no held-out key is
    ever looked up in training."""
    if not 0 < n_heldout < N_CHAINS:
        raise ConfigError("n_heldout", f"must be between 1 and {N_CHAINS - 1}, got {n_heldout}", "use e.g. 100")
    rows = [chain_row(chain, seed) for chain in make_table(seed)[1]]
    return rows[n_heldout:], rows[:n_heldout]


class UnknownKeyError(LookupError):
    """`lookup` of a key that is not in the table; its message is what the model reads."""

    def __str__(self) -> str:
        return f"unknown key {self.args[0]}"


class LookupEnv:
    """One episode's environment: the hidden table of the row's world, reachable only through `lookup`.

    `reset(**row)` takes a dataset row (it needs `world_seed`); its public method `lookup` is the tool. Set the
    class attribute `latency_s` (or the environment variable ASYNCGRPO_TOY_TOOL_LATENCY_S) to simulate a slower
    tool; it defaults to DEFAULT_LATENCY_S.
    """

    latency_s: float | None = None

    def __init__(self) -> None:
        self.table: dict[str, str] | None = None
        self.calls: list[str] = []

    def reset(self, **row: Any) -> None:
        """Start an episode on the table of `row["world_seed"]`; the other columns are ignored."""
        if "world_seed" not in row:
            raise ConfigError("world_seed", f"missing from the dataset row (columns: {sorted(row)})",
                              "use the toy agent world's rows (asyncgrpo.toy.agent_task.make_agent_split)")
        self.table = make_table(int(row["world_seed"]))[0]
        self.calls = []

    def lookup(self, key: str) -> str:
        """Look up a key in the hidden table.

        Args:
            key: The key to look up, two lowercase letters.

        Returns:
            The entry: another key (look that one up next) or a two-digit value (the answer).
        """
        if self.table is None:
            raise RuntimeError("LookupEnv.lookup called before reset(**row)")
        self.calls.append(key)
        latency = self.latency_s if self.latency_s is not None else float(os.environ.get(LATENCY_ENV,
                                                                                            DEFAULT_LATENCY_S))
        if latency > 0:
            time.sleep(latency)
        if key not in self.table:
            raise UnknownKeyError(key)
        return self.table[key]


def final_answer(completion: Any) -> str | None:
    """The answer an episode ends with: the last message's content when it is an assistant message without tool
    calls (a string completion is its own answer); None when the episode stopped before answering."""
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, list):
        raise TypeError(f"completion must be a list of chat messages or a string, got {type(completion).__name__}")
    if not completion:
        return None
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content")
    return content if isinstance(content, str) else None


def lookup_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL-style reward: 1.0 when the episode's final answer, stripped, equals the `answer` column, else 0.0
    (also when it ended on a tool call or a tool message: no answer). Other columns arrive in `kwargs`."""
    if len(completions) != len(answer):
        raise ValueError(f"lookup_reward got {len(completions)} completions but {len(answer)} answers; pass the "
                         "dataset's `answer` column repeated once per completion")
    finals = [final_answer(c) for c in completions]
    return [1.0 if f is not None and f.strip() == str(a).strip() else 0.0 for f, a in zip(finals, answer)]


def episode_counts(completion: list[dict[str, Any]]) -> tuple[int, int]:
    """(model turns, tool calls) of one episode's message list."""
    turns = [m for m in completion if m.get("role") == "assistant"]
    return len(turns), sum(len(m.get("tool_calls") or []) for m in turns)
