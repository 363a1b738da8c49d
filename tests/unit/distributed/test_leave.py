"""`leave_launched_process`: a finished rank of a launch exits at once with its code and its output flushed; a
single process is left to return normally."""

import os
import subprocess
import sys

from asyncgrpo.distributed import leave_launched_process

SCRIPT = """
import atexit, logging, sys
from asyncgrpo.distributed import leave_launched_process
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
print("buffered line", end="")  # no newline, no flush: only an explicit flush writes it to a pipe
logging.getLogger("t").info("logged line")
leave_launched_process(3)
print("after the exit")
"""


def run(world_size: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": world_size}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_of_a_launch_exits_with_its_code_output_flushed_and_no_finalization():
    proc = run("2")
    assert proc.returncode == 3
    assert proc.stdout == "buffered line"  # flushed; nothing after the exit, no atexit handler
    assert "logged line" in proc.stderr


def test_a_single_process_returns_and_finishes_normally(monkeypatch):
    proc = run("1")
    assert proc.returncode == 0
    assert proc.stdout == "buffered lineafter the exit\natexit ran\n"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert leave_launched_process(0) is None  # this test process itself: not a launch, so it returns
