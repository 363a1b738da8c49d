"""RewardPool (`reward_workers: N`): N worker processes that decode and score groups off the training process,
each with its own GIL, at nice +10, started as new interpreters whose environment lacks the project's secrets
(config.SECRET_ENV_VARS: user code runs there). One `multiprocessing` Pipe per worker; per call a worker says which
stage runs, so a timeout or a crash names the reward function. A raising function gives in-thread scoring's error;
one past `reward_timeout`, or a worker that dies, is killed and replaced, and the error names the function, the
prompt and the cause. Why processes, new interpreters, pipes: docs/rollout-internals.md.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing
import multiprocessing.spawn
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from asyncgrpo.config import SECRET_ENV_VARS
from asyncgrpo.data import PromptRow
from asyncgrpo.errors import RewardFunctionError
from asyncgrpo.objects import MAIN
from asyncgrpo.rewards import RewardLog, RewardScorer, RewardState
from asyncgrpo.rollout.scoring import DECODING, reward_timeout_error, running_what, score_group

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # a spawned worker imports Python, the tokenizer and the user's reward modules
WORKER_NICE = 10  # workers yield the CPU to the training process when both want it (os.nice; see _worker_main)
WORKER_STOP_TIMEOUT_S = 5.0  # close(): a worker between calls exits at once on the stop message
PARENT_POLL_S = 1.0  # how often a worker checks that its parent lives: one stuck in a function outlives it by this


@dataclass(frozen=True)
class TokenizerRef:
    """Where a worker loads the tokenizer from: its class (the one the trainer got from AutoTokenizer; importing
    AutoTokenizer would import torch) and the local directory it was loaded from."""

    directory: str
    module: str
    qualname: str

    @classmethod
    def of(cls, tokenizer) -> TokenizerRef:
        kind = type(tokenizer)
        return cls(str(tokenizer.name_or_path), kind.__module__, kind.__qualname__)

    def load(self):  # pragma: no mutate block
        kind = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            kind = getattr(kind, part)
        return kind.from_pretrained(self.directory)


@dataclass(frozen=True)
class WorkerSpec:
    """All a worker needs to score like the parent's RewardScorer (plain data: it is pickled to the worker)."""

    refs: list[str]
    weights: list[float] | None
    fallback: float | None
    kwargs: dict | None
    tokenizer: TokenizerRef
    response_template: dict | None
    main: dict | None = None  # how to run the launched script again (multiprocessing.spawn), for its functions


def script_preparation(refs: list[str]) -> dict | None:
    """What a worker needs to run the launched script again as `__mp_main__` (so that `__main__:fn` imports), as
    multiprocessing's spawn does; None when no reference names the script (objects.py)."""
    if not any(ref.startswith(MAIN + ":") for ref in refs):
        return None
    data = multiprocessing.spawn.get_preparation_data("asyncgrpo-reward-worker")
    return {k: v for k, v in data.items() if k in ("sys_argv", "init_main_from_name", "init_main_from_path")}


def worker_environment() -> dict[str, str]:
    """A worker's environment: this process's, without the secrets asyncgrpo reads (the server and rollout keys:
    reward functions are user code and need none), with this copy of asyncgrpo importable first."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS}
    here = str(Path(__file__).resolve().parents[2])  # src/: the folder holding this copy of asyncgrpo
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return env


class _RemoteTraceback(Exception):
    """The worker's traceback, chained under the error it raised (as concurrent.futures does)."""

    def __str__(self) -> str:
        return self.args[0]


# ---- the worker process ------------------------------------------------------------------------------------------
def _child_main() -> None:  # pragma: no mutate block
    """A worker's entry point (`python -c`): wrap the inherited pipe end, take this process's sys.path and working
    directory from the parent (where the reward modules are found, as multiprocessing's spawn does), then serve."""
    exit_with_parent(int(sys.argv[2]))
    conn = Connection(int(sys.argv[1]))
    sys_path, cwd, spec = conn.recv()
    sys.path[:] = sys_path
    os.chdir(cwd)
    _worker_main(conn, spec)


def exit_with_parent(parent: int, poll_s: float = PARENT_POLL_S) -> None:  # pragma: no mutate block
    """End this process (exit code 1) once process `parent` is no longer its parent (it died, however: SIGKILL, the
    OOM killer), even while the main thread is inside a reward function that never returns: a daemon thread checks
    every `poll_s`. (A parent-death signal would not do: it fires when the parent's *thread* that started us ends.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(conn, spec: WorkerSpec) -> None:  # pragma: no mutate block
    """A worker's whole life: load, say ready, then score requests until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent closes us
    # Scoring is throughput work; rank 0's step is what every other rank waits for at the next collective. Where
    # cores are short, a lower priority lets the step run first and leaves the workers the idle time.
    os.nice(WORKER_NICE)
    try:
        if spec.main:
            multiprocessing.spawn.prepare(spec.main)  # the script's top level runs here as `__mp_main__`
        scorer = RewardScorer(spec.refs, spec.weights, spec.fallback, spec.kwargs)
        tokenizer = spec.tokenizer.load()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    scorer.on_call = lambda ref: conn.send(("running", ref))  # so that a timeout or a crash can name it
    conn.send(("ready",))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        row, completion_ids, finish_reasons, scorer.state = request
        before = scorer.fallbacks
        try:
            conn.send(("running", DECODING))
            rewards, parts = score_group(scorer, tokenizer, spec.response_template, row, completion_ids,
                                         finish_reasons)
        except Exception as exc:  # noqa: BLE001 - RewardFunctionError's text is the parent's error
            text = str(exc) if isinstance(exc, RewardFunctionError) else f"{type(exc).__name__}: {exc}"
            conn.send(("error", text, traceback.format_exc()))
            continue
        conn.send(("done", rewards, parts, scorer.fallbacks - before, scorer.logged.take()))


