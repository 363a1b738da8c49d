"""The rollout side in a process of its own (`rollout_process: true`): rank 0 spawns a child that runs the whole
`RolloutSide` (clients, recovery, store, publisher, scorer, queue, producer, TensorBoard writer), and talks to it
through `RolloutProcess`, a proxy with exactly RolloutSide's interface. The producer's threads, the request pool and
the reward functions then no longer share the training process's GIL, and a reward function that crashes its
interpreter takes down the child, which the trainer reports, instead of the trainer itself.

    side = open_rollout_side(cfg, tokenizer=tok, model_path=path, peft_config=lora, groups_per_step=n)  # the factory

Transport: a `multiprocessing` Pipe (a socketpair) from the standard library. One parent talks to one child on the
same host, request then answer, so a message layer such as pyzmq (sockets, patterns, reconnection, a dependency of its
own) would add nothing; a Pipe already frames messages, pickles the small ones, carries raw bytes unchanged, and
reports the other end closing (EOF), which is how each side notices the other died. Batches come back as one compact
binary blob (rollout/wire.py: flat token and logprob buffers, no per-token pickling); a version's LoRA tensors go as
safetensors bytes (`safetensors.torch.save`): one copy, exact dtypes and shapes, the format the adapter store writes
anyway, and none of the shared-memory file descriptors that torch's multiprocessing pickler would use for tensors
(whose lifetime would then hang on the parent's references).

The child is spawned (not forked: rank 0 has threads and torch loaded), loads the tokenizer itself from the local model
directory, and serves one request at a time on its main thread. Failures:
- an exception in the child comes back and is raised in the trainer with its own type and message (wire.py);
- a child that dies (killed, segfault) makes the pending or next call raise RolloutProcessError naming the rollout
  process, its exit code or signal and the fix; every wait polls the child's liveness, so none hangs;
- SIGTERM/SIGINT: the trainer's `halt` signals the child, whose handlers (shutdown.py) resume any server a sync in
  progress paused, then close the side and exit; a trainer that vanishes is seen as EOF and handled the same way;
- `close(keep_final)` asks the child to close, joins it within a bound, then terminates and kills it.

Not done: starting the rollout side on another host with one command (the child is always rank 0's).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
import uuid
from pathlib import Path

from ..errors import RolloutProcessError
from .queue import Group
from .side import RolloutSide
from .wire import decode_groups, encode_groups, pack_exception, rebuild_exception

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a wait checks that the child is alive: a dead child is reported within about this
TAKE_GRACE_S = 60.0  # beyond take's own timeout (the child raises TimeoutError itself): the answer's transfer
JOIN_S = 10.0  # for the child to exit once it has answered `close`, or after a signal
RESUME_TIMEOUT_S = 10.0  # each /is_paused and /resume call after the child died: answered at once by a live server


def open_rollout_side(cfg, **kwargs) -> RolloutSide | RolloutProcess:
    """Rank 0's rollout side: in this process, or in a child process it spawns (`rollout_process: true`). Same
    interface, same arguments (RolloutSide's)."""
    return RolloutProcess(cfg, **kwargs) if cfg.rollout_process else RolloutSide(cfg, **kwargs)


class RolloutProcess:
    """RolloutSide's interface, served by a child process (module docstring). `tokenizer` is not sent: the child
    loads its own from `model_path`."""

    def __init__(self, cfg, *, tokenizer=None, model_path: str, peft_config, groups_per_step: int, step: int = 0,
                 data_position: int = 0, previous_run_id: str | None = None):
        del tokenizer  # the child loads its own: nothing heavy is pickled
        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:8]  # chosen here so that checkpoints name it without asking the child
        self.tensorboard_dir = Path(cfg.output_dir) / "tensorboard"
        self._side_kwargs = dict(model_path=model_path, peft_config=peft_config, groups_per_step=groups_per_step,
                                 step=step, data_position=data_position, previous_run_id=previous_run_id)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._broken: str | None = None  # why the pipe can no longer be used (a call timed out, the child died)
        self._halted = False

    # ---- the interface ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the child, then have it start the side (servers checked, data loaded, producer started)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=serve, name="asyncgrpo-rollout", daemon=False,
                                   args=(child_end, self.cfg, self._side_kwargs, self.run_id))
        self.process.start()
        child_end.close()  # ours is gone: when the child dies, our end reads EOF
        log.info("rollout side running in its own process (pid %d)", self.process.pid)
        self._call("start")

    def take(self, n: int, version: int, timeout_s: float) -> list[Group]:
        return decode_groups(self._call("take", n, version, timeout_s, timeout_s=timeout_s + TAKE_GRACE_S))

    def publish(self, version: int, tensors: dict, step: int, wait: bool = False) -> float:
        from safetensors.torch import save

        blob = save({k: v.detach().contiguous() for k, v in tensors.items()})
        return self._call("publish", version, blob, step, wait)

    def wait_published(self) -> None:
        self._call("wait_published")

    @property
    def adapter_name(self) -> str | None:
        return self._call("adapter_name")

    @property
    def adapter_path(self) -> Path | None:
        return self._call("adapter_path")

    def stats(self) -> dict[str, float]:
        return self._call("stats")

    def log(self, values: dict[str, float], step: int) -> None:
        self._call("log", values, step)

    def halt(self) -> None:
        """On SIGTERM/SIGINT (either thread of shutdown.py, maybe twice): signal the child, which resumes any server a
        sync in progress paused, closes the side and exits. Not through the pipe: the main thread may be using it."""
        if self._halted or self.process is None or self.process.pid is None or not self.process.is_alive():
            return
        self._halted = True
        try:
            os.kill(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def close(self, keep_final: bool) -> None:
        """Have the child close the side (unloading every version but the live one with `keep_final`) and exit; join
        it within a bound, then terminate and kill it. Safe after a start that failed part-way or a child that died."""
        if self.process is None:
            return
        bound = JOIN_S + self.cfg.vllm_request_timeout * 2  # the unloads are HTTP calls, each within its timeout
        try:
            if self.process.is_alive() and self._broken is None and not self._halted:
                self._call("close", keep_final, timeout_s=bound)
        finally:
            self._stop_child(bound)

    # ---- plumbing ---------------------------------------------------------------------------------------
    def _stop_child(self, bound: float) -> None:
        # Closed first: a child that was not asked to close (a broken pipe, a signal) reads EOF, resumes any server it
        # paused, unloads this run's versions and exits by itself.
        self._conn.close()
        self.process.join(timeout=bound)
        if self.process.is_alive():
            log.warning("the rollout process (pid %d) did not exit within %.0f s; terminating it", self.process.pid,
                        bound)
            self.process.terminate()
            self.process.join(timeout=JOIN_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _call(self, op: str, *args, timeout_s: float | None = None):
        """Send `op(*args)` to the child and wait for its answer: the value, or its exception raised here. Waits
        check the child is alive every POLL_S; `timeout_s` bounds the whole wait (None: as long as the child lives,
        which bounds its own waits by the config's timeouts)."""
        if self._broken is not None:
            raise RolloutProcessError(self._broken)
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, ConnectionError, EOFError) as exc:
            raise self._died(op) from exc
        try:
            status, value = self._answer(op, timeout_s)
        except BaseException:
            # No answer read (the child died, the wait timed out, or a signal's SystemExit came in the middle): a late
            # answer would be taken for the next call's, so the pipe is used no more.
            if self._broken is None:
                self._broken = f"a call to the rollout process (`{op}`) was interrupted before its answer came"
            raise
        if status == "error":
            raise rebuild_exception(value)
        return value

    def _answer(self, op: str, timeout_s: float | None) -> tuple[str, object]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            if self._conn.poll(wait):
                try:
                    return self._conn.recv()
                except (EOFError, ConnectionError) as exc:
                    raise self._died(op) from exc
            if not self.process.is_alive() and not self._conn.poll(0):
                raise self._died(op)
            if deadline is not None and time.monotonic() >= deadline:
                self._broken = (f"the rollout process (pid {self.process.pid}) did not answer `{op}` within "
                                f"{timeout_s:.0f} s although it is alive; its log lines (prefix [rollout]) say what "
                                f"it is doing. Fix: if a reward function hangs, make it return; else rerun with "
                                f"`rollout_process: false` to see the same failure in the training process")
                raise RolloutProcessError(self._broken)

    def _died(self, op: str) -> RolloutProcessError:
        self.process.join(timeout=JOIN_S)
        code = self.process.exitcode
        if code is None:
            how = "closed its end of the pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        resumed = _resume_left_paused(self.cfg)
        left = f" It left {', '.join(resumed)} paused mid-sync; the trainer resumed them." if resumed else ""
        self._broken = (f"the rollout process (pid {self.process.pid}) {how} while the trainer waited for "
                        f"`{op}`.{left} Fix: its last log lines (prefix [rollout]) say what it was doing; SIGKILL is "
                        f"most often the out-of-memory killer (give the host more memory or lower "
                        f"max_inflight_requests), SIGSEGV a native library or reward function; rerun with "
                        f"`rollout_process: false` to see the failure in the training process")
        return RolloutProcessError(self._broken)


def _resume_left_paused(cfg) -> list[str]:
    """A rollout process killed mid-sync could not resume the servers it had paused (`sync_mode: pause`); the
    trainer, still alive, does it for it. Returns the URLs it resumed. Best effort: the run is failing anyway."""
    if cfg.sync_mode != "pause":
        return []
    from ..inference.client import InferenceClient

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


# ---- the child --------------------------------------------------------------------------------------------
def serve(conn, cfg, side_kwargs: dict, run_id: str) -> None:
    """The child's main: build the side, answer requests until `close` or the trainer's end of the pipe closes; on
    SIGTERM/SIGINT resume any paused server (shutdown.py), close the side and exit 143/130."""
    from transformers import AutoTokenizer

    from ..data import local_model_dir
    from ..shutdown import exit_on_signal

    logging.basicConfig(level=logging.INFO, format="[rollout] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    # A signal after the first (the trainer's halt after a Ctrl-C the child saw too) must not kill the close in
    # progress: exit_on_signal restores these, and the trainer kills a child that does not exit in time.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    side = RolloutSide(cfg, tokenizer=AutoTokenizer.from_pretrained(local_model_dir(side_kwargs["model_path"])),
                       **side_kwargs)
    side.run_id = run_id  # the trainer's, named in its checkpoints
    keep_final = None  # set by `close`; None: the trainer went away or a signal came, unload every version
    with exit_on_signal(side.halt):
        try:
            keep_final = _answer_requests(conn, side)
        finally:
            if keep_final is None:
                side.halt()  # whatever ended us, leave no server paused
                _close_quietly(side, keep_final=False)
            conn.close()


def _answer_requests(conn, side: RolloutSide) -> bool | None:
    """Serve until `close` (returns its keep_final, after closing the side) or EOF (returns None)."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, ConnectionError):
            logging.getLogger(__name__).warning("the trainer closed the pipe: closing the rollout side")
            return None
        try:
            value = _handle(side, op, args)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the trainer, typed
            reply = ("error", pack_exception(exc, traceback.format_exc()))
        else:
            reply = ("ok", value)
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionError):
            return None
        if op == "close":  # done, or failed part-way (the trainer raises it): either way not closed again
            return bool(args[0])


def _handle(side: RolloutSide, op: str, args: tuple):
    if op == "take":
        return encode_groups(side.take(*args))
    if op == "publish":
        from safetensors.torch import load

        version, blob, step, wait = args
        return side.publish(version, load(blob), step, wait=wait)
    if op == "start":
        side.start()
        logging.getLogger(__name__).info("rollout side started in process %d (parent %d)", os.getpid(), os.getppid())
        return None
    if op in ("adapter_name", "adapter_path"):
        return getattr(side, op)
    assert op in ("start", "wait_published", "stats", "log", "close"), op
    return getattr(side, op)(*args)


def _close_quietly(side: RolloutSide, keep_final: bool) -> None:
    try:
        side.close(keep_final=keep_final)
    except Exception as exc:  # noqa: BLE001 - the process is ending; say what could not be done
        logging.getLogger(__name__).error("closing the rollout side failed: %s", exc)
