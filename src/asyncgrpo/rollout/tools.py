"""Users' tools and environments (TRL's `tools` / `environment_factory` contract) and running one turn's tool calls.

Each call runs on a thread of its own, off the request thread, awaited up to `tool_timeout`. What the model reads back
is the tool message: the result, or `{"error": ...}` for a tool that raised, hung or does not exist (counted). A tool
that ends its thread (SystemExit, KeyboardInterrupt) stops the run with a ToolError naming it. docs/agents.md.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from asyncgrpo.errors import ConfigError, ToolError

NOT_TOOLS = ("reset", "get_reward", "close")  # an environment's methods that the model never calls


def load_ref(ref: str, key: str) -> Any:
    """`package.module:name` -> the object; errors name the config `key`, the reference and the fix."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, f"cannot import module {module_name!r} ({exc})",
                          "make the module importable (installed, or on PYTHONPATH)") from exc
    value = getattr(module, attr, None)
    if value is None:
        raise ConfigError(key, f"{module_name!r} has no {attr!r}", f"check the name after ':' in {ref!r}")
    return value


def load_tools(refs: list[str]) -> list[Callable]:
    """The functions `tools` names, each checked for a schema now (type hints and a Google docstring)."""
    tools = [load_ref(ref, "tools") for ref in refs]
    for ref, fn in zip(refs, tools):
        if not callable(fn):
            raise ConfigError("tools", f"{ref} is {type(fn).__name__}, not a function", "name a function")
        tool_schema(fn, key="tools")
    return tools


def load_environment_factory(ref: str) -> type:
    """The class `environment_factory` names; it must have `reset` (TRL's contract)."""
    factory = load_ref(ref, "environment_factory")
    if not callable(factory) or not callable(getattr(factory, "reset", None)):
        raise ConfigError("environment_factory", f"{ref} is not a class with a reset(**row) method",
                          "name a class whose instances have reset(**row) and public tool methods")
    return factory


def environment_tools(environment) -> list[Callable]:
    """The tools of one environment instance: its public bound methods (TRL: `inspect.ismethod` members of the
    instance, no leading underscore), other than reset, get_reward and close. So a classmethod or a method bound to
    the instance at run time is a tool, and a staticmethod, a plain function attribute or a property is not."""
    return [member for name, member in inspect.getmembers(environment, inspect.ismethod)
            if not name.startswith("_") and name not in NOT_TOOLS]


def tool_schema(fn: Callable, key: str = "tools") -> dict:
    """transformers' JSON schema of `fn` (what the chat template lists); an error names the fix."""
    # heavy: transformers, only for runs with tools
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - TypeHintParsingException, DocstringParsingException
        raise ConfigError(key, f"no schema for tool {getattr(fn, '__qualname__', fn)!r}: {exc}",
                          "give every argument a type hint and a Google docstring with an `Args:` entry each "
                          "(transformers.utils.get_json_schema)") from exc


@dataclass
class ToolResult:
    """One tool call's outcome as the model reads it, and what it cost."""

    name: str
    content: str  # the tool message's content
    error: bool  # the tool raised, hung, or was not found
    seconds: float


def render_result(value: Any) -> str:
    """A tool's return value as tool-message text: a string as it is, anything else as JSON (TRL uses `str()`,
    which writes a dict as a Python repr)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _invoke(fn: Callable, arguments: dict) -> Any:
    value = fn(**arguments)
    if inspect.isawaitable(value):  # an async tool: run it to completion on this worker thread
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable):
    return await awaitable


def call_tool(tools: dict[str, Callable], name: str, arguments: Any, timeout_s: float) -> ToolResult:
    """Run one call on a thread of its own, waiting at most `timeout_s` (a hung call is left behind, as a daemon)."""
    start = time.monotonic()
    if name not in tools:
        return ToolResult(name, render_result({"error": f"no tool named {name!r}; tools: {sorted(tools)}"}), True, 0.0)
    if not isinstance(arguments, dict):
        return ToolResult(name, render_result({"error": f"arguments of {name} must be an object, got "
                                                        f"{arguments!r:.200}"}), True, 0.0)
    outcome: list = []  # ["ok", value] | ["raised", exception] | ["crashed", BaseException]
    done = threading.Event()

    def work() -> None:
        try:
            outcome.extend(["ok", _invoke(tools[name], arguments)])
        except Exception as exc:  # noqa: BLE001 - the model reads it as the tool's answer
            outcome.extend(["raised", exc])
        except BaseException as exc:  # noqa: BLE001 - SystemExit and the like: the worker thread ends
            outcome.extend(["crashed", exc])
        finally:
            done.set()

    threading.Thread(target=work, name=f"tool-{name}", daemon=True).start()  # daemon: a hung tool may never end
    finished = done.wait(timeout_s)
    seconds = time.monotonic() - start
    if not finished:
        message = f"tool {name} did not finish within tool_timeout={timeout_s:g} s and was abandoned"
        return ToolResult(name, render_result({"error": message}), True, seconds)
    kind, value = outcome
    if kind == "ok":
        return ToolResult(name, render_result(value), False, seconds)
    if kind == "raised":
        return ToolResult(name, render_result({"error": f"{type(value).__name__}: {value}"}), True, seconds)
    raise ToolError(f"tool {name} ended its worker thread with {type(value).__name__}: {value!r} (called with "
                    f"{arguments!r:.200}). Fix the tool: raise an Exception for an error the model should read "
                    f"instead of exiting") from value


def run_tool_calls(tools: dict[str, Callable], calls: list[tuple[str, Any]], timeout_s: float) -> list[ToolResult]:
    """One turn's calls, all at once (each on its own thread), results in call order."""
    if len(calls) == 1:
        return [call_tool(tools, *calls[0], timeout_s)]
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int, name: str, arguments: Any) -> None:
        try:
            results[i] = call_tool(tools, name, arguments, timeout_s)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, *call), daemon=True) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each call_tool returns within timeout_s
    if errors:
        raise errors[0]
    return results
