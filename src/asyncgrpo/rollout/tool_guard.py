"""What keeps a tool call from hurting the run: its arguments checked against its JSON schema, its output capped,
and a call past `tool_timeout` stopped (its child processes killed, an exception raised in its thread).

A Python thread cannot be killed. A hung call is stopped in two steps: every process its thread started (and their
descendants) gets SIGKILL, which ends a wait on a subprocess, and `ToolStopped` is raised in the thread, which ends
a loop running Python code. A call blocked in C for good (a sleep, a lock, a socket read without timeout) goes on
until that returns: such threads are counted, and past HUNG_TOOL_LIMIT the run stops naming the tool. docs/agents.md.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

HUNG_TOOL_LIMIT = 32  # tool threads still running after being stopped; past it the run stops (each holds memory)
STOP_GRACE_S = 1.0  # how long a stopped call's thread is given to end before it is counted as hung


class ToolStopped(BaseException):
    """Raised inside a tool's thread past `tool_timeout` (a BaseException, so that a tool's `except Exception` does
    not swallow it)."""


# ---- arguments -----------------------------------------------------------------------------------------------------
def _is(value, json_type: str) -> bool:
    if json_type == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "array": (list, tuple), "object": dict, "null": type(None)}
    return isinstance(value, kinds[json_type]) if json_type in kinds else True  # a type we do not know: allowed


def schema_problem(schema: dict, value, where: str) -> str | None:
    """Why `value` does not match `schema` (the part of JSON schema transformers' get_json_schema writes: type,
    nullable, enum, items, properties, required, additionalProperties), or None when it does."""
    if value is None and schema.get("nullable"):
        return None
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_is(value, t) for t in names):
            return f"{where} must be {' or '.join(names)}, got {type(value).__name__} {value!r:.80}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r:.80}"
    if isinstance(value, (list, tuple)) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = schema_problem(schema["items"], item, f"{where}[{i}]")
            if problem:
                return problem
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                return f"{where} misses {key!r} (required)"
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                problem = schema_problem(properties[key], item, f"{where}.{key}" if where != "arguments" else key)
            elif isinstance(extra, dict):
                problem = schema_problem(extra, item, f"{where}[{key!r}]")
            elif extra is False or (where == "arguments" and extra is None):
                problem = f"{key!r} is not an argument; the arguments are {sorted(properties)}"
            else:
                problem = None
            if problem:
                return problem
    return None


def arguments_problem(schema: dict | None, arguments: dict) -> str | None:
    """Why a call's arguments do not match its tool's schema (`{"type": "function", "function": {..., "parameters"
    }}`), or None; a tool without a schema accepts any."""
    parameters = ((schema or {}).get("function") or {}).get("parameters")
    if not isinstance(parameters, dict):
        return None
    return schema_problem({"additionalProperties": None, **parameters}, arguments, "arguments")


# ---- output ----------------------------------------------------------------------------------------------------------
def cut_text(text: str, max_chars: int | None) -> str:
    """`text`, or its first `max_chars` characters and a line saying how much was cut (the model reads it)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[output cut: {len(text)} characters, the first {max_chars} shown]"


def cut_tokens(text: str, tokenizer, max_tokens: int | None) -> str:
    """`text`, or the text of its first `max_tokens` tokens and a line saying so (the line is not counted)."""
    if max_tokens is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return f"{tokenizer.decode(ids[:max_tokens])}\n[output cut: {len(ids)} tokens, the first {max_tokens} shown]"


# ---- stopping a hung call ------------------------------------------------------------------------------------------
def _children(pid: int, task: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{task}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):  # gone, or a kernel without CONFIG_PROC_CHILDREN
        return []


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []


def started_processes(native_thread_id: int) -> list[int]:
    """Every live process the thread started, and their descendants (Linux /proc; a process that detached to
    another parent is not found)."""
    found, stack = [], _children(os.getpid(), native_thread_id)
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += [c for task in _tasks(pid) for c in _children(pid, task)]
    return found


class HungTools:
    """Stops calls past their timeout, and counts the threads that would not end."""

    def __init__(self, limit: int = HUNG_TOOL_LIMIT, grace_s: float = STOP_GRACE_S):
        self.limit, self.grace_s = limit, grace_s
        self._lock = threading.Lock()
        self._hung: list[threading.Thread] = []

    def stop(self, thread: threading.Thread, lock: threading.Lock, finished) -> bool:
        """Kill what `thread` started, raise ToolStopped in it unless `finished()` (read under `lock`, which the
        thread takes to say it finished: the exception never lands after the tool returned), and wait up to
        `grace_s` for it to end. True if it ended."""
        for pid in started_processes(thread.native_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        with lock:
            if not finished():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(ToolStopped))
        thread.join(self.grace_s)
        with self._lock:
            if thread.is_alive():
                self._hung.append(thread)
        return not thread.is_alive()

    def hung(self) -> int:
        """Tool threads stopped but still running (blocked in C)."""
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            return len(self._hung)


HUNG = HungTools()  # one per process: the threads it counts are the process's


def render_result(value: Any) -> str:
    """A tool's return value as tool-message text: a string as it is, anything else as JSON (TRL uses `str()`,
    which writes a dict as a Python repr)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
