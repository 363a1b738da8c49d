"""`asyncgrpo check --config FILE [--key value ...]`: validate a config without training.

Prints every problem at once (one line each, with the fix) and exits 2, or prints the resolved config as YAML and
exits 0; a config written for TRL also gets the defaults it leaves out that differ from TRL's. Beyond the values,
it imports what the config names (reward functions, tools, the environment class), as `train` would at start.
"""

from __future__ import annotations

import sys

import yaml

from asyncgrpo.config import AsyncGRPOConfig, read_values, trl_notice
from asyncgrpo.errors import AsyncGRPOError, ConfigError, ConfigErrors
from asyncgrpo.rewards import load_reward_function, reward_name
from asyncgrpo.rollout.tools import load_environment_factory, load_tools


def reference_problems(cfg: AsyncGRPOConfig) -> list[ConfigError]:
    """One error per thing the config names that cannot be imported or built: each reward function (reward models
    are loaded at start, not here: that would load the model), the tools, the environment class."""
    problems = []
    kwargs = cfg.reward_kwargs or {}
    for ref in cfg.reward_funcs or []:
        if ":" in ref:
            problems += _problems(lambda: load_reward_function(ref, kwargs.get(ref, kwargs.get(reward_name(ref)))))
    if cfg.tools:
        problems += _problems(lambda: load_tools(cfg.tools))
    if cfg.environment_factory:
        problems += _problems(lambda: load_environment_factory(cfg.environment_factory))
    return problems


def _problems(build) -> list[ConfigError]:
    try:
        build()
    except ConfigErrors as exc:
        return list(exc.errors)
    except ConfigError as exc:
        return [exc]
    return []


def run_check(path: str | None, overrides: list[str]) -> int:
    """Check the config at `path` with `overrides`; 0 when it is valid, 2 otherwise (the CLI's code for user errors)."""
    try:
        values = read_values(path, overrides)
        cfg = AsyncGRPOConfig.from_dict(values)
        problems = cfg.task_problems() + reference_problems(cfg)
    except ConfigErrors as exc:
        problems = list(exc.errors)
    except AsyncGRPOError as exc:
        problems = [exc]
    if problems:
        print(f"asyncgrpo check: {len(problems)} problem{'s' * (len(problems) > 1)} in {path or 'the overrides'}:",
              file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    notice = trl_notice(values)
    if notice:
        print(f"asyncgrpo check: {notice}", file=sys.stderr)
    print(f"asyncgrpo check: {path or 'the overrides'} is valid; the resolved config follows.", file=sys.stderr)
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0
