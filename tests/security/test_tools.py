"""Tools run code the model chose (`tools`, `environment_factory`): what such a tool can reach. In the rollout process
it reads the keys; with `tool_process: true` it finds them nowhere, neither in its environment nor in any other
process's (a process started with the key, as the trainer and its launcher are, is planted to look in), and a hung
one is killed with what it started."""

from __future__ import annotations

import json
import os
import subprocess

import agent_tools
import pytest

from asyncgrpo.rollout import tool_process
from asyncgrpo.rollout.tools import call_tool

TOOLS = {"find_secret": agent_tools.find_secret, "spawn_and_wait": agent_tools.spawn_and_wait}


def sleeping(seconds: str) -> list[int]:
    """The live (not zombie) processes running `sleep SECONDS`."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] != [b"sleep", seconds.encode()]:
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture
def namespaces():
    if tool_process.probe() is not None:
        pytest.skip(f"no user namespaces here: {tool_process.probe()}")


@pytest.fixture
def secret_holder(monkeypatch):
    """The key in this process's environment, and a process that got it in its initial environment (as a trainer
    launched with it has: /proc/PID/environ shows it to any process of the same user)."""
    secret = "s3cret-for-the-tool-test"
    monkeypatch.setenv("ASYNCGRPO_VLLM_API_KEY", secret)
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "ASYNCGRPO_VLLM_API_KEY": secret})
    yield secret
    holder.kill()
    holder.wait()


def test_a_tool_in_the_rollout_process_can_read_the_key_which_is_why_tool_process_exists(secret_holder):
    found = json.loads(call_tool(TOOLS, "find_secret", {"value": secret_holder}, 10.0).content)["found"]
    assert "ASYNCGRPO_VLLM_API_KEY" in found and any(f.startswith("/proc/") for f in found)


def test_a_tool_in_its_own_process_cannot_read_the_key_from_its_environment_or_any_other_process(secret_holder,
                                                                                                  namespaces):
    result = call_tool(TOOLS, "find_secret", {"value": secret_holder}, 30.0,
                       process_refs={"find_secret": "agent_tools:find_secret"})
    answer = json.loads(result.content)
    assert answer["found"] == [] and answer["processes"] == 1  # its PID namespace holds itself alone


def test_a_hung_tool_process_is_killed_at_the_timeout_with_what_it_started_even_in_another_session(namespaces,
                                                                                                   tmp_path):
    seconds, said = f"299.{os.getpid()}", tmp_path / "said"  # a command line no other process has
    result = call_tool(TOOLS, "spawn_and_wait", {"seconds": seconds, "path": str(said)}, 3.0,
                       process_refs={"spawn_and_wait": "agent_tools:spawn_and_wait"})
    assert result.timed_out and "was stopped" in result.content
    assert said.read_text() == "started" and sleeping(seconds) == []  # the namespace ended with its first process
