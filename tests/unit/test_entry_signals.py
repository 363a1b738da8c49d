"""The entry points that start no vLLM end on SIGTERM, SIGINT and SIGHUP with 128 + the signal number, leaving no
process behind: `asyncgrpo rollout-serve` waiting for its trainer and the adapter receiver waiting for uploads.
(vLLM's own entry points: tests/integration/test_shutdown.py.)"""

import os
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

DEADLINE_S = 60.0  # rollout-serve imports torch before it listens: seconds on a loaded machine


def run_until(cmd: list[str], ready: str, env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` and return once its stderr has said `ready`."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    deadline, said = time.monotonic() + DEADLINE_S, ""
    while ready not in said:
        assert proc.poll() is None, f"exited with {proc.returncode}: {said}{proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{ready!r} not said within {DEADLINE_S} s: {said}"
        if select.select([proc.stderr], [], [], 0.1)[0]:
            said += proc.stderr.readline()
    return proc


SIGNALS = [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
IDS = ["SIGTERM", "SIGINT", "SIGHUP"]


@pytest.mark.parametrize("signum, code", SIGNALS, ids=IDS)
def test_rollout_serve_waiting_for_its_trainer_exits_on_a_signal(signum, code):
    env = {**os.environ, "ASYNCGRPO_ROLLOUT_KEY": "8c1f3a5e9b2d6c0f4a9e7b3d1f4c1a7e3b5d8c2f6a0e4b9d7c"}
    proc = run_until([sys.executable, "-m", "asyncgrpo", "rollout-serve", "--listen", "127.0.0.1:0"],
                     "rollout server listening on", env)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signum)
    assert proc.wait(timeout=DEADLINE_S) == code
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("signum, code", SIGNALS, ids=IDS)
def test_the_adapter_receiver_exits_on_a_signal(tmp_path, signum, code):
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGRPO_VLLM_API_KEY"}
    proc = run_until([sys.executable, "-m", "asyncgrpo.inference_node.receiver", "--dir", str(tmp_path), "--port", "0"],
                     "receiving adapters into", env)
    proc.send_signal(signum)
    assert proc.wait(timeout=DEADLINE_S) == code
