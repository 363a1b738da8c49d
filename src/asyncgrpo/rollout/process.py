"""The rollout side in a process of its own: rank 0 talks to a whole `RolloutSide` (clients, recovery, store, publisher,
scorer, queue, producer, TensorBoard writer) running in another process through `RolloutProcess`, a proxy with exactly
RolloutSide's interface. That process is either a child rank 0 spawns (`rollout_process: true`; ChildPeer, here) or
an `asyncgrpo rollout-serve` started on its own, e.g. on another host, that rank 0 connects to (`rollout_address`;
RemotePeer, rollout/remote.py). The two differ only in their peer: how the connection is made, how the other end's
death shows, and how it is halted and stopped. The producer's threads, the request pool and the reward functions
then no longer share the training process's GIL, and a reward function that crashes its interpreter takes down the
rollout process, which the trainer reports, instead of the trainer itself.

    side = open_rollout_side(cfg, tokenizer=tok, model_path=path, peft_config=lora, groups_per_step=n)  # the factory

Transport: `multiprocessing.connection` from the standard library: a Pipe (a socketpair) to the child, a TCP socket
to a rollout server. One trainer talks to one rollout process, request then answer, so a message layer such as pyzmq
(sockets, patterns, reconnection, a dependency of its own) would add nothing; a Connection already frames messages,
pickles the small ones, carries raw bytes unchanged, authenticates a TCP peer with an HMAC challenge, and reports the
other end closing (EOF), which is how each side notices the other died. Batches come back as one compact binary blob
(rollout/wire.py: flat token and logprob buffers, no per-token pickling); a version's LoRA tensors go as safetensors
bytes (`safetensors.torch.save`): one copy, exact dtypes and shapes, the format the adapter store writes anyway, and
none of the shared-memory file descriptors that torch's multiprocessing pickler would use for tensors (whose lifetime
would then hang on the parent's references).

The rollout process loads the tokenizer itself from the local model directory and serves one request at a time on
its main thread (`serve_side`); the child is spawned (not forked: rank 0 has threads and torch loaded). Failures:
- an exception there comes back and is raised in the trainer with its own type and message (wire.py);
- a rollout process that dies (killed, segfault) makes the pending or next call raise RolloutProcessError naming it
  (the child's pid and exit code or signal, or the server's address) and the fix; every wait polls the peer's
  liveness (a child's `is_alive`; for a TCP peer EOF, or TCP keepalive's error within 20 s), so none hangs;
- SIGTERM/SIGINT: the trainer's `halt` signals the child (or shuts the socket down), whose handlers (shutdown.py)
  resume any server a sync in progress paused, then close the side and exit; a trainer that vanishes is seen as EOF
  and handled the same way, at once even while a request is being handled (a watcher thread per request);
- `close(keep_final)` asks the rollout process to close, then the peer stops it: a child is joined within a bound,
  then terminated and killed; a rollout server exits by itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import socket
import threading
import time
import traceback
import uuid
from pathlib import Path

from asyncgrpo.errors import RolloutProcessError
from asyncgrpo.contracts import Group
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.rollout.wire import decode_groups, encode_groups, pack_exception, rebuild_exception

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a wait checks that the child is alive: a dead child is reported within about this
TAKE_GRACE_S = 60.0  # beyond take's own timeout (the child raises TimeoutError itself): the answer's transfer
JOIN_S = 10.0  # for the child to exit once it has answered `close`, or after a signal
RESUME_TIMEOUT_S = 10.0  # each /is_paused and /resume call after the child died: answered at once by a live server


class RolloutProcess:
    """RolloutSide's interface, served by another process (module docstring) that `peer` reaches: a child this
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

    @property
    def tensorboard_dir(self) -> Path:
        """Where the rollout process writes TensorBoard (absolute; on a rollout server: a path on its host)."""
        return self._call("tensorboard_dir")

    def stats(self) -> dict[str, float]:
        return self._call("stats")

    def log(self, values: dict[str, float], step: int) -> None:
        self._call("log", values, step)

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
    """The spawned form: a child process of this one, over a Pipe (a socketpair)."""

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
    from asyncgrpo.inference.client import InferenceClient

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
def serve(conn, cfg, side_kwargs: dict, run_id: str) -> bool:
    """The child's main: build the side, answer requests until `close` or the trainer's end of the pipe closes; on
    SIGTERM/SIGINT resume any paused server (shutdown.py), close the side and exit 143/130."""
    log_as_rollout()
    # A signal after the first (the trainer's halt after a Ctrl-C the child saw too) must not kill the close in
    # progress: exit_on_signal restores these, and the trainer kills a child that does not exit in time.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    return serve_side(conn, build_side(cfg, side_kwargs, run_id))