# ---- the parent's side -------------------------------------------------------------------------------------------
class _Process:
    """A worker's subprocess.Popen with the multiprocessing.Process methods the pool uses."""

    def __init__(self, popen: subprocess.Popen, name: str):
        self.popen, self.name, self.pid = popen, name, popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()  # negative: killed by that signal, as multiprocessing reports it

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, spec: WorkerSpec, slot: int):
        self.conn, child = multiprocessing.Pipe(duplex=True)
        # A new interpreter started with an environment of our choosing: multiprocessing's spawn copies this
        # process's environment, secrets included, where any reward function (or /proc/<pid>/environ) reads them.
        # A killed parent closes the pipe, and a worker between calls returns; one inside a function sees its parent
        # gone (exit_with_parent); the pool kills the rest at exit.
        command = [sys.executable, "-c", "from asyncgrpo.rollout.reward_pool import _child_main; _child_main()",
                   str(child.fileno()), str(os.getpid())]
        try:
            popen = subprocess.Popen(command, env=worker_environment(), pass_fds=[child.fileno()],
                                     stdin=subprocess.DEVNULL)
        finally:
            child.close()  # the parent keeps only its own end, so the worker's death reads as EOF
        self.process = _Process(popen, f"reward-worker-{slot}")
        try:
            self.conn.send((sys.path, os.getcwd(), spec))
        except OSError:
            pass  # it died at once: wait_ready reports it
        self.ready = False
        # Held by the thread using the pipe. The pipe is closed only under it: closing a descriptor that another
        # thread is waiting on (close() while a call scores) raised EBADF in that thread, or two threads closing it
        # at once closed the number twice (the second time perhaps someone else's newly opened file). A kill ends
        # any wait on the pipe (EOF), so the lock is released soon after one.
        self.io = threading.Lock()

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        with self.io:
            try:
                message = self.conn.recv() if self.conn.poll(timeout_s) else ("init_timeout",)
            except (EOFError, OSError):  # it died while starting (its stderr has the traceback)
                self.process.join(timeout=WORKER_STOP_TIMEOUT_S)
                message = ("init_died",)
        if message[0] == "ready":
            self.ready = True
            return
        self.kill()
        if message[0] == "init_error":
            raise RewardFunctionError(f"a reward worker process could not load the reward functions or the "
                                      f"tokenizer: {message[1]}\n  Fix: make the reward modules importable in a new "
                                      f"Python process (installed, or on PYTHONPATH), or set `reward_workers: 0`"
                                      ) from _RemoteTraceback(message[2])
        if message[0] == "init_died":
            raise RewardFunctionError(f"a reward worker process exited while starting (exit code "
                                      f"{self.process.exitcode}; its traceback is above). Fix: check that "
                                      f"`{sys.executable} -c 'import asyncgrpo'` works, or set `reward_workers: 0`")
        raise RewardFunctionError(f"a reward worker process did not start within {timeout_s:.0f} s (exit code "
                                  f"{self.process.exitcode}). Fix: check that the reward modules import quickly in a "
                                  f"new Python process, or set `reward_workers: 0`")

    def kill(self) -> None:
        """Kill the process (which ends any wait on the pipe), then close the pipe once no thread uses it. Any
        thread may call it, more than once."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=WORKER_STOP_TIMEOUT_S)
        with self.io:
            self.conn.close()

    def stop(self) -> None:
        """Ask an idle worker to exit; a worker still scoring (its pipe in use) is not asked. Either way it is
        killed if it has not exited after a short wait."""
        if self.io.acquire(blocking=False):
            try:
                self.conn.send(None)
            except OSError:
                pass
            finally:
                self.io.release()
        self.process.join(timeout=WORKER_STOP_TIMEOUT_S)
        self.kill()


class RewardPool:
    """A `GroupScorer` with N worker processes; any number of threads may call `score_group` at once (each waits
    for an idle worker). `close()` stops them; it is called at the producer's stop."""

    def __init__(self, workers: int, scorer: RewardScorer, tokenizer: TokenizerRef,
                 response_template: dict | None = None, *, timeout_s: float = 60.0,
                 start_timeout_s: float = WORKER_START_TIMEOUT_S):
        assert workers > 0, workers
        self.spec = WorkerSpec(list(scorer.refs), scorer.weights, scorer.fallback, scorer.kwargs, tokenizer,
                               response_template, main=script_preparation(scorer.refs))
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.fallbacks = 0
        self.logged = RewardLog()  # what the workers' reward functions logged, merged as their answers come
        self.state = RewardState(max_steps=scorer.state.max_steps)  # each request carries it as `trainer_state`
        self.replaced = 0  # workers killed or found dead and started anew
        self._lock = threading.Lock()  # fallbacks, and the list of workers (for close)
        self._closed = False
        self._workers = [_Worker(self.spec, slot) for slot in range(workers)]  # all start at once
        atexit.register(self._kill_at_exit)  # a worker stuck in a function never reads the pipe's EOF
        self._idle: queue.Queue[_Worker] = queue.Queue()
        try:
            for worker in self._workers:
                worker.wait_ready(start_timeout_s)
                self._idle.put(worker)
        except BaseException:
            self.close()
            raise
        log.info("reward scoring in %d worker processes (pids %s), reward_timeout %g s", workers,
                 " ".join(str(w.process.pid) for w in self._workers), timeout_s)

    @property
    def workers(self) -> int:
        return len(self._workers)

    def at_step(self, step: int, version: int) -> None:
        self.state = RewardState(global_step=step, max_steps=self.state.max_steps, policy_version=version)

    def take_logged(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        return self.logged.take()

    def score_group(self, row: PromptRow, completion_ids: list[list[int]],
                    finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
        worker = self._idle.get()
        try:
            if self._closed:
                raise RewardFunctionError("the reward pool was closed (the run is stopping)")
            worker.wait_ready(self.start_timeout_s)  # a replacement is awaited on its first use
            rewards, parts, fallbacks, logged = self._call(worker, row, completion_ids, finish_reasons)
        except _WorkerLost as lost:
            worker = self._replace(worker)
            raise lost.error from None
        finally:
            self._idle.put(worker)
        with self._lock:
            self.fallbacks += fallbacks
        self.logged.merge(*logged)
        return rewards, parts

    def _call(self, worker: _Worker, row: PromptRow, completion_ids, finish_reasons):
        """One request to one worker, within `timeout_s`; a worker that overruns is killed (by the caller)."""
        deadline = time.monotonic() + self.timeout_s
        running = "(none yet: the request was being sent)"
        with worker.io:
            try:
                worker.conn.send((row, completion_ids, finish_reasons, self.state))
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not worker.conn.poll(left):
                        raise _WorkerLost(self._timeout_error(running, row, len(completion_ids)))
                    message = worker.conn.recv()
                    if message[0] == "running":
                        running = message[1]
                    elif message[0] == "done":
                        return message[1], message[2], message[3], message[4]
                    else:
                        assert message[0] == "error", message
                        raise RewardFunctionError(message[1]) from _RemoteTraceback(message[2])
            except (EOFError, OSError):  # the worker died (its end of the pipe closed)
                raise _WorkerLost(self._crash_error(worker, running, row)) from None

    def _timeout_error(self, running: str, row: PromptRow, n: int) -> RewardFunctionError:
        return reward_timeout_error(running, self.spec.refs, self.timeout_s, row, n,
                                    "Its worker process was killed and replaced. Fix: find where the function hangs "
                                    "or make it faster, or raise `reward_timeout`")

    def _crash_error(self, worker: _Worker, running: str, row: PromptRow) -> RewardFunctionError:
        worker.process.join(timeout=WORKER_STOP_TIMEOUT_S)
        code = worker.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            try:
                how += f" (killed by {signal.Signals(-code).name})"
            except ValueError:
                pass
        return RewardFunctionError(
            f"the reward worker process died with {how} while running {running_what(running, self.spec.refs)}\n"
            f"  on prompt {row.prompt!r}\n"
            f"  A crash in native code or an exit call inside the function ends its process; a new worker was "
            f"started. Fix: run the function on this prompt outside asyncgrpo to see the crash")

    def _replace(self, worker: _Worker) -> _Worker:
        """Kill `worker` and start a new one in its slot (awaited on its first use, not here)."""
        worker.kill()
        with self._lock:
            slot = self._workers.index(worker)
            fresh = worker if self._closed else _Worker(self.spec, slot)
            self._workers[slot] = fresh
            self.replaced += fresh is not worker
        log.warning("reward worker %d was replaced (pid %s -> %s)", slot, worker.process.pid, fresh.process.pid)
        return fresh

    def close(self) -> None:
        """Stop every worker (one between calls exits at once; one still scoring is killed after a short wait)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        for worker in workers:
            worker.stop()
        atexit.unregister(self._kill_at_exit)

    def _kill_at_exit(self) -> None:
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()


class _WorkerLost(Exception):
    """Internal: the worker timed out or died; carries the user-facing error."""

    def __init__(self, error: RewardFunctionError):
        super().__init__(str(error))
        self.error = error
