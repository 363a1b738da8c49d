"""The rollout process's main loop: build a RolloutSide and answer the trainer's requests on one connection.

Both forms of a separate rollout process run it: the child rank 0 spawns (`serve`, over a pipe) and
`asyncgrpo rollout-serve` (`serve_one_run`, over TLS on TCP). Every member of the rollout interface is answered the
same way (`_handle`), a trainer that goes away is noticed even mid-request, and SIGTERM/SIGINT resume any paused
server first. How the two ends talk and fail: docs/rollout-internals.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import threading
import traceback

from asyncgrpo.config import split_address
from asyncgrpo.data import local_model_dir
from asyncgrpo.errors import ConfigError, RolloutProcessError
from asyncgrpo.transport.interface import interface_members
from asyncgrpo.transport.link import rollout_key
from asyncgrpo.transport.remote import accept_trainer, socket_of
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.transport.wire import encode_groups, pack_exception
from asyncgrpo.shutdown import HANDLED, exit_on_signal

log = logging.getLogger(__name__)

CHILD_STOP_MARGIN_S = 10.0  # beyond the trainer's stop_grace_s: its checkpoint save and its close of this process


# ---- the two mains --------------------------------------------------------------------------------------------
def serve(conn, cfg, side_kwargs: dict, run_id: str) -> bool:
    """The spawned child's main: build the side, answer requests until `close` or the trainer's end of the pipe
    closes; on SIGTERM/SIGINT/SIGHUP resume any paused server (shutdown.py), close the side and exit 143/130."""
    log_as_rollout()
    # A signal after the first (the trainer's halt after a Ctrl-C the child saw too) must not kill the close in
    # progress: exit_on_signal restores these, and the trainer kills a child that does not exit in time.
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)
    # A SIGTERM sent to every process of the job (scancel) reaches us too: while the trainer goes on to a step it can
    # checkpoint (stop_grace_s), keep serving it; it closes us after, and past this grace we exit as for any signal.
    grace_s = cfg.stop_grace_s + CHILD_STOP_MARGIN_S if cfg.save_steps and cfg.stop_grace_s else 0.0
    return serve_side(conn, build_side(cfg, side_kwargs, run_id), grace_s=grace_s)


def serve_one_run(listen: str, paths: dict) -> int:  # pragma: no mutate block
    """`asyncgrpo rollout-serve`: listen at `listen` (port 0: a free one, logged), serve the first trainer that
    proves the key (ASYNCGRPO_ROLLOUT_KEY, required), then exit: 0 after its `close`, 1 if it went away without.
    `paths`: config keys (and `model_path`) this host resolves itself instead of taking the trainer's."""
    try:
        host, port = split_address(listen, any_port=True)
    except ValueError as exc:
        raise ConfigError("--listen", f"{listen!r} {exc}", "write e.g. `--listen 10.0.0.7:7480`, or "
                          "`--listen 127.0.0.1:0` for a free port on loopback") from None
    key = rollout_key("--listen")
    log_as_rollout()
    with socket.create_server((host, port)) as listener:  # IPv4 (split_address refuses IPv6)
        bound_host, bound_port = listener.getsockname()
        reach = socket.gethostname() if bound_host == "0.0.0.0" else bound_host  # all interfaces: name one
        with exit_on_signal(lambda: None):  # SIGTERM/Ctrl-C/SIGHUP while waiting: nothing to clean up, exit 143/130/129
            log.info("rollout server listening on %s:%d (set `rollout_address: %s:%d` in the trainer's config)",
                     bound_host, bound_port, reach, bound_port)
            conn, (cfg, side_kwargs, run_id) = accept_trainer(listener, key)
    # Closed: one run per server; a second trainer is refused rather than queued.
    for name, value in paths.items():
        if name == "model_path":
            side_kwargs["model_path"] = value
        else:
            setattr(cfg, name, value)
    try:
        side = build_side(cfg, side_kwargs, run_id)
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        log.error("could not set up the rollout side: %s", exc)
        conn.send(("error", pack_exception(exc, traceback.format_exc())))
        conn.close()
        return 1
    conn.send(("ok", f"host {socket.gethostname()}, pid {os.getpid()}"))
    return 0 if serve_side(conn, side) else 1


