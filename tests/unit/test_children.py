"""A child process group (children.py) ends as a whole: on `stop`, when `run_group`'s wait is cut short, and when the
process that started it is SIGKILLed (the guard). The groups here are short Python one-liners, no vLLM."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import psutil
import pytest

from asyncgrpo.children import GroupProcess, run_group

DEADLINE_S = 30.0

# A leader that starts a grandchild (as vLLM's API server starts its engine core), prints both pids, then waits.
LEADER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(os.getpid(), child.pid, flush=True)
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout_s: float = DEADLINE_S) -> list[int]:
    """Poll until every pid has exited; return those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_stop_ends_the_leader_and_the_children_it_started():
    group = GroupProcess([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    leader, child = map(int, group.process.stdout.readline().split())
    guard = group._guard.pid
    assert os.getpgid(child) == group.pgid == leader != os.getpgid(0)  # a group of its own, the grandchild in it

    assert group.stop(grace_s=5) == -signal.SIGTERM
    assert wait_gone([leader, child, guard]) == []
    assert group.stop() == -signal.SIGTERM  # idempotent


def test_a_sigkilled_parent_leaves_nothing_of_its_group():
    # The parent starts the group and is then SIGKILLed: no `finally` runs. The leader dies by its parent-death
    # signal; the grandchild, which has none, only by the guard.
    parent_code = textwrap.dedent(f"""
        import json, subprocess, sys, time
        from asyncgrpo.children import GroupProcess
        group = GroupProcess([sys.executable, "-c", {LEADER!r}], stdout=subprocess.PIPE, text=True)
        leader, child = map(int, group.process.stdout.readline().split())
        print(json.dumps([leader, child, group._guard.pid]), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert not any(gone(p) for p in pids)
        parent.kill()
        parent.wait()
        assert wait_gone(pids) == []
    finally:
        parent.kill()
        parent.wait()


def test_run_group_ends_the_whole_group_when_a_signal_cuts_its_wait_short(tmp_path):
    pids_file = tmp_path / "pids"
    code = LEADER.replace("print(os.getpid(), child.pid, flush=True)",
                          f"open({str(pids_file)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{child.pid}}'); "
                          f"os.rename({str(pids_file)!r} + '.tmp', {str(pids_file)!r})")

    def interrupt_once_started():  # Ctrl-C, once the grandchild exists
        deadline = time.monotonic() + DEADLINE_S
        while not pids_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as a user's process has it (Python's default handler), whatever a test before this one left installed:
    # one full run saw the SIGINT not raise here. Say what was there, so that the test that leaves it can be found.
    before = signal.getsignal(signal.SIGINT)
    if before is not signal.default_int_handler:
        warnings.warn(f"SIGINT's handler was {before!r} when this test started, not Python's default")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_group([sys.executable, "-c", code], timeout=2 * DEADLINE_S, grace_s=5)
    finally:
        signal.signal(signal.SIGINT, before)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and wait_gone(pids) == []


def test_run_group_returns_the_exit_code_and_output():
    done = run_group([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "out\n")
