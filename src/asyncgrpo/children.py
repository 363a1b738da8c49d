"""Child process groups that cannot outlive us: a vLLM server and its engine core, a training launch and its ranks.

`spawn_group(cmd)` starts `cmd` in a session of its own (a Ctrl-C or a `timeout` aimed at our group does not reach it
half-way) with a parent-death signal, plus a small guard process that kills the whole group if this process dies
without stopping it (SIGKILL, the OOM killer). `GroupProcess.stop` ends the group: SIGTERM, then SIGKILL after a
grace. Why both: docs/faults.md#nothing-left-running.

    python -m asyncgrpo.children PGID   # the guard (started by spawn_group, not by hand)
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that forked it exits
GROUP_GRACE_S = 15.0  # SIGTERM to SIGKILL: vLLM CPU exits ~2 s after SIGTERM, a GPU node freeing its cache later
GUARD_POLL_S = 5.0  # how often a guard checks whether its group is still there (it exits once the group is gone)
REAP_POLL_S = 0.05  # while waiting for a group to empty after SIGTERM: short, the wait ends as soon as it is empty


def _parent_death_signal(signum: int):
    """A preexec function that asks the kernel to send `signum` to the child when its parent thread exits, or None
    where prctl is not there (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing but the call runs after the fork
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)

    return preexec


def group_alive(pgid: int) -> bool:
    """Whether any process (a zombie too) is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the number is someone else's group now
        return False
    return True


def signal_group(pgid: int, signum: int) -> None:
    """Send `signum` to every process of group `pgid`; a group already gone is not an error."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, grace_s: float = GROUP_GRACE_S) -> None:
    """SIGTERM the group, wait up to `grace_s` for it to empty, then SIGKILL what is left."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(REAP_POLL_S)
    signal_group(pgid, signal.SIGKILL)


class GroupProcess:
    """A child process that leads a process group of its own, with a guard that ends the group if we die first.

    `process` is the leader's `subprocess.Popen`. `stop` ends the whole group (the leader and whatever it started,
    such as vLLM's engine core, which a SIGKILL of the leader alone leaves running) and the guard."""

    def __init__(self, cmd: Sequence[str], **popen_kwargs):
        assert "start_new_session" not in popen_kwargs and "preexec_fn" not in popen_kwargs, "set by GroupProcess"
        # The parent-death signal is tied to the thread that forks: set it only from the main thread, whose end is
        # the process's end. It covers the moment before the guard runs; the guard covers the leader's children.
        in_main = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(list(cmd), start_new_session=True,
                                        preexec_fn=_parent_death_signal(signal.SIGTERM) if in_main else None,
                                        **popen_kwargs)  # fmt: skip
        self.pgid = self.process.pid  # a new session's id is its leader's pid
        self._guard_write: int | None = None
        self._guard: subprocess.Popen | None = None
        try:
            self._start_guard()
        except BaseException:
            self.stop(grace_s=0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _start_guard(self) -> None:
        # The guard reads a pipe whose write end only we hold (os.pipe is not inherited by exec'd children): when we
        # die, however, the kernel closes it and the guard reads end-of-file.
        read, self._guard_write = os.pipe()
        try:
            self._guard = subprocess.Popen([sys.executable, "-m", __name__, str(self.pgid), str(read)],
                                           pass_fds=[read], stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read)

    def stop(self, grace_s: float = GROUP_GRACE_S) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s`, reap the leader, dismiss the guard. Idempotent; returns the
        leader's exit code."""
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the leader first: vLLM's API server then ends its engine core itself
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM for %g s: killing its process group", proc.pid, grace_s)
        # The leader's pid is not reused while its group has members (the kernel keeps the id), so what answers to
        # the group is ours: the leader if it ignored SIGTERM, or children that outlived it.
        if group_alive(self.pgid):
            end_group(self.pgid, grace_s=min(grace_s, 2.0))
        proc.wait()
        self._dismiss_guard()
        return proc.returncode

    def _dismiss_guard(self) -> None:
        if self._guard is not None:
            self._guard.kill()  # the group is gone: nothing left to guard
            self._guard.wait()
            self._guard = None
        if self._guard_write is not None:
            os.close(self._guard_write)
            self._guard_write = None


def run_group(cmd: Sequence[str], *, timeout: float | None = None, grace_s: float = GROUP_GRACE_S,
              **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` for a command that starts children of its own (`accelerate launch` and its ranks): it runs
    as a GroupProcess, and whatever ends the wait (a signal's SystemExit, Ctrl-C, `timeout`) ends the whole group,
    SIGTERM first so that ranks can resume the servers they paused. Raises subprocess.TimeoutExpired on `timeout`."""
    if popen_kwargs.pop("capture_output", False):
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    group = GroupProcess(cmd, **popen_kwargs)
    try:
        stdout, stderr = group.process.communicate(timeout=timeout)
    except BaseException:
        group.stop(grace_s)
        raise
    group.stop(grace_s)  # the leader has exited; anything it left in its group goes with it
    return subprocess.CompletedProcess(list(cmd), group.process.returncode, stdout, stderr)


def guard(pgid: int, fd: int, poll_s: float = GUARD_POLL_S) -> None:
    """The guard's loop: when `fd` reads end-of-file (the process that started us is gone), end group `pgid`; exit
    once the group is empty. Signals aimed at whole groups (Ctrl-C, `timeout`) are ignored: only the pipe decides."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    while group_alive(pgid):
        ready, _, _ = select.select([fd], [], [], poll_s)
        if ready and not os.read(fd, 1):  # end of file: the parent died without stopping the group
            end_group(pgid)
            return


if __name__ == "__main__":
    guard(int(sys.argv[1]), int(sys.argv[2]))