def log_as_rollout() -> None:
    """This process's log lines carry the prefix `[rollout]`."""
    logging.basicConfig(level=logging.INFO, format="[rollout] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)


def build_side(cfg, side_kwargs: dict, run_id: str) -> RolloutSide:
    """The side the trainer's arguments describe, with the tokenizer loaded here from the local model directory."""
    from transformers import AutoTokenizer  # heavy: transformers (and torch), only once a trainer has connected

    side = RolloutSide(cfg, tokenizer=AutoTokenizer.from_pretrained(local_model_dir(side_kwargs["model_path"])),
                       **side_kwargs)
    side.run_id = run_id  # the trainer's, named in its checkpoints
    return side


# ---- the loop -------------------------------------------------------------------------------------------------
def serve_side(conn, side: RolloutSide, grace_s: float = 0.0) -> bool:
    """Answer the trainer's requests on `conn` until `close` (returns True) or the trainer's end closes (False: every
    version unloaded); on SIGTERM/SIGINT/SIGHUP resume any paused server (shutdown.py), close the side and exit
    143/130/129. `grace_s` > 0: the first SIGTERM is only acted on that much later (the trainer's checkpoint)."""
    keep_final = None  # set by `close`; None: the trainer went away or a signal came, unload every version
    with exit_on_signal(side.halt, defer=lambda: None, grace_s=grace_s):
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
            log.warning("the trainer closed the connection: closing the rollout side")
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
            log.warning("the trainer went away during a request: resuming any paused server")
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
    with socket_of(fd) as sock:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


# ---- one request ----------------------------------------------------------------------------------------------
def _take(side: RolloutSide, n: int, version: int, timeout_s: float) -> bytes:
    return encode_groups(side.take(n, version, timeout_s))  # one binary blob (wire.py), not pickled groups


def _publish(side: RolloutSide, version: int, blob: bytes, step: int, wait: bool, probe=None) -> float:
    from safetensors.torch import load  # heavy: safetensors, needed only once a version is published

    return side.publish(version, load(blob), step, wait=wait, probe=probe)


def _tensorboard_dir(side: RolloutSide):
    return side.tensorboard_dir.resolve()  # resolved here: a relative output_dir is this process's


def _start(side: RolloutSide) -> None:
    side.start()
    log.info("rollout side started in process %d (parent %d)", os.getpid(), os.getppid())  # where it runs


# The members whose call or value does not cross the connection as is; every other member is answered generically.
TRANSLATED = {"take": _take, "publish": _publish, "tensorboard_dir": _tensorboard_dir, "start": _start}
MEMBERS = interface_members()  # {name: "method" | "property" | "attribute"} of RolloutInterface


def _handle(side, op: str, args: tuple):
    """Answer one request: a member of the rollout interface (a method is called with `args`, a property or an
    attribute read), through TRANSLATED where its arguments or value need converting. Anything else is refused."""
    if op in TRANSLATED:
        return TRANSLATED[op](side, *args)
    kind = MEMBERS.get(op)
    if kind is None:
        raise RolloutProcessError(f"the trainer asked the rollout side for `{op}`, which is not part of the rollout "
                                  f"interface (transport/interface.py). Fix: run the same asyncgrpo version on both ends")
    return getattr(side, op)(*args) if kind == "method" else getattr(side, op)


def _close_quietly(side: RolloutSide, keep_final: bool) -> None:
    try:
        side.close(keep_final=keep_final)
    except Exception as exc:  # noqa: BLE001 - the process is ending; say what could not be done
        log.error("closing the rollout side failed: %s", exc)
