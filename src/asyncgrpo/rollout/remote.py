"""The rollout side on another host, rank 0's end and the connection: `RemotePeer` (RolloutProcess's peer over TCP,
for `rollout_address`), the connection key, TCP keepalive, and `accept_trainer` (what `asyncgrpo rollout-serve`
accepts; its main is rollout/serve.py). Both ends authenticate with ASYNCGRPO_ROLLOUT_KEY (on a loopback address
without it: a built-in key); every wait is bounded, and a peer that vanishes is seen within DEAD_PEER_S. The
handshake, the liveness rules and why: docs/rollout-internals.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pickle
import socket
import struct
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from asyncgrpo import __version__
from asyncgrpo.config import ROLLOUT_KEY_ENV, split_address
from asyncgrpo.errors import ConfigError, RolloutProcessError
from asyncgrpo.rollout.wire import pack_exception, rebuild_exception

log = logging.getLogger(__name__)

LOOPBACK_KEY = b"asyncgrpo-rollout-loopback"  # without ROLLOUT_KEY_ENV: loopback only (a key every local user knows)
CONNECT_RETRY_S = 5.0  # rank 0 retries a refused connection this long: a server started a moment after it connects
CONNECT_S = 10.0  # one TCP connect to a host that does not answer at all
HANDSHAKE_S = 10.0  # the key exchange and the hello: a few round trips; a peer that says nothing is not ours
BUILD_S = 300.0  # for the server's answer to the hello: it loads the tokenizer (and imports torch) first
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 5, 3
DEAD_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES  # 20 s: a silent host is given up after this


def rollout_key(host: str, role: str) -> bytes:
    """The connection key: ASYNCGRPO_ROLLOUT_KEY, or on a loopback address the built-in one. `role` names the
    setting for the error ("--listen" or "rollout_address")."""
    key = os.environ.get(ROLLOUT_KEY_ENV)
    if key:
        return key.encode()
    if not _is_loopback(host):
        raise ConfigError(role, f"{host!r} is not a loopback address and {ROLLOUT_KEY_ENV} is not set: the rollout "
                          f"connection carries pickles, so anyone who reaches the port could run code on either end",
                          f"export {ROLLOUT_KEY_ENV}=<a long random secret, e.g. from `openssl rand -hex 32`> on both "
                          f"hosts, or listen on 127.0.0.1 and reach it through an SSH tunnel")
    return LOOPBACK_KEY


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive with short intervals, and a bound on unacknowledged data: a vanished peer errors the connection
    within DEAD_PEER_S (Linux; elsewhere whichever of these options the platform has)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def socket_of(fd: int) -> socket.socket:
    """A socket object over a duplicate of descriptor `fd` (closing it leaves the original open): for its options, a
    peek or a shutdown, on a Connection that multiprocessing reads through the descriptor itself."""
    return socket.socket(fileno=os.dup(fd))


@contextlib.contextmanager
def _reads_within(conn: Connection, seconds: float):
    """Every read on `conn` inside the block fails (BlockingIOError) after `seconds` without data (SO_RCVTIMEO:
    multiprocessing reads the descriptor directly, so a socket timeout would not apply)."""
    with socket_of(conn.fileno()) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        try:
            yield
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))


# ---- rank 0's end ------------------------------------------------------------------------------------------
class RemotePeer:
    """process.RolloutProcess's peer for a rollout side served by `asyncgrpo rollout-serve` at `address`."""

    in_process = "without `rollout_address` (the rollout side on rank 0)"

    def __init__(self, address: str):
        self.address = address
        self.host, self.port = split_address(address)  # validated with the config
        self.conn: Connection | None = None
        self.name = f"the rollout server at {address}"
        self.fix = (f"its log on that host (prefix [rollout]) says what it was doing; check that host and the network "
                    f"to it, start `asyncgrpo rollout-serve --listen {address}` there again and resume from the last "
                    f"checkpoint")

    def connect(self, cfg, side_kwargs: dict, run_id: str) -> None:
        """Connect (retrying a refused connection for CONNECT_RETRY_S), authenticate, send the hello, and wait until
        the server has built the side. Every error names the address and the fix."""
        key = rollout_key(self.host, "rollout_address")
        sock = self._dial()
        keep_alive(sock)
        sock.settimeout(None)  # blocking: the reads are bounded by _reads_within below, and by keepalive after it
        self.conn = Connection(sock.detach())
        try:
            with _reads_within(self.conn, HANDSHAKE_S):
                answer_challenge(self.conn, key)  # the server checks our key first, then we check its
                deliver_challenge(self.conn, key)
            self.conn.send(("hello", __version__, pickle.dumps((cfg, side_kwargs, run_id))))
            with _reads_within(self.conn, BUILD_S):
                status, value = self.conn.recv()
        except AuthenticationError as exc:
            self.conn.close()
            raise RolloutProcessError(f"{self.name} and this trainer have different connection keys ({exc}). Fix: "
                                      f"set {ROLLOUT_KEY_ENV} to the same secret on both hosts (unset on both only "
                                      f"on a loopback address)") from None
        except (OSError, EOFError) as exc:
            self.conn.close()
            raise RolloutProcessError(f"{self.name} accepted the connection but did not complete the handshake "
                                      f"({type(exc).__name__}: {exc}). Fix: check that it is `asyncgrpo rollout-serve` "
                                      f"(not, say, vLLM's port) of the same asyncgrpo version, and its log (prefix "
                                      f"[rollout])") from None
        if status == "error":
            self.conn.close()
            raise rebuild_exception(value)
        log.info("rollout side running at %s (%s)", self.address, value)

    def _dial(self) -> socket.socket:
        deadline = time.monotonic() + CONNECT_RETRY_S
        while True:
            try:
                return socket.create_connection((self.host, self.port), timeout=CONNECT_S)
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise RolloutProcessError(
                        f"nothing listens at {self.address} (rollout_address; connection refused for "
                        f"{CONNECT_RETRY_S:.0f} s). Fix: start `asyncgrpo rollout-serve --listen {self.address}` on "
                        f"that host first (it serves one run, then exits: start it again for each run)") from None
                time.sleep(0.2)
            except OSError as exc:  # no route, a name that does not resolve, a connect that timed out
                raise RolloutProcessError(f"cannot connect to {self.address} (rollout_address): {exc}. Fix: "
                                          f"check the host name and that the network lets this host reach that "
                                          f"port") from None

    def started(self) -> bool:
        return self.conn is not None

    def alive(self) -> bool:
        """Whether the connection is open on our side: the peer's end shows as EOF or an error on it."""
        return self.conn is not None and not self.conn.closed

    def how_it_ended(self, exc: BaseException | None) -> str:
        if isinstance(exc, (TimeoutError, BlockingIOError)):
            return (f"stopped answering at the network level (TCP keepalive gave up after {DEAD_PEER_S} s: the host "
                    f"is down or unreachable)")
        return "closed the connection (it exited or was killed)"

    def halt(self) -> None:
        """Shut the socket down (safe from another thread): the server reads EOF, resumes any server it paused,
        closes the side and exits."""
        try:
            with socket_of(self.conn.fileno()) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def stop(self, bound: float) -> None:
        del bound  # nothing here to join: the server exits by itself on `close` or on EOF
        self.conn.close()


