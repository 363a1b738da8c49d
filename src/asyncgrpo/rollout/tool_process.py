"""`tool_process: true`: each call of a `tools` function runs in a fresh Python process that cannot read the run's keys.

The process starts with the rollout process's environment minus the secrets (config.SECRET_ENV_VARS), inside a new
user and PID namespace (`unshare`), so that /proc shows it no other process: it cannot read the keys from its
parent's (or any other process's) environment either. Killing it at `tool_timeout` ends everything it started (the
namespace's first process takes the rest with it). Environment methods cannot run there (their state lives in the
rollout process). docs/agents.md, "Tools that run code".
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys

from asyncgrpo.rollout.tool_guard import render_result

# `unshare` with a user namespace (no privileges needed), a PID namespace with its own /proc, and the forked child
# killed when unshare dies.
UNSHARE = ["--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]
PROBE_TIMEOUT_S = 30.0  # one `unshare ... true` at start: a cold Python is not involved, it takes milliseconds


class ToolProcessError(Exception):
    """The tool's process died without an answer (killed, out of memory, or it exited)."""


def command(ref: str) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, *UNSHARE, sys.executable, "-m", "asyncgrpo.rollout.tool_process", ref]


def probe() -> str | None:
    """None when namespaced tool processes can start here, else why not (unshare's own words)."""
    if shutil.which("unshare") is None:
        return "the `unshare` program (util-linux) is not installed"
    try:
        done = subprocess.run([shutil.which("unshare"), *UNSHARE, "true"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare {' '.join(UNSHARE)} true` failed: {exc}"
    if done.returncode != 0:
        return f"`unshare {' '.join(UNSHARE)} true` failed: {done.stderr.strip() or done.returncode}"
    return None


def call(ref: str, arguments: dict) -> tuple[str, str]:
    """Run `ref(**arguments)` in a namespaced process; ("ok", rendered result) or ("raised", "Type: message").
    Runs in the tool call's thread: stopping that thread (tool_guard) kills the process."""
    # heavy-free: reward_pool is imported by the rollout side already; its environment helper drops the secrets
    from asyncgrpo.rollout.reward_pool import worker_environment

    payload = json.dumps({"sys_path": sys.path, "cwd": os.getcwd(), "arguments": arguments}, default=str)
    done = subprocess.run(command(ref), input=payload, capture_output=True, text=True, env=worker_environment())
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not ({"ok", "raised"} & set(answer)):
        raise ToolProcessError(f"the process of tool {ref} ended with exit code {done.returncode} and no answer: "
                               f"{done.stderr.strip()[-2000:]}")
    return ("ok", answer["ok"]) if "ok" in answer else ("raised", answer["raised"])


def _main(ref: str) -> None:  # pragma: no mutate block - runs in the tool's own process
    request = json.loads(sys.stdin.read())
    sys.path[:] = request["sys_path"]
    os.chdir(request["cwd"])
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # what the tool prints goes to stderr: stdout carries the answer alone
    try:
        module_name, _, attr = ref.partition(":")
        value = getattr(importlib.import_module(module_name), attr)(**request["arguments"])
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        answer = {"ok": render_result(value)}
    except Exception as exc:  # noqa: BLE001 - the model reads it as the tool's answer
        answer = {"raised": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(answer_fd, "w") as out:
        out.write("\n" + json.dumps(answer) + "\n")


async def _awaited(awaitable):
    return await awaitable


if __name__ == "__main__":
    _main(sys.argv[1])
