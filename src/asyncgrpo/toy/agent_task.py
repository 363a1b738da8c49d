"""The toy agent task: find the value at the end of a hidden chain that only the `lookup` tool can walk.

A world seed draws the table: chains `key -> key -> ... -> value` of 1-4 hops (keys are two lowercase letters,
values one digit, `7`), short chains more often than long ones. A question names a chain's
first key (`find qx`); `LookupEnv` (stateful, one instance per episode) starts there and its argument-free
`lookup()` follows one hop per call (`-> rk`, then `= 7` at the end), so the model must keep calling until it reads
a value and then answer it. `lookup_reward` is the reward. Imports neither torch nor transformers.
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


def draw_value(rng: random.Random) -> str:
    """A chain's value: one digit (a guess is right 1 time in 10). Nothing else in an episode is a digit, so
    answering means copying the one digit the tool returned."""
    return rng.choice(string.digits)


def question_text(key: str) -> str:
    """The user message of a question: `question_text("qx") == "find qx"`."""
    return f"find {key}"


def draw_chains(rng: random.Random, keys: list[str], n_chains: int) -> list[list[str]]:
    """`n_chains` chains `[key, ..., key, value]` over distinct keys taken from `keys` (consumed), with hop
    counts drawn from HOP_WEIGHTS; the last element is a value (`draw_value`)."""
    chains = []
    for _ in range(n_chains):
        hops = rng.choices(range(1, len(HOP_WEIGHTS) + 1), weights=HOP_WEIGHTS)[0]
        if len(keys) < hops:
            raise ConfigError("n_chains", f"{n_chains} chains need more than the {len(KEYS)} keys",
                              f"use at most {N_CHAINS} chains")
        chains.append([keys.pop() for _ in range(hops)] + [draw_value(rng)])
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


KEY_MARK = "-> "
"""`lookup()` returns KEY_MARK + the next key while the chain goes on (`-> rk`)."""
VALUE_MARK = "= "
"""... and VALUE_MARK + the value at the chain's end (`= 7`): the answer."""


def is_value(entry: str) -> bool:
    """Whether a table entry is a chain's value (`7`) rather than the next key (`rk`)."""
    return entry.isdigit()


def lookup_text(entry: str) -> str:
    """What `lookup()` returns for a table entry: `-> rk` for a key, `= 7` for a value."""
    return (VALUE_MARK if is_value(entry) else KEY_MARK) + entry


class ChainEndedError(LookupError):
    """`lookup()` after the chain's value was read; its message is what the model reads."""

    def __str__(self) -> str:
        return f"the chain ended at {self.args[0]}; answer that value"


class LookupEnv:
    """One episode's environment: a walk along one hidden chain of the row's world, one `lookup()` per hop.

    `reset(**row)` takes a dataset row (it needs `world_seed` and `key`, the chain's first key) and puts the walk
    there; its public method `lookup` is the tool. Set the class attribute `latency_s` (or the environment variable
    ASYNCGRPO_TOY_TOOL_LATENCY_S) to simulate a slower tool; it defaults to DEFAULT_LATENCY_S.
    """

    latency_s: float | None = None

    def __init__(self) -> None:
        self.table: dict[str, str] | None = None
        self.position: str | None = None
        self.calls = 0

    def reset(self, **row: Any) -> None:
        """Start an episode at `row["key"]` on the table of `row["world_seed"]`; other columns are ignored."""
        missing = [name for name in ("world_seed", "key") if name not in row]
        if missing:
            raise ConfigError(missing[0], f"missing from the dataset row (columns: {sorted(row)})",
                              "use the toy agent world's rows (asyncgrpo.toy.agent_task.make_agent_split)")
        self.table = make_table(int(row["world_seed"]))[0]
        if row["key"] not in self.table:
            raise ConfigError("key", f"{row['key']!r} starts no chain of world {row['world_seed']}",
                              "use the toy agent world's rows (asyncgrpo.toy.agent_task.make_agent_split)")
        self.position, self.calls = row["key"], 0

    def lookup(self) -> str:
        """Follow the hidden chain one hop from where this episode stands.

        Returns:
            `-> ab` when the chain goes on to key ab (call lookup again), or `= 7` at its end: the value, the answer.
        """
        if self.table is None or self.position is None:
            raise RuntimeError("LookupEnv.lookup called before reset(**row)")
        self.calls += 1
        latency = self.latency_s if self.latency_s is not None else float(os.environ.get(LATENCY_ENV,
                                                                                            DEFAULT_LATENCY_S))
        if latency > 0:
            time.sleep(latency)
        if is_value(self.position):
            raise ChainEndedError(self.position)
        self.position = self.table[self.position]
        return lookup_text(self.position)


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
