"""The rollout side on another host, rank 0's end and the connection: `RemotePeer` (RolloutProcess's peer over TCP,
for `rollout_address`), TCP keepalive, and `accept_trainer` (what `asyncgrpo rollout-serve` accepts; its main is
transport/rollout_server.py). The link is TLS, both ends prove ASYNCGRPO_ROLLOUT_KEY inside it (transport/link.py), every
handshake runs on a thread of its own within one overall deadline, and a peer that vanishes is seen within
DEAD_PEER_S. The handshake, the liveness rules and why: docs/rollout-internals.md.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import ssl
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable

from asyncgrpo.version import __version__
from asyncgrpo.config import ROLLOUT_KEY_ENV, split_address
from asyncgrpo.errors import RolloutProcessError
from asyncgrpo.transport.link import (KeyMismatch, Link, client_tls, prove_client, prove_server, refuse, rollout_key,
                                    server_tls, tls_handshake)
from asyncgrpo.transport.throttle import HandshakeThrottle
from asyncgrpo.transport.wire import pack_exception, rebuild_exception

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 5.0  # rank 0 retries a refused connection this long: a server started a moment after it connects
CONNECT_S = 10.0  # one TCP connect to a host that does not answer at all
HANDSHAKE_S = 10.0  # TLS, the key proof and the hello, all of it: a few round trips; a slower peer is not ours
BUILD_S = 300.0  # for the server's answer to the hello: it loads the tokenizer (and imports torch) first
MAX_HANDSHAKES = 16  # handshakes in progress at once on a rollout server; one more evicts the oldest
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 5, 3
DEAD_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES  # 20 s: a silent host is given up after this


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive with short intervals, and a bound on unacknowledged data: a vanished peer errors the connection
    within DEAD_PEER_S (Linux; elsewhere whichever of these options the platform has)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def socket_of(fd: int) -> socket.socket:
    """A socket object over a duplicate of descriptor `fd` (closing it leaves the original open): for a peek or a
    shutdown from another thread, beneath the TLS layer of a Link or a multiprocessing Connection."""
    return socket.socket(fileno=os.dup(fd))


# ---- rank 0's end ------------------------------------------------------------------------------------------
class RemotePeer:
    """process.RolloutProcess's peer for a rollout side served by `asyncgrpo rollout-serve` at `address`."""

    in_process = "without `rollout_address` (the rollout side on rank 0)"

    def __init__(self, address: str):
        self.address = address
        self.host, self.port = split_address(address)  # validated with the config
        self.conn: Link | None = None
        self.name = f"the rollout server at {address}"
        self.fix = (f"its log on that host (prefix [rollout]) says what it was doing; check that host and the network "
                    f"to it, start `asyncgrpo rollout-serve --listen {address}` there again and resume from the last "
                    f"checkpoint")

    def connect(self, cfg, side_kwargs: dict, run_id: str) -> None:
        """Connect (retrying a refused connection for CONNECT_RETRY_S), open TLS, prove the key both ways, send the
        hello, and wait until the server has built the side. Every error names the address and the fix."""
        key = rollout_key("rollout_address")  # before any connect: without a good key nothing is dialled
        sock = self._dial()
        keep_alive(sock)
        tls = client_tls().wrap_socket(sock, do_handshake_on_connect=False)
        try:
            deadline = time.monotonic() + HANDSHAKE_S
            tls_handshake(tls, deadline)
            prove_client(tls, key, deadline)
            self.conn = Link(tls)
            self.conn.settimeout(max(0.001, deadline - time.monotonic()))
            self.conn.send(("hello", __version__, pickle.dumps((cfg, side_kwargs, run_id))))
            self.conn.settimeout(BUILD_S)
            status, value = self.conn.recv()
            self.conn.settimeout(None)  # blocking from here: keepalive bounds a dead peer, the proxy its answers
        except KeyMismatch as exc:
            tls.close()
            raise RolloutProcessError(f"{self.name} and this trainer have different connection keys ({exc}). Fix: "
                                      f"set {ROLLOUT_KEY_ENV} to the same secret on both hosts (the value, not "
                                      f"the command that made it, and no stray character)") from None
        except (OSError, EOFError, ValueError) as exc:  # ssl.SSLError and TimeoutError are OSErrors
            tls.close()
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
        if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return (f"sent data that failed TLS's integrity check ({exc}): something on the network altered the "
                    f"stream, and the connection was dropped")
        return "closed the connection (it exited or was killed)"

    def halt(self) -> None:
        """Shut the socket down beneath TLS (safe from another thread): the server reads EOF, resumes any server it
        paused, closes the side and exits."""
        try:
            with socket_of(self.conn.fileno()) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def stop(self, bound: float) -> None:
        del bound  # nothing here to join: the server exits by itself on `close` or on EOF
        self.conn.close()