def log_as_rollout() -> None:
    """This process's log lines carry the prefix `[rollout]`."""
    logging.basicConfig(level=logging.INFO, format="[rollout] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)


def build_side(cfg, side_kwargs: dict, run_id: str) -> RolloutSide:
    """The side the trainer's arguments describe, with the tokenizer loaded here from the local model directory."""
    from transformers import AutoTokenizer

    from asyncgrpo.data import local_model_dir

    side = RolloutSide(cfg, tokenizer=AutoTokenizer.from_pretrained(local_model_dir(side_kwargs["model_path"])),
                       **side_kwargs)
    side.run_id = run_id  # the trainer's, named in its checkpoints
    return side


def serve_side(conn, side: RolloutSide) -> bool:
    """Answer the trainer's requests on `conn` until `close` (returns True) or the trainer's end closes (False: every
    version unloaded); on SIGTERM/SIGINT resume any paused server (shutdown.py), close the side and exit 143/130."""
    from asyncgrpo.shutdown import exit_on_signal

    keep_final = None  # set by `close`; None: the trainer went away or a signal came, unload every version
    with exit_on_signal(side.halt):
        try:
            keep_final = _answer_requests(conn, side)
        finally:
            if keep_final is None:
                side.halt()  # whatever ended us, leave no server paused
                _close_quietly(side, keep_final=False)
            conn.close()
    return keep_final is not None


def _answer_requests(conn, side: RolloutSide) -> bool | None:
    """Serve until `close` (returns its keep_final, after closing the side) or EOF (returns None)."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # OSError: a socket reset, or given up on by TCP keepalive (remote.py)
            logging.getLogger(__name__).warning("the trainer closed the connection: closing the rollout side")
            return None
        try:
            with _halt_if_the_trainer_leaves(conn, side):
                value = _handle(side, op, args)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the trainer, typed
            reply = ("error", pack_exception(exc, traceback.format_exc()))
        else:
            reply = ("ok", value)
        try:
            conn.send(reply)
        except OSError:
            return None
        if op == "close":  # done, or failed part-way (the trainer raises it): either way not closed again
            return bool(args[0])


@contextlib.contextmanager
def _halt_if_the_trainer_leaves(conn, side: RolloutSide):
    """While a request is handled the trainer sends nothing (it waits for the answer), so its end turning readable
    means it went away (its halt, or it died): resume any server a sync paused now, not after the request, which may
    be waiting for that very sync. The request then ends as it can, and the next read sees the EOF."""
    fd = conn.fileno()
    stop_read, stop_write = os.pipe()  # written when the request is done: the watcher ends

    def watch():
        ready, _, _ = select.select([fd, stop_read], [], [])
        if fd in ready and stop_read not in ready and _closed(fd):
            logging.getLogger(__name__).warning("the trainer went away during a request: resuming any paused server")
            side.halt()

    watcher = threading.Thread(target=watch, name="trainer-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_write, b"x")
        watcher.join()
        os.close(stop_read)
        os.close(stop_write)


def _closed(fd: int) -> bool:
    """Whether the socket `fd` reads EOF or an error now (peeked: nothing is consumed)."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


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
    if op == "tensorboard_dir":
        return side.tensorboard_dir.resolve()  # resolved here: a relative output_dir is this process's
    assert op in ("start", "wait_published", "stats", "log", "close"), op
    return getattr(side, op)(*args)


def _close_quietly(side: RolloutSide, keep_final: bool) -> None:
    try:
        side.close(keep_final=keep_final)
    except Exception as exc:  # noqa: BLE001 - the process is ending; say what could not be done
        logging.getLogger(__name__).error("closing the rollout side failed: %s", exc)
