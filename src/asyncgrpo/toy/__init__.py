"""The toy world: a tiny Qwen2 warmed up on "which number is larger", a char-level tokenizer and an exact-match reward.

Offline and deterministic from a seed; `build_toy_world()` caches the result (see `asyncgrpo.toy.world`). The toy
agent world (`build_agent_world`, `LookupEnv`, `lookup_reward`) answers through a lookup tool over several turns.
The task and reward import without torch or transformers; the other names load their module on first use
(which also keeps `python -m asyncgrpo.toy.world` from importing that module twice).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncgrpo.toy.agent_task import LookupEnv, lookup_reward
from asyncgrpo.toy.task import larger_reward, make_split

if TYPE_CHECKING:
    from asyncgrpo.toy.agent_episodes import heldout_success
    from asyncgrpo.toy.agent_world import AgentWorldSpec, build_agent_world
    from asyncgrpo.toy.tokenizer import SPECIAL_TOKENS, build_tokenizer, decode_completion
    from asyncgrpo.toy.world import ToyWorld, ToyWorldSpec, build_toy_world, with_generation_defaults

_LAZY = {
    "SPECIAL_TOKENS": "asyncgrpo.toy.tokenizer",
    "build_tokenizer": "asyncgrpo.toy.tokenizer",
    "decode_completion": "asyncgrpo.toy.tokenizer",
    "ToyWorld": "asyncgrpo.toy.world",
    "ToyWorldSpec": "asyncgrpo.toy.world",
    "build_toy_world": "asyncgrpo.toy.world",
    "with_generation_defaults": "asyncgrpo.toy.world",
    "AgentWorldSpec": "asyncgrpo.toy.agent_world",
    "build_agent_world": "asyncgrpo.toy.agent_world",
    "heldout_success": "asyncgrpo.toy.agent_episodes",
}

__all__ = ["LookupEnv", "larger_reward", "lookup_reward", "make_split", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the module that defines `name` on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