# ---- the rollout host's end (its main, serve_one_run, is in transport/rollout_server.py) -------------------------------
def accept_trainer(listener: socket.socket, key: bytes) -> tuple[Link, tuple]:
    """The first connection that opens TLS, proves `key` and sends a hello of this asyncgrpo version, within
    HANDSHAKE_S in all: its Link and the hello's (cfg, side kwargs, run id). Each handshake runs on a thread of its
    own, so a slow or silent client holds nothing but its own thread; at most MAX_HANDSHAKES run at once (one more
    evicts the oldest). The others are logged and dropped, and listening goes on until one wins. An address whose
    handshakes keep failing is logged in summary and closed at accept for a while (throttle.py)."""
    context, fingerprint = server_tls()
    throttle = HandshakeThrottle()
    lock = threading.Lock()
    pending: OrderedDict[ssl.SSLSocket, str] = OrderedDict()  # handshakes in progress, oldest first
    won: list[tuple[Link, tuple]] = []
    done = False  # set once this returns: a handshake that completes later is closed, not kept
    waking_r, waking_w = socket.socketpair()  # a handshake that won wakes the accept loop

    def handshake(tls: ssl.SSLSocket, who: str) -> None:
        result = None
        try:
            result = _handshake(tls, who, fingerprint, key,
                                lambda message, costly: throttle.failed(_ip(who), message, costly=costly))
        finally:
            # Under the lock: a socket is cut (shut down) only while it is still open, never after its descriptor
            # was closed and maybe reused by the next connection.
            with lock:
                pending.pop(tls, None)
                if result is None:
                    tls.close()
                elif done:
                    result[0].close()
                    log.error("dropped the connection from %s: another trainer connected first", who)
                else:
                    won.append(result)
                    waking_w.send(b"x")

    try:
        while True:
            ready, _, _ = select.select([listener, waking_r], [], [])
            with lock:
                if won:
                    return won.pop(0)
            if listener in ready:
                try:
                    sock, (ip, port) = listener.accept()
                except ConnectionError:  # reset or aborted between the select and the accept: not ours to serve
                    continue
                if throttle.blocked(ip):  # its handshakes keep failing: no TLS, no thread, no line of its own
                    sock.close()
                    continue
                who = f"{ip}:{port}"
                tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                with lock:
                    if len(pending) >= MAX_HANDSHAKES:
                        oldest, oldest_who = pending.popitem(last=False)
                        throttle.failed(_ip(oldest_who), f"dropped the connection from {oldest_who}: {MAX_HANDSHAKES} "
                                        f"handshakes were in progress, it was the oldest", costly=False)
                        _cut(oldest)
                    pending[tls] = who
                threading.Thread(target=handshake, args=(tls, who), name="rollout-handshake", daemon=True).start()
    finally:
        with lock:  # one run per server: handshakes still going are dropped, and later winners closed
            done = True
            for tls in pending:
                _cut(tls)
            pending.clear()
            for conn, _ in won:
                conn.close()
        waking_r.close()
        waking_w.close()


def _ip(who: str) -> str:
    return who.rsplit(":", 1)[0]


def _handshake(tls: ssl.SSLSocket, who: str, fingerprint: bytes, key: bytes,
               failed: Callable[[str, bool], None]) -> tuple[Link, tuple] | None:
    """One client's TLS handshake, key proof and hello within HANDSHAKE_S: its Link and the hello's arguments, or
    None if it failed, told to `failed(message, costly)` (costly: it got as far as TLS; throttle.py)."""
    deadline = time.monotonic() + HANDSHAKE_S
    try:
        tls_handshake(tls, deadline)
        prove_server(tls, key, fingerprint, deadline)
        conn = Link(tls)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        first = conn.recv()  # authenticated: only a holder of the key gets a pickle read
        conn.settimeout(None)
    except KeyMismatch:
        failed(f"refused a connection from {who}: it did not prove this server's key ({ROLLOUT_KEY_ENV} must be the "
               f"same on both hosts); still listening", True)
        refuse(tls, deadline)  # after the log: whoever sees the refusal finds it logged
        return None
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:  # TimeoutError, ssl.SSLError: OSErrors
        # Costly unless it only went silent or was cut: a bad TLS record or message took work to find.
        costly = isinstance(exc, (ssl.SSLError, EOFError, ValueError, pickle.UnpicklingError))
        failed(f"dropped a connection from {who}: no rollout handshake within {HANDSHAKE_S:.0f} s "
               f"({type(exc).__name__}: {exc}); still listening", costly)
        return None
    if not (isinstance(first, tuple) and len(first) == 3 and first[0] == "hello"):
        shown = first[0] if isinstance(first, tuple) and first else first
        failed(f"dropped a connection from {who}: its first message was {shown!r:.80}, not the hello", True)
        return None
    _, version, hello = first
    try:
        if version != __version__:
            raise RolloutProcessError(f"the rollout server runs asyncgrpo {__version__}, the trainer {version}. Fix: "
                                      f"install the same asyncgrpo version on both hosts")
        args = pickle.loads(hello)  # the config and the LoRA config: asyncgrpo's and peft's classes
    except Exception as exc:  # noqa: BLE001 - told to the trainer, which raises it
        failed(f"refused a connection from {who}: {exc}", True)
        try:
            conn.send(("error", pack_exception(exc, traceback.format_exc())))
        except OSError:
            pass  # it went away meanwhile: nothing more to tell it
        return None
    keep_alive_conn(conn)
    log.info("trainer connected from %s", who)
    return conn, args


def _cut(tls: ssl.SSLSocket) -> None:
    """End a handshake in progress from another thread: its blocked read returns at once."""
    try:
        with socket_of(tls.fileno()) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # it ended by itself meanwhile


def keep_alive_conn(conn: Link) -> None:
    with socket_of(conn.fileno()) as sock:
        keep_alive(sock)
