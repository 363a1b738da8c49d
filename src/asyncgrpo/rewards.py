"""Reward functions: loading by `package.module:function` and scoring with weights and clear failures.

A reward function has TRL's signature `fn(prompts, completions, **columns) -> list[float]`: one float per
completion, where `columns` are the dataset's other columns, repeated once per completion.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from .errors import ConfigError, RewardFunctionError

log = logging.getLogger(__name__)

RewardFn = Callable[..., list]


def load_reward_function(ref: str) -> RewardFn:
    """`package.module:function` -> the function; errors name the reference and the fix."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("reward_funcs", f"cannot import module {module_name!r} ({exc})",
                          "make the module importable (installed, or on PYTHONPATH)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("reward_funcs", f"{module_name!r} has no function {attr!r}",
                          f"check the name after ':' in {ref!r}")
    return fn


@dataclass
class RewardScorer:
    """Scores completions with several weighted reward functions; counts fallbacks when configured."""

    refs: list[str]
    weights: list[float] | None = None
    fallback: float | None = None
    fallbacks: int = 0
    functions: list[RewardFn] = field(init=False)

    def __post_init__(self) -> None:
        self.functions = [load_reward_function(r) for r in self.refs]
        if self.weights is None:
            self.weights = [1.0] * len(self.refs)

    @property
    def names(self) -> list[str]:
        return [r.partition(":")[2] for r in self.refs]

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[list[float], dict]:
        """Returns (total reward per completion, {function name: its rewards})."""
        parts: dict[str, list[float]] = {}
        total = [0.0] * len(completions)
        for ref, name, fn, weight in zip(self.refs, self.names, self.functions, self.weights):
            values = self._call(ref, fn, prompts, completions, columns)
            parts[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, parts

    def _call(self, ref, fn, prompts, completions, columns) -> list[float]:
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except Exception as exc:  # a user's function: report it with the sample, or fall back if asked to
            if self.fallback is None:
                raise RewardFunctionError(
                    f"reward function {ref} raised {type(exc).__name__}: {exc}\n"
                    f"  on prompt {prompts[0]!r}, first completion {completions[0]!r}\n"
                    f"  Fix the function, or set `reward_fallback: 0.0` to score such samples with a "
                    f"fallback value (counted in rewards/fallbacks)") from exc
            self.fallbacks += len(completions)
            log.warning("reward function %s raised %s on prompt %r; using reward_fallback=%s",
                        ref, type(exc).__name__, prompts[0], self.fallback)
            return [self.fallback] * len(completions)
        return self._check(ref, values, len(completions))

    @staticmethod
    def _check(ref: str, values, n: int) -> list[float]:
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardFunctionError(f"reward function {ref} returned {got} values for {n} completions; "
                                      f"return a list with one float per completion")
        out = []
        for v in values:
            if v is None or not isinstance(v, (int, float)) or math.isnan(float(v)):
                raise RewardFunctionError(f"reward function {ref} returned {v!r}; return a finite float "
                                          f"for every completion")
            out.append(float(v))
        return out
