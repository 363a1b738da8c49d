"""Tools and an environment for the episode tests, importable by reference (`agent_tools:lookup`)."""

from __future__ import annotations

import json
import os
import subprocess
import types
import threading
import time

TABLE = {"a": "b", "b": "c", "c": "done"}
RELEASE = threading.Event()  # set by a test to let a hung tool's thread end


def lookup(key: str) -> str:
    """Look a key up in the hidden table.

    Args:
        key: the key to look up
    """
    return TABLE[key]  # an unknown key raises KeyError: the model reads it as an error


async def add(x: int, y: int) -> dict:
    """Add two numbers (an async tool).

    Args:
        x: the first number
        y: the second number
    """
    return {"sum": x + y}


def hang(seconds: float) -> str:
    """Wait far longer than any tool_timeout.

    Args:
        seconds: how long to wait
    """
    RELEASE.wait(seconds)
    return "woke"


def leave(code: int) -> str:
    """End the worker thread the way a tool calling sys.exit does.

    Args:
        code: the exit code
    """
    raise SystemExit(code)


def no_docstring(x: int) -> int:
    return x


class Counter:
    """An environment: state kept across the turns of one episode."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.count = 0
        self.done = False
        self.pid = os.getpid()

    def reset(self, **row) -> str:
        self.row = row
        self.count = int(row.get("start", 0))
        return f" (start {self.count})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        self.done = self.count >= 3
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _private(self) -> None:
        pass


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "slept"


def messages_reward(prompts, completions, environments=None, **kwargs) -> list[float]:
    """A reward function for episodes: the number of messages after the prompt."""
    return [float(len(c)) for c in completions]


class NoReward:
    """An environment that leaves the reward to reward_funcs (it has no get_reward)."""

    def reset(self, **row) -> None:
        return None

    def noop(self) -> str:
        """Do nothing."""
        return "ok"


class Workshop:
    """An environment whose tools are found on the instance (TRL's rule): a method, a classmethod and one bound at
    run time are tools; a staticmethod, a plain function attribute, reset, get_reward and close are not."""

    closed = 0

    def __init__(self):
        self.measure = types.MethodType(measure, self)  # bound to this instance at run time

    def reset(self, **row) -> None:
        return None

    def saw(self, length: int) -> str:
        """Saw a plank.

        Args:
            length: how long
        """
        return f"sawn {length}"

    @classmethod
    def catalogue(cls) -> str:
        """List what the workshop makes."""
        return "chairs"

    @staticmethod
    def helper() -> str:
        return "not a tool"

    def close(self) -> None:
        Workshop.closed += 1


def measure(self, what: str) -> str:
    """Measure something.

    Args:
        what: the thing
    """
    return f"{what}: 3"


class Riddles:
    """A TRL environment that owns its data (no dataset): reset() returns the prompt, get_reward() scores."""

    def reset(self, **kwargs) -> str:
        self.kwargs, self.said = kwargs, []
        return "Say 45."

    def lookup(self, key: str) -> str:
        """Say something.

        Args:
            key: what to say
        """
        self.said.append(key)
        return "heard"

    def get_reward(self) -> float:
        return float(self.said[:1] == ["45"])


STARTED: list[int] = []  # pids of the processes `run_child` started


def spin(seconds: float) -> str:
    """Loop in Python far longer than any tool_timeout (a hang a raised exception can end).

    Args:
        seconds: how long to loop
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return "spun"


def run_child(seconds: float) -> str:
    """Start a process and wait for it (a hang only killing the process ends).

    Args:
        seconds: how long the process sleeps
    """
    child = subprocess.Popen(["sleep", str(seconds)])
    STARTED.append(child.pid)
    child.wait()
    return "child done"


def loud(length: int) -> str:
    """Answer at length.

    Args:
        length: how many characters
    """
    return "ab" * (length // 2)


class Loud:
    """An environment whose one tool takes an int, so that a turn that is not a number breaks its schema."""

    def reset(self, **row) -> None:
        return None

    def lookup(self, key: int) -> str:
        """Answer with 2 x key characters.

        Args:
            key: half the length of the answer
        """
        return "ab" * key


def find_secret(value: str) -> str:
    """Look for a value in this process's environment and in every process's environment that /proc shows (what a
    tool running code the model wrote could do).

    Args:
        value: the secret to look for
    """
    found = [name for name, v in os.environ.items() if v == value]
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if value.encode() in f.read():
                    found.append(f"/proc/{pid}/environ")
        except OSError:
            pass
    return json.dumps({"found": found, "processes": sum(p.isdigit() for p in os.listdir("/proc"))})


def said_reward(prompts, completions, environments, log_metric, log_extra, trainer_state, **kwargs) -> list[float]:
    """A TRL reward function using what TRL passes: the environments, log_metric, log_extra and trainer_state."""
    said = [float(len(e.said)) for e in environments]
    log_metric("said_mean", sum(said) / len(said))
    log_extra("step", [trainer_state.global_step] * len(said))
    return said


def make_counter() -> Counter:
    """An environment factory that is a function (TRL takes any callable returning an instance)."""
    return Counter()


def make_nothing() -> object:
    """A factory whose instances have no reset."""
    return object()


class NoReset:
    """A class that is no environment: it has no reset."""


def spawn_and_wait(seconds: str, path: str) -> str:
    """Start `sleep SECONDS` in a new session (as a tool escaping its process group would), say so in `path`, and
    wait for it.

    Args:
        seconds: how long to sleep, written as the command line will show it
        path: a file to write `started` to
    """
    child = subprocess.Popen(["sleep", seconds], start_new_session=True)
    with open(path, "w") as f:
        f.write("started")
    child.wait()
    return "done"


def process_id() -> int:
    """The id of the process this tool runs in (in a PID namespace of its own: a small one, never the caller's)."""
    return os.getpid()


MEETING = threading.Barrier(2)  # replaced by a test before two `meet` calls


def meet() -> str:
    """Wait for a second call of this tool (only calls that run at the same time meet)."""
    MEETING.wait(timeout=5)
    return "met"
