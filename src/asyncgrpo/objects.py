"""Objects a Python script hands the trainer (reward functions, tools, an environment factory) and the
`module:name` references the config names them by.

The config stays plain data (saved as YAML, pickled to the rollout process): `reference(obj)` gives an object its
reference and remembers it, so that this process loads that very object back (`remembered`). Any other process imports
the reference; which ones can, and the error for those that cannot: `crossing_problems`. docs/python-api.md.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Protocol

from asyncgrpo.errors import ConfigError


class CrossingKeys(Protocol):
    """The config keys that say which objects cross to which processes (of DataSettings, AgentSettings and
    AsyncSettings; a protocol, not those sections: config.py imports this module through rewards.py)."""

    reward_funcs: list | None
    reward_workers: int
    tools: list
    tool_process: bool
    environment_factory: str | None
    rollout_process: bool
    rollout_address: str | None


MAIN = "__main__"  # the launched script's module: other processes import it only by running the script again
_REMEMBERED: dict[str, Any] = {}  # reference -> the object this process was given under it


def reference(obj: Any, key: str) -> str:
    """A `module:name` string as it is; for a function, class or callable object, its reference (the name it is bound
    to at its module's top level, else a label such as `__main__:lambda`), remembered for this process."""
    if isinstance(obj, str):
        return obj
    if not callable(obj):
        raise ConfigError(key, f"got {type(obj).__name__} {obj!r}, neither a callable nor a `module:name` string",
                          "pass the function (or class) itself, or its `package.module:name`")
    module = getattr(obj, "__module__", None) or getattr(getattr(obj, "func", None), "__module__", None) or MAIN
    # A label stays a dotted name, as the config checks references: `make.<locals>.f` -> `make.locals.f`.
    base = f"{module}:{_bound_name(obj, module) or re.sub(r'[^0-9A-Za-z_.]', '', _label(obj)) or 'function'}"
    ref, n = base, 2
    while _REMEMBERED.get(ref, obj) is not obj:  # another object already holds this label (two lambdas, closures)
        ref, n = f"{base}_{n}", n + 1
    _REMEMBERED[ref] = obj
    return ref


def remembered(ref: str) -> Any | None:
    """The object `reference` was given for `ref` in this process, or None (then import it)."""
    return _REMEMBERED.get(ref)


def _label(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(getattr(obj, "func", None), "__name__", None)
    return name or type(obj).__name__


def _attribute(module: str, path: str) -> Any | None:
    """`module`'s attribute at the dotted `path`, without importing anything; None where there is none."""
    value = sys.modules.get(module)
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _bound_name(obj: Any, module: str) -> str | None:
    """The dotted name under which `obj` is found from its module's top level (its qualified name, or a global
    bound to it), or None: a lambda, a function made inside another function, a bound method, a partial."""
    qualname = getattr(obj, "__qualname__", None)
    if qualname and "<" not in qualname and _attribute(module, qualname) is obj:
        return qualname
    namespace = vars(sys.modules[module]) if module in sys.modules else {}
    return next((name for name, value in namespace.items() if value is obj and name.isidentifier()), None)


def importable(ref: str) -> bool:
    """Whether another process importing `ref` gets the same definition: it is bound by that name at the top level
    of its module (for `__main__`, of the launched script)."""
    obj = _REMEMBERED.get(ref)
    module, _, path = ref.partition(":")
    return obj is not None and _attribute(module, path) is obj


def crossing_problems(cfg: CrossingKeys) -> list[ConfigError]:
    """One error for each object of `cfg` that a process it must reach could not import: reward workers and the
    rollout process (`rollout_process`) run the launched script again as `__mp_main__`, as multiprocessing's spawn
    does, so they import what it defines at top level; a rollout server on another host (`rollout_address`) and
    `tool_process`'s per-call processes import installed modules only."""
    problems = []
    entries = [("reward_funcs", r) for r in cfg.reward_funcs or []] + [("tools", t) for t in cfg.tools]
    if cfg.environment_factory:
        entries.append(("environment_factory", cfg.environment_factory))
    for key, ref in entries:
        if ref not in _REMEMBERED:
            continue  # a string the user wrote: imported by name everywhere, as from a YAML config
        reruns = [name for name, on in (("the reward worker processes (reward_workers)",
                                         key == "reward_funcs" and cfg.reward_workers > 0),
                                        ("the rollout process (rollout_process: true)", cfg.rollout_process)) if on]
        installed = [name for name, on in (("the rollout server on another host (rollout_address)",
                                            bool(cfg.rollout_address)),
                                           ("tool_process's per-call processes", key == "tools" and cfg.tool_process))
                     if on]
        what = f"{_label(_REMEMBERED[ref])} ({ref})"
        if not importable(ref) and (reruns or installed):
            problems.append(ConfigError(key, f"{what} has no name at its module's top level (a lambda, a function "
                                        f"made inside another function, a bound method or a partial), so it cannot be "
                                        f"sent to {' or '.join(reruns + installed)}",
                                        "define it with `def` (or `class`) at the top level of your script or of a "
                                        "module, or pass a `package.module:name` string"))
        elif ref.startswith(MAIN + ":") and installed:
            problems.append(ConfigError(key, f"{what} is defined in the launched script, which "
                                        f"{' and '.join(installed)} cannot import", "move it into a module (e.g. "
                                        "my_rewards.py beside the script, installed on every host) and import it "
                                        "from there, or pass its `package.module:name`"))
    return problems


def rerunning_script() -> bool:
    """True while the launched script is being run again in a child process so that it can import what the script
    defines (reward workers, the rollout process). The script then runs as a module named `__mp_main__` (in a normal
    process multiprocessing only makes `__mp_main__` another key for `__main__`)."""
    return getattr(sys.modules.get("__mp_main__"), "__name__", None) == "__mp_main__"
