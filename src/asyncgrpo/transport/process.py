"""The rollout side in a process of its own, as rank 0 sees it: `RolloutProcess`, a proxy with the rollout interface
whose calls go over a connection to a RolloutSide served by transport/rollout_server.py. Its `peer` makes the connection and
knows whether the other end lives: `ChildPeer` (here) spawns a child over a socketpair (`rollout_process: true`; no
key, no network), remote.RemotePeer connects to an `asyncgrpo rollout-serve` over TLS (`rollout_address`). Errors
there are raised here with their own type; a peer that dies makes the waiting call raise RolloutProcessError naming
it and the fix. Transport, failures and why: docs/rollout-internals.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

from asyncgrpo.contracts import Group, ServedProbe
from asyncgrpo.errors import RolloutProcessError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.transport.rollout_server import serve
from asyncgrpo.transport.wire import decode_groups, rebuild_exception

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a wait checks that the child is alive: a dead child is reported within about this
TAKE_GRACE_S = 60.0  # beyond take's own timeout (the child raises TimeoutError itself): the answer's transfer
JOIN_S = 10.0  # for the child to exit once it has answered `close`, or after a signal
RESUME_TIMEOUT_S = 10.0  # each /is_paused and /resume call after the child died: answered at once by a live server


class RolloutProcess:
    """The rollout interface (transport/interface.py), served by another process that `peer` reaches: a child this
    process spawns (ChildPeer, the default) or an `asyncgrpo rollout-serve` over TCP (remote.RemotePeer). The peer
    makes the connection and knows whether the other end lives, how it ended, and how to stop it; everything else is
    this class's. `tokenizer` is not sent: the other side loads its own from `model_path`."""

    def __init__(self, cfg, *, tokenizer=None, model_path: str, peft_config, groups_per_step: int, step: int = 0,
                 data_position: int = 0, previous_run_id: str | None = None, peer=None):
        del tokenizer  # the other side loads its own: nothing heavy is pickled
        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:8]  # chosen here so that checkpoints name it without asking the other side
        self._side_kwargs = dict(model_path=model_path, peft_config=peft_config, groups_per_step=groups_per_step,
                                 step=step, data_position=data_position, previous_run_id=previous_run_id)
        self.peer = peer if peer is not None else ChildPeer()
        self._broken: str | None = None  # why the connection can no longer be used (a call timed out, the peer died)
        self._halted = False

    # ---- the interface ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Reach the other side (spawn the child, or connect), then have it start the side (servers checked, data
        loaded, producer started)."""
        self.peer.connect(self.cfg, self._side_kwargs, self.run_id)
        self._call("start")

    def take(self, n: int, version: int, timeout_s: float) -> list[Group]:
        return decode_groups(self._call("take", n, version, timeout_s, timeout_s=timeout_s + TAKE_GRACE_S))

    def publish(self, version: int, tensors: dict, step: int, wait: bool = False,
                probe: ServedProbe | None = None) -> float:
        from safetensors.torch import save  # heavy: safetensors, needed only once a version is published

        blob = save({k: v.detach().contiguous() for k, v in tensors.items()})
        return self._call("publish", version, blob, step, wait, probe)

    def wait_published(self) -> None:
        self._call("wait_published")

    @property
    def adapter_name(self) -> str | None:
        return self._call("adapter_name")

    @property
    def adapter_path(self) -> Path | None:
        return self._call("adapter_path")

    @property
    def tensorboard_dir(self) -> Path:
        """Where the rollout process writes TensorBoard (absolute; on a rollout server: a path on its host)."""
        return self._call("tensorboard_dir")

    def stats(self) -> dict[str, float]:
        return self._call("stats")

    def log(self, values: dict[str, float], step: int) -> None:
        self._call("log", values, step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self._call("log_table", name, columns, rows, step)

    def evaluate(self, step: int) -> dict[str, float]:
        return self._call("evaluate", step)

    def evaluation_wait_s(self) -> float:
        return self._call("evaluation_wait_s")

    def halt(self) -> None:
        """On SIGTERM/SIGINT (either thread of shutdown.py, maybe twice): have the other side resume any server a
        sync in progress paused, close the side and exit (the peer signals the child, or shuts the socket down). Not
        through the connection: the main thread may be using it."""
        if self._halted or not self.peer.alive():
            return
        self._halted = True
        self.peer.halt()

    def close(self, keep_final: bool) -> None:
        """Have the other side close (unloading every version but the live one with `keep_final`) and exit; the peer
        then stops it within a bound. Safe after a start that failed part-way or a peer that died."""
        if not self.peer.started():
            return
        bound = JOIN_S + self.cfg.vllm_request_timeout * 2  # the unloads are HTTP calls, each within its timeout
        try:
            if self.peer.alive() and self._broken is None and not self._halted:
                self._call("close", keep_final, timeout_s=bound)
        finally:
            self.peer.stop(bound)

    # ---- plumbing ---------------------------------------------------------------------------------------
    def _call(self, op: str, *args, timeout_s: float | None = None):
        """Send `op(*args)` to the other side and wait for its answer: the value, or its exception raised here. Waits
        check the peer is alive every POLL_S; `timeout_s` bounds the whole wait (None: as long as the peer lives,
        which bounds its own waits by the config's timeouts)."""
        if self._broken is not None:
            raise RolloutProcessError(self._broken)
        try:
            self.peer.conn.send((op, args))
        except OSError as exc:  # a closed pipe, a reset or timed-out socket
            raise self._died(op, exc) from exc
        try:
            status, value = self._answer(op, timeout_s)
        except BaseException:
            # No answer read (the peer died, the wait timed out, or a signal's SystemExit came in the middle): a late
            # answer would be taken for the next call's, so the connection is used no more.
            if self._broken is None:
                self._broken = f"a call to {self.peer.name} (`{op}`) was interrupted before its answer came"
            raise
        if status == "error":
            raise rebuild_exception(value)
        return value

    def _answer(self, op: str, timeout_s: float | None) -> tuple[str, object]:
        conn = self.peer.conn
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            if conn.poll(wait):
                try:
                    return conn.recv()
                except (EOFError, OSError) as exc:  # OSError: a socket reset, or given up on by TCP keepalive
                    raise self._died(op, exc) from exc
            if not self.peer.alive() and not conn.poll(0):
                raise self._died(op, None)
            if deadline is not None and time.monotonic() >= deadline:
                self._broken = (f"{self.peer.name} did not answer `{op}` within {timeout_s:.0f} s although it is "
                                f"alive; its log lines (prefix [rollout]) say what it is doing. Fix: if a reward "
                                f"function hangs, make it return; else rerun {self.peer.in_process} to see the same "
                                f"failure in the training process")
                raise RolloutProcessError(self._broken)

    def _died(self, op: str, exc: BaseException | None) -> RolloutProcessError:
        how = self.peer.how_it_ended(exc)
        resumed = _resume_left_paused(self.cfg)
        left = f" It left {', '.join(resumed)} paused mid-sync; the trainer resumed them." if resumed else ""
        self._broken = (f"{self.peer.name} {how} while the trainer waited for `{op}`.{left} Fix: {self.peer.fix}; "
                        f"rerun {self.peer.in_process} to see the failure in the training process")
        return RolloutProcessError(self._broken)


class ChildPeer:
    """The spawned form: a child process of this one, over a Pipe (a socketpair: only the two processes hold its
    ends, so it needs neither the rollout key nor TLS)."""

    in_process = "with `rollout_process: false`"
    fix = ("its last log lines (prefix [rollout]) say what it was doing; SIGKILL is most often the out-of-memory "
           "killer (give the host more memory or lower max_inflight_requests), SIGSEGV a native library or reward "
           "function")

    def __init__(self):
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn = None

    @property
    def name(self) -> str:
        return f"the rollout process (pid {self.process.pid})"

    def connect(self, cfg, side_kwargs: dict, run_id: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=serve, name="asyncgrpo-rollout", daemon=False,
                                   args=(child_end, cfg, side_kwargs, run_id))
        self.process.start()
        child_end.close()  # ours is gone: when the child dies, our end reads EOF
        log.info("rollout side running in its own process (pid %d)", self.process.pid)

    def started(self) -> bool:
        return self.process is not None

    def alive(self) -> bool:
        return self.process is not None and self.process.pid is not None and self.process.is_alive()

    def how_it_ended(self, exc: BaseException | None) -> str:
        self.process.join(timeout=JOIN_S)
        code = self.process.exitcode
        if code is None:
            return "closed its end of the pipe"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def halt(self) -> None:
        try:
            os.kill(self.process.pid, signal.SIGTERM)  # its handlers resume, close and exit (shutdown.py)
        except ProcessLookupError:
            pass

    def stop(self, bound: float) -> None:
        """Close our end, join within `bound`, then terminate and kill."""
        # Closed first: a child that was not asked to close (a broken pipe, a signal) reads EOF, resumes any server it
        # paused, unloads this run's versions and exits by itself.
        self.conn.close()
        self.process.join(timeout=bound)
        if self.process.is_alive():
            log.warning("the rollout process (pid %d) did not exit within %.0f s; terminating it", self.process.pid,
                        bound)
            self.process.terminate()
            self.process.join(timeout=JOIN_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _resume_left_paused(cfg) -> list[str]:
    """A rollout process killed mid-sync could not resume the servers it had paused (`sync_mode: pause`); the
    trainer, still alive, does it for it. Returns the URLs it resumed. Best effort: the run is failing anyway."""
    if cfg.sync_mode != "pause":
        return []
    resumed = []
    for url in cfg.server_urls:
        try:
            with InferenceClient(url, api_key=cfg.api_key, timeout_s=RESUME_TIMEOUT_S) as client:
                if client.is_paused():
                    client.resume()
                    resumed.append(url)
                    log.warning("resumed %s, which the dead rollout process had left paused", url)
        except Exception as exc:  # noqa: BLE001 - report and go on: the error raised names the dead process
            log.error("could not check whether %s was left paused by the dead rollout process: %s", url, exc)
    return resumed