# ---- the rollout host's end (its main, serve_one_run, is in rollout/serve.py) -------------------------------
def accept_trainer(listener: Listener, key: bytes) -> tuple[Connection, tuple]:
    """The first connection that authenticates with `key` and sends a hello of this asyncgrpo version: it and the
    hello's (cfg, side kwargs, run id). Others are logged and dropped, and listening goes on."""
    while True:
        conn = listener.accept()
        who = "%s:%d" % listener.last_accepted
        try:
            with _reads_within(conn, HANDSHAKE_S):
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
                tag, version, hello = conn.recv()
        except AuthenticationError:
            log.error("refused a connection from %s: its key differs from this server's (%s must be the same on both "
                      "hosts); still listening", who, ROLLOUT_KEY_ENV)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            log.error("dropped a connection from %s: no rollout handshake within %.0f s (%s); still listening", who,
                      HANDSHAKE_S, exc)
        else:
            assert tag == "hello", tag
            try:
                if version != __version__:
                    raise RolloutProcessError(f"the rollout server runs asyncgrpo {__version__}, the trainer "
                                              f"{version}. Fix: install the same asyncgrpo version on both hosts")
                args = pickle.loads(hello)  # the config and the LoRA config: asyncgrpo's and peft's classes
            except Exception as exc:  # noqa: BLE001 - told to the trainer, which raises it
                log.error("refused a connection from %s: %s", who, exc)
                conn.send(("error", pack_exception(exc, traceback.format_exc())))
            else:
                keep_alive_conn(conn)
                log.info("trainer connected from %s", who)
                return conn, args
        conn.close()


def keep_alive_conn(conn: Connection) -> None:
    with socket_of(conn.fileno()) as sock:
        keep_alive(sock)
