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
from asyncgrpo.objects import remembered
from asyncgrpo.rollout import tool_process
from asyncgrpo.rollout.tool_guard import HUNG, ToolStopped, arguments_problem, cut_text, render_result

NOT_TOOLS = ("reset", "get_reward", "close")  # an environment's methods that the model never calls


def load_ref(ref: str, key: str) -> Any:
    """`package.module:name` -> the object (the very one, when it was handed to the Python API in this process:
    objects.py); errors name the config `key`, the reference and the fix."""
    if remembered(ref) is not None:
        return remembered(ref)
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


def load_environment_factory(ref: str) -> Callable:
    """What `environment_factory` names: a class with `reset`, or any callable taking no argument that returns an
    instance (TRL's contract; its instances are checked for `reset` as they are built)."""
    factory = load_ref(ref, "environment_factory")
    if not callable(factory) or (inspect.isclass(factory) and not callable(getattr(factory, "reset", None))):
        raise ConfigError("environment_factory", f"{ref} is neither a class with a reset(**row) method nor a "
                          f"function returning an instance", "name a class whose instances have reset(**row) and "
                          "public tool methods, or a function taking no argument that returns one")
    return factory


def environment_class(factory: Callable, ref: str) -> type:
    """The class of `factory`'s instances: the factory itself when it is a class, else the type of one instance
    built to see (and closed again), as TRL probes one at start."""
    if inspect.isclass(factory):
        return factory
    from asyncgrpo.rollout.environments import EnvironmentPool  # the pool checks what the factory returns

    pool = EnvironmentPool(factory, ref)
    probe = pool.take()
    pool.give_back(probe)
    pool.close()
    return type(probe)


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
    error: bool  # the tool raised, hung or was not found, its arguments were refused, or it was not run
    seconds: float
    timed_out: bool = False  # stopped at tool_timeout: its environment may still be in use by its thread


def _invoke(fn: Callable, arguments: dict) -> Any:
    value = fn(**arguments)
    if inspect.isawaitable(value):  # an async tool: run it to completion on this worker thread
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable):
    return await awaitable


def _error(name: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, render_result({"error": message}), True, seconds)


def call_tool(tools: dict[str, Callable], name: str, arguments: Any, timeout_s: float, *,
              schemas: dict[str, dict] | None = None, max_chars: int | None = None,
              process_refs: dict[str, str] | None = None) -> ToolResult:
    """Run one call on a thread of its own, waiting at most `timeout_s`; past it the call is stopped
    (tool_guard.HungTools). Arguments that do not match the tool's schema (`schemas`, by name) are an error the
    model reads, the tool is not called; a result longer than `max_chars` is cut, visibly. A tool named in
    `process_refs` (name -> `module:function`) runs in a process of its own (tool_process.py), from that thread."""
    start = time.monotonic()
    if name not in tools:
        return _error(name, f"no tool named {name!r}; tools: {sorted(tools)}")
    if not isinstance(arguments, dict):
        return _error(name, f"arguments of {name} must be an object, got {arguments!r:.200}")
    problem = arguments_problem((schemas or {}).get(name), arguments)
    if problem is not None:
        return _error(name, f"{name} was not called: {problem}")
    if HUNG.hung() >= HUNG.limit:
        raise ToolError(f"{HUNG.hung()} tool calls are still running after tool_timeout in threads that could not be "
                        f"stopped (blocked in C code: a sleep, a lock, a socket read without a timeout); the last "
                        f"call was {name}({arguments!r:.200}). Fix the tool: give its blocking calls a timeout")
    outcome: list = []  # ["ok", text] | ["raised", "Type: message"] | ["crashed", BaseException]
    ref = (process_refs or {}).get(name)
    done = threading.Event()
    lock = threading.Lock()  # taken by the worker to say it finished, and by the stopper before raising in it
    finished = [False]

    def work() -> None:
        try:
            try:
                result = list(tool_process.call(ref, arguments)) if ref else \
                    ["ok", render_result(_invoke(tools[name], arguments))]
            except Exception as exc:  # noqa: BLE001 - the model reads it as the tool's answer
                result = ["raised", f"{type(exc).__name__}: {exc}"]
            except ToolStopped:
                return  # stopped past tool_timeout: the caller has answered already
            except BaseException as exc:  # noqa: BLE001 - SystemExit and the like: the worker thread ends
                result = ["crashed", exc]
            with lock:
                finished[0] = True
            outcome.extend(result)
            done.set()
        except ToolStopped:  # raised between the tool's return and `finished`: nothing to report
            return

    thread = threading.Thread(target=work, name=f"tool-{name}", daemon=True)  # daemon: one blocked in C may not end
    thread.start()
    if not done.wait(timeout_s):
        ended = HUNG.stop(thread, lock, lambda: finished[0])
        seconds = time.monotonic() - start
        what = "was stopped" if ended else "was stopped but its thread is blocked and goes on"
        result = _error(name, f"tool {name} did not finish within tool_timeout={timeout_s:g} s and {what}", seconds)
        result.timed_out = True
        return result
    seconds = time.monotonic() - start
    kind, value = outcome
    if kind == "ok":
        return ToolResult(name, cut_text(value, max_chars), False, seconds)
    if kind == "raised":
        return _error(name, cut_text(value, max_chars), seconds)
    raise ToolError(f"tool {name} ended its worker thread with {type(value).__name__}: {value!r} (called with "
                    f"{arguments!r:.200}). Fix the tool: raise an Exception for an error the model should read "
                    f"instead of exiting") from value


def run_tool_calls(tools: dict[str, Callable], calls: list[tuple[str, Any]], timeout_s: float, *,
                   schemas: dict[str, dict] | None = None, max_chars: int | None = None,
                   max_calls: int | None = None, process_refs: dict[str, str] | None = None) -> list[ToolResult]:
    """One turn's calls, all at once (each on its own thread), results in call order. Calls past the first
    `max_calls` are not run: each gets an error saying so."""
    over = calls[max_calls:] if max_calls is not None else []
    calls = calls[:len(calls) - len(over)]
    skipped = [_error(name, f"{name} was not called: at most {max_calls} tool calls are run per turn "
                            f"(max_tool_calls_per_turn)") for name, _ in over]
    if len(calls) <= 1:
        return [call_tool(tools, *c, timeout_s, schemas=schemas, max_chars=max_chars, process_refs=process_refs)
                for c in calls] + skipped
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int, name: str, arguments: Any) -> None:
        try:
            results[i] = call_tool(tools, name, arguments, timeout_s, schemas=schemas, max_chars=max_chars,
                                   process_refs=process_refs)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, *call), daemon=True) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each call_tool returns within timeout_s and the stop's grace
    if errors:
        raise errors[0]
    return results + skipped
