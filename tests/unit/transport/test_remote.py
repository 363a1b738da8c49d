"""The rollout side on another host (transport/remote.py): the address in the config, the key on both ends, and what
rank 0 reports when the rollout server is not there, answers with another key, says nothing, or dies. The rollout
server here is a tiny in-test listener running the module's own accept (`accept_trainer`) in a thread, which then
plays the rollout side's part by hand: a real rollout side needs a vLLM server (tests/integration/
test_rollout_process.py runs the real one). Attacks on the link (keys, injection, slow clients):
tests/security/test_rollout_link.py."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
import traceback
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest
from fakes import cfg
from liveness import returns_within

from asyncgrpo import __version__
from asyncgrpo.cli import main
from asyncgrpo.config import ROLLOUT_KEY_ENV
from asyncgrpo.errors import ConfigError, RolloutProcessError
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.transport import link, remote
from asyncgrpo.transport.factory import open_rollout_side
from asyncgrpo.transport.process import ChildPeer, RolloutProcess
from asyncgrpo.transport.remote import RemotePeer, accept_trainer
from asyncgrpo.transport.rollout_server import _answer_requests
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.transport.wire import pack_exception, rebuild_exception

KEY = b"5d0c8a3f1e9b7d2c4a6e8f0b1d3c5a7e"  # 32 hex characters: the shortest key accepted


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(ROLLOUT_KEY_ENV, KEY.decode())


def _cfg(tmp_path, **values):
    return cfg(lora_adapter_path=str(tmp_path), sync_mode="versioned", vllm_request_timeout=1.0, **values)


def _proxy(tmp_path, address: str) -> RolloutProcess:
    return RolloutProcess(_cfg(tmp_path), model_path="m", peft_config=None, groups_per_step=1,
                          peer=RemotePeer(address))


class InTestServer:  # not in fakes.py: the rollout link's listener (the real accept_trainer), no vLLM stand-in
    """A listener on a free loopback port whose thread runs `accept_trainer`, then `then(conn, hello)`."""

    def __init__(self, then, key: bytes = KEY, port: int = 0, listening=None):
        self.listener = socket.create_server(("127.0.0.1", port))
        self.address = "%s:%d" % self.listener.getsockname()
        self.hello = self.error = None
        self.conn = None
        accepting = listening(self.listener) if listening is not None else self.listener  # what accept_trainer gets

        def run():
            try:
                self.conn, self.hello = accept_trainer(accepting, key)
                then(self.conn, self.hello)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        returns_within(self.thread.join, 20, "the in-test rollout server")
        self.listener.close()


def _a_trainer_connects_and_is_accepted(tmp_path, server: InTestServer) -> None:
    """A real trainer's proxy connects to `server`, which accepts it (the hello carries its run id); then it stops."""
    right = _proxy(tmp_path, server.address)
    right.peer.connect(right.cfg, right._side_kwargs, right.run_id)
    server.join()
    assert server.error is None and server.hello[2] == right.run_id
    right.peer.stop(0)


def _ack_then(after):
    def then(conn, hello):
        conn.send(("ok", "in-test server"))
        after(conn)

    return then


# ---- the config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("address, problem", [
    ("rollout-host", "is not of the form HOST:PORT"),
    (":7480", "is not of the form HOST:PORT"),
    ("rollout-host:0", "has port '0', not a number from 1 to 65535"),
    ("rollout-host:http", "has port 'http'"),
    ("[::1]:7480", "is an IPv6 address"),
])
def test_a_malformed_rollout_address_is_refused_naming_the_value_and_the_form(tmp_path, address, problem):
    with pytest.raises(ConfigError) as failure:
        _cfg(tmp_path, rollout_address=address)
    assert f"config `rollout_address`: {address!r} {problem}" in str(failure.value)
    assert "Fix: write HOST:PORT" in str(failure.value)


def test_rollout_address_with_rollout_process_is_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"'h:7480' is set together with `rollout_process: true`.*Fix: drop"):
        _cfg(tmp_path, rollout_address="h:7480", rollout_process=True)


def test_rank_0_connects_to_the_rollout_address_instead_of_spawning(tmp_path):
    kwargs = dict(model_path="m", peft_config=None, groups_per_step=1)
    remote_cfg, child_cfg, local_cfg = _cfg(tmp_path, rollout_address="rollout-host:7480"), \
        _cfg(tmp_path, rollout_process=True), _cfg(tmp_path)
    remote_side = open_rollout_side(remote_cfg, **kwargs)
    assert isinstance(remote_side.peer, RemotePeer) and remote_side.peer.address == "rollout-host:7480"
    child_side = open_rollout_side(child_cfg, **kwargs)
    assert isinstance(child_side.peer, ChildPeer)
    local_side = open_rollout_side(local_cfg, tokenizer="the tokenizer", **kwargs)  # the default: in this process
    assert type(local_side) is RolloutSide and local_side.tokenizer == "the tokenizer" and local_side.model_path == "m"
    # Each gets the run's config and arguments: the other host's side is built from what the proxy sends.
    assert (remote_side.cfg, child_side.cfg, local_side.cfg) == (remote_cfg, child_cfg, local_cfg)
    assert remote_side._side_kwargs["model_path"] == child_side._side_kwargs["model_path"] == "m"
    assert not remote_side.peer.started() and not remote_side.peer.alive()  # nothing dialled before start()


# ---- the key -------------------------------------------------------------------------------------------------
def test_listening_without_the_key_is_refused_even_on_loopback_naming_the_variable(monkeypatch, capsys):
    monkeypatch.delenv(ROLLOUT_KEY_ENV)
    assert main(["rollout-serve", "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert f"config `--listen`: {ROLLOUT_KEY_ENV} is not set" in err
    assert f"Fix: export {ROLLOUT_KEY_ENV}=$(asyncgrpo keygen)" in err


def test_rollout_serve_takes_only_its_path_overrides_and_names_them(capsys):
    assert main(["rollout-serve", "--listen", "127.0.0.1:0", "--max_steps", "3"]) == 2  # refused before listening
    err = capsys.readouterr().err
    assert "config `rollout-serve`: unknown arguments --max_steps 3" in err
    assert "--model_path / --dataset_name / --data_files / --lora_adapter_path / --output_dir" in err


def test_a_trainer_without_the_key_does_not_dial_even_a_loopback_address(tmp_path, monkeypatch):
    monkeypatch.delenv(ROLLOUT_KEY_ENV)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        proxy = _proxy(tmp_path, "127.0.0.1:%d" % listener.getsockname()[1])
        with pytest.raises(ConfigError, match=f"{ROLLOUT_KEY_ENV} is not set") as refused:
            proxy.start()
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected: refused before the dial
    assert refused.value.field == "rollout_address"  # the trainer's setting, not rollout-serve's --listen


def test_a_trainer_with_another_key_is_refused_clearly_and_the_server_keeps_listening(tmp_path, monkeypatch, caplog):
    server = InTestServer(_ack_then(lambda conn: conn.close()))
    monkeypatch.setenv(ROLLOUT_KEY_ENV, KEY.decode()[::-1])  # as long, another secret
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        with pytest.raises(RolloutProcessError) as failure:
            returns_within(_proxy(tmp_path, server.address).start, 20, "a start with the wrong key")
        assert f"the rollout server at {server.address} and this trainer have different connection keys" in str(
            failure.value)
        assert f"Fix: set {ROLLOUT_KEY_ENV} to the same secret on both hosts" in str(failure.value)
        # Refused and logged on the server's side; it is still listening, and a trainer with the key gets through.
        monkeypatch.setenv(ROLLOUT_KEY_ENV, KEY.decode())
        right = _proxy(tmp_path, server.address)
        right.peer.connect(right.cfg, right._side_kwargs, right.run_id)
        server.join()
    assert server.error is None and server.hello[2] == right.run_id  # the hello carries the spawn's arguments
    assert server.hello[1]["model_path"] == "m" and server.hello[0].sync_mode == "versioned"
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1 and f"{ROLLOUT_KEY_ENV} must be the same on both hosts" in refusals[0], refusals
    right.peer.stop(0)


# ---- the peer is not there, says nothing, or dies --------------------------------------------------------------
def test_nothing_listening_is_reported_with_the_command_to_start_after_a_bounded_retry(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_RETRY_S", 0.5)
    address = f"127.0.0.1:{find_free_port()}"
    with pytest.raises(RolloutProcessError) as failure:
        returns_within(_proxy(tmp_path, address).start, 20, "a start with nothing listening")
    assert f"nothing listens at {address}" in str(failure.value)
    assert f"Fix: start `asyncgrpo rollout-serve --listen {address}` on that host first" in str(failure.value)


def test_a_trainer_started_a_moment_before_its_server_still_connects(tmp_path):
    port = find_free_port()
    proxy = _proxy(tmp_path, f"127.0.0.1:{port}")
    connecting = threading.Thread(target=proxy.peer.connect, args=(proxy.cfg, proxy._side_kwargs, proxy.run_id),
                                  daemon=True)
    connecting.start()  # refused at first: it retries for CONNECT_RETRY_S
    server = InTestServer(_ack_then(lambda conn: None), port=port)
    returns_within(connecting.join, 20, "a connect retried until the server listens")
    server.join()
    assert server.error is None and proxy.peer.started() and server.hello[2] == proxy.run_id
    proxy.peer.stop(0)


def test_a_port_that_never_answers_the_handshake_is_given_up_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 0.5)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) and never says a word, like vLLM's port
    address = "127.0.0.1:%d" % silent.getsockname()[1]
    try:
        with pytest.raises(RolloutProcessError) as failure:
            returns_within(_proxy(tmp_path, address).start, 20, "a start against a silent port")
    finally:
        silent.close()
    assert f"the rollout server at {address} accepted the connection but did not complete the handshake" in str(
        failure.value)
    assert "not, say, vLLM's port" in str(failure.value)


def test_a_rollout_server_that_dies_makes_the_waiting_call_raise_naming_its_address(tmp_path):
    def die_on_first_request(conn):
        conn.recv()  # `start`
        conn.close()  # as the kernel does for a killed process

    server = InTestServer(_ack_then(die_on_first_request))
    proxy = _proxy(tmp_path, server.address)
    with pytest.raises(RolloutProcessError) as failure:
        returns_within(proxy.start, 20, "a call to a rollout server that died")
    server.join()
    message = str(failure.value)
    assert f"the rollout server at {server.address} closed the connection" in message
    assert "while the trainer waited for `start`" in message
    assert f"Fix: its log on that host (prefix [rollout])" in message and "rollout_process" not in message
    assert "pid" not in message and "out-of-memory" not in message  # no child of ours to speak of
    with pytest.raises(RolloutProcessError, match="closed the connection"):
        proxy.stats()  # and every later call, without touching the connection again
    returns_within(lambda: proxy.close(keep_final=False), 20, "close after the server died")


def test_halt_shuts_the_connection_so_that_the_rollout_server_reads_eof(tmp_path):
    seen = {}

    def serve_until_eof(conn):
        conn.recv()
        conn.send(("ok", None))  # `start` done
        try:
            seen["after"] = conn.recv()
        except EOFError:
            seen["after"] = "EOF"

    server = InTestServer(_ack_then(serve_until_eof))
    proxy = _proxy(tmp_path, server.address)
    proxy.start()
    proxy.halt()  # what the trainer's SIGTERM handler calls: there is no pid to signal
    server.join()
    assert server.error is None and seen["after"] == "EOF"
    returns_within(lambda: proxy.close(keep_final=True), 20, "close after halt")  # sends nothing: it was halted


def test_both_ends_turn_on_tcp_keepalive_so_that_a_vanished_host_is_seen_within_20_s(tmp_path):
    server = InTestServer(_ack_then(lambda conn: None))
    proxy = _proxy(tmp_path, server.address)
    proxy.peer.connect(proxy.cfg, proxy._side_kwargs, proxy.run_id)
    server.join()
    assert remote.DEAD_PEER_S == 20
    for conn in (proxy.peer.conn, server.conn):
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)  # handshake bound lifted
    server.conn.close()
    proxy.peer.stop(0)


def _tls_pair() -> tuple[link.Link, link.Link]:
    """Two Links over a socketpair with TLS between them (the trainer's end first)."""
    theirs, ours = socket.socketpair()
    context, _ = link.server_tls()
    server = context.wrap_socket(theirs, server_side=True, do_handshake_on_connect=False)
    client = link.client_tls().wrap_socket(ours, do_handshake_on_connect=False)
    shaking = threading.Thread(target=server.do_handshake, daemon=True)
    shaking.start()
    client.do_handshake()
    shaking.join(5)
    return link.Link(client), link.Link(server)


def test_a_link_carries_values_both_ways_and_polls_bytes_tls_already_decrypted():
    trainer_end, side_end = _tls_pair()
    big = os.urandom(200_000)  # framed past one TLS record (16 KiB)
    trainer_end.send(("publish", (3, big)))
    assert side_end.poll(5) and side_end.recv() == ("publish", (3, big))
    # Two messages in one TLS record: after the first is read, the second is decrypted and held by TLS, while the
    # descriptor shows nothing more: poll must still see it.
    frames = b"".join(len(p).to_bytes(8, "big") + p for p in (pickle.dumps("first"), pickle.dumps("second")))
    side_end._sock.sendall(frames)
    assert trainer_end.recv() == "first"
    assert trainer_end.poll(0) and trainer_end.recv() == "second"
    assert not trainer_end.poll(0)
    side_end.close()
    assert trainer_end.poll(5)  # EOF reads as ready, as on a Connection
    with pytest.raises(EOFError):
        trainer_end.recv()
    trainer_end.close()
    assert trainer_end.closed
    with pytest.raises(OSError):
        trainer_end.fileno()


@pytest.mark.parametrize("transport", ["pipe", "tls"])
def test_a_trainer_that_goes_away_mid_request_halts_the_side_at_once_not_after_the_request(transport):
    """The serve loop both forms share: a request may wait for a sync that holds a server paused (as publish waits
    for the previous version); the trainer's end closing must resume that server now, not when the request ends.
    Over TLS the watcher looks beneath it, at the socket."""
    class Side:
        halted = threading.Event()

        def halt(self):
            self.halted.set()

        def wait_published(self):
            assert self.halted.wait(120), "never halted"  # held until halt, like a sync held paused

    trainer_end, side_end = Pipe() if transport == "pipe" else _tls_pair()
    side, ended = Side(), []
    serving = threading.Thread(target=lambda: ended.append(_answer_requests(side_end, side)), daemon=True)
    serving.start()
    trainer_end.send(("wait_published", ()))
    trainer_end.close()  # the trainer is gone while the request waits
    returns_within(lambda: serving.join(60), 30, "the serve loop after the trainer went away mid-request")
    assert side.halted.is_set() and ended == [None]  # halted, then EOF read: not a `close`


# ---- the handshake's failures, end by end --------------------------------------------------------------------------
def _prove_by_hand(address: str, key: bytes = KEY) -> link.Link:
    """A client that does TLS and the key proof as the trainer does, then leaves the rest to the test."""
    host, port = address.rsplit(":", 1)
    tls = link.client_tls().wrap_socket(socket.create_connection((host, int(port)), timeout=20),
                                        do_handshake_on_connect=False)
    deadline = time.monotonic() + 20
    link.tls_handshake(tls, deadline)
    link.prove_client(tls, key, deadline)
    tls.settimeout(20)
    return link.Link(tls)


def _who(end: link.Link) -> str:
    return "%s:%d" % end._sock.getsockname()


def test_a_trainer_of_another_asyncgrpo_version_is_told_both_versions_and_the_server_keeps_listening(tmp_path,
                                                                                                      caplog):
    server = InTestServer(_ack_then(lambda conn: None))
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        older = _prove_by_hand(server.address)
        older.send(("hello", "0.0.1", pickle.dumps((None, {}, "older"))))
        status, payload = older.recv()
        refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert status == "error"
    exc = rebuild_exception(payload)  # what the trainer raises
    assert type(exc) is RolloutProcessError
    assert str(exc) == (f"the rollout server runs asyncgrpo {__version__}, the trainer 0.0.1. Fix: install the same "
                        f"asyncgrpo version on both hosts")
    assert "raise RolloutProcessError" in payload["traceback"]  # the server's traceback comes with it
    assert len(refusals) == 1 and refusals[0].startswith(f"refused a connection from {_who(older)}: "), refusals
    older.close()
    _a_trainer_connects_and_is_accepted(tmp_path, server)


def test_a_client_that_proves_the_key_but_sends_no_hello_is_dropped_at_the_deadline(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 2.0)  # TLS and the proof take milliseconds; a loaded host, more
    server = InTestServer(_ack_then(lambda conn: None))
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        silent = _prove_by_hand(server.address)
        with pytest.raises(EOFError):
            returns_within(silent.recv, 20, "the server's drop of a client that sends no hello")
        drops = [r.getMessage() for r in caplog.records if "no rollout handshake within" in r.getMessage()]
    assert len(drops) == 1 and drops[0].startswith(f"dropped a connection from {_who(silent)}: ") and \
        "(TimeoutError: " in drops[0], drops
    silent.close()
    _a_trainer_connects_and_is_accepted(tmp_path, server)


def test_a_server_that_never_answers_the_hello_is_given_up_after_build_s(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "BUILD_S", 0.3)
    server = InTestServer(lambda conn, hello: None)  # takes the hello, then says nothing (a build that hangs)
    proxy = _proxy(tmp_path, server.address)
    with pytest.raises(RolloutProcessError) as failure:
        returns_within(proxy.start, 20, "a start whose hello is never answered")
    server.join()
    assert f"the rollout server at {server.address} accepted the connection but did not complete the handshake " \
           f"(TimeoutError: " in str(failure.value)
    server.conn.close()


def test_a_side_that_fails_to_build_on_the_rollout_host_raises_its_own_error_on_the_trainer(tmp_path):
    def fail_to_build(conn, hello):
        try:
            raise ConfigError("dataset_name", "no dataset 'nope' on the rollout host", "name one that exists there")
        except ConfigError as exc:  # what rollout-serve answers when the side cannot be built
            conn.send(("error", pack_exception(exc, traceback.format_exc())))

    server = InTestServer(fail_to_build)
    proxy = _proxy(tmp_path, server.address)
    with pytest.raises(ConfigError) as failure:
        returns_within(proxy.start, 20, "a start whose side fails to build")
    server.join()
    assert failure.value.field == "dataset_name" and "no dataset 'nope' on the rollout host" in str(failure.value)
    assert "raised in the rollout process" in failure.value.__notes__[0]
    assert proxy.peer.started() and not proxy.peer.alive()  # closed on our side: nothing more goes to it
    server.conn.close()


def test_a_connect_that_is_never_answered_is_given_up_after_connect_s(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_S", 0.3)
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # a queue of one connection, never accepted
        address = "127.0.0.1:%d" % full.getsockname()[1]
        with socket.create_connection(full.getsockname()):  # fills it: the kernel now drops connects, like a
            with pytest.raises(RolloutProcessError) as failure:  # firewall that drops rather than refuses
                returns_within(_proxy(tmp_path, address).start, 20, "a start whose connect is never answered")
    assert str(failure.value) == (f"cannot connect to {address} (rollout_address): timed out. Fix: check the host "
                                  f"name and that the network lets this host reach that port")


def test_a_connect_refused_at_first_is_retried_and_reaches_the_server_started_meanwhile(tmp_path, monkeypatch):
    """test_a_trainer_started_a_moment_before_its_server_still_connects, made deterministic: the server starts in the
    trainer's pause after its first refused attempt, so exactly one attempt was refused."""
    port = find_free_port()
    servers = []

    def sleep(seconds):  # the dial's pause between two attempts
        if not servers:
            servers.append(InTestServer(_ack_then(lambda conn: None), port=port))
        time.sleep(seconds)

    monkeypatch.setattr(remote, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    proxy = _proxy(tmp_path, f"127.0.0.1:{port}")
    returns_within(lambda: proxy.peer.connect(proxy.cfg, proxy._side_kwargs, proxy.run_id), 20,
                   "a connect retried until the server listens")
    assert len(servers) == 1  # refused once, then connected
    servers[0].join()
    assert servers[0].error is None and servers[0].hello[2] == proxy.run_id
    proxy.peer.stop(0)


class AbortingOnce:
    """A listening socket whose first accept fails as one does when the client resets its connection between the
    select and the accept (ECONNABORTED): the kernel cannot be made to do that on demand."""

    def __init__(self, listener: socket.socket):
        self.listener, self.aborted = listener, 0

    def fileno(self) -> int:
        return self.listener.fileno()

    def accept(self):
        if not self.aborted:
            self.aborted += 1
            raise ConnectionAbortedError(103, "Software caused connection abort")
        return self.listener.accept()


def test_a_connection_aborted_before_its_accept_is_skipped_and_listening_goes_on(tmp_path):
    aborting = {}
    server = InTestServer(_ack_then(lambda conn: None),
                          listening=lambda sock: aborting.setdefault("listener", AbortingOnce(sock)))
    proxy = _proxy(tmp_path, server.address)
    returns_within(lambda: proxy.peer.connect(proxy.cfg, proxy._side_kwargs, proxy.run_id), 20,
                   "a connect after an aborted accept")
    server.join()
    assert aborting["listener"].aborted == 1 and server.error is None and server.hello[2] == proxy.run_id
    proxy.peer.stop(0)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_first_message_that_is_no_tuple_drops_that_client_and_a_later_trainer_wins(tmp_path, caplog):
    """A key holder whose first message is no hello tuple (an int): dropped and logged like any other wrong first
    message (not an error escaping the handshake's thread), and it never counts as the trainer."""
    server = InTestServer(_ack_then(lambda conn: None))
    odd = _prove_by_hand(server.address)
    odd.send(5)
    deadline = time.monotonic() + 20
    while not odd.poll(0.05):  # EOF, once the server dropped it
        assert server.thread.is_alive(), f"accept_trainer ended with that client: {server.error!r}"
        assert time.monotonic() < deadline, "the client whose first message was an int was never dropped"
    with pytest.raises(EOFError):
        odd.recv()
    odd.close()
    assert any("its first message was 5, not the hello" in r.getMessage() for r in caplog.records), caplog.text
    _a_trainer_connects_and_is_accepted(tmp_path, server)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the stand-in's RuntimeError
def test_a_handshake_that_fails_unexpectedly_closes_its_connection_and_a_later_trainer_wins(tmp_path, monkeypatch):
    """An error `_handshake` has no handler for (a stand-in raising RuntimeError once: no client message can cause one
    now) leaves nothing behind as a result: that connection is closed and the next trainer is the one accepted."""
    real, raised = remote._handshake, []

    def fails_once(*args):
        if not raised:
            raised.append(1)
            raise RuntimeError("unexpected")
        return real(*args)

    monkeypatch.setattr(remote, "_handshake", fails_once)
    server = InTestServer(_ack_then(lambda conn: None))
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as odd:  # its handshake fails before TLS
        try:
            assert odd.recv(1) == b""  # closed by the server (a timeout here would fail the test)
        except ConnectionResetError:
            pass  # closed with our bytes unread: closed all the same
    assert raised
    _a_trainer_connects_and_is_accepted(tmp_path, server)


def _handshake_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "rollout-handshake"}


def _wait_for(condition, what: str, bound_s: float = 20) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)  # polling a thread's state, not waiting for a server


def test_an_evicted_handshake_ends_cleanly(tmp_path, monkeypatch):
    """With MAX_HANDSHAKES in progress, one more evicts the oldest: its thread, whose read was cut, ends without an
    error (and closes its socket), although the eviction already took it out of the handshakes in progress."""
    monkeypatch.setattr(remote, "MAX_HANDSHAKES", 1)
    failed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failed.append((args.thread.name, args.exc_value)))
    server = InTestServer(_ack_then(lambda conn: None))
    host, port = server.address.rsplit(":", 1)
    before = _handshake_threads()
    oldest = socket.create_connection((host, int(port)), timeout=20)  # connects, then says nothing
    _wait_for(lambda: _handshake_threads() - before, "the first connection's handshake never started")
    (evicted,) = _handshake_threads() - before
    newer = socket.create_connection((host, int(port)), timeout=20)  # one more: the oldest is evicted
    assert oldest.recv(1) == b""  # cut
    returns_within(lambda: evicted.join(20), 25, "the evicted handshake's thread")
    assert not evicted.is_alive() and failed == []
    right = _proxy(tmp_path, server.address)  # evicts the newer one in turn, and wins
    right.peer.connect(right.cfg, right._side_kwargs, right.run_id)
    server.join()
    assert server.error is None and server.hello[2] == right.run_id and failed == []
    oldest.close()
    newer.close()
    right.peer.stop(0)


def test_a_handshake_that_completes_as_another_trainer_wins_is_closed_and_logged(tmp_path, monkeypatch, caplog):
    """Two trainers complete their handshakes at once: the first to be taken wins, the other's connection is closed,
    not kept. The early one's handshake is held just after it completed until the later one has won: the race, made
    to happen every time."""
    real, late = remote._handshake, {}
    completed, other_won = threading.Event(), threading.Event()

    def handshake(tls, who, fingerprint, key, failed):
        result = real(tls, who, fingerprint, key, failed)
        if not late:
            late.update(result=result, thread=threading.current_thread())
            completed.set()
            assert other_won.wait(20), "the other trainer never won"
        return result

    monkeypatch.setattr(remote, "_handshake", handshake)
    server = InTestServer(_ack_then(lambda conn: None))
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        early = _prove_by_hand(server.address)
        early.send(("hello", __version__, pickle.dumps((None, {}, "early"))))
        assert completed.wait(20), "the early trainer's handshake never completed"
        right = _proxy(tmp_path, server.address)
        right.peer.connect(right.cfg, right._side_kwargs, right.run_id)
        server.join()
        other_won.set()
        returns_within(lambda: late["thread"].join(20), 25, "the late winner's handshake thread")
        dropped = [r.getMessage() for r in caplog.records if "another trainer connected first" in r.getMessage()]
    assert server.error is None and server.hello[2] == right.run_id  # the later trainer won
    assert late["result"][1][2] == "early" and late["result"][0].closed  # the early one completed, and was closed
    assert dropped == [f"dropped the connection from {_who(early)}: another trainer connected first"]
    early.close()
    right.peer.stop(0)


def test_a_hello_read_gets_only_what_is_left_of_handshake_s_after_a_slow_key_proof(tmp_path, monkeypatch):
    """A proof that took all but 0.5 s of HANDSHAKE_S (the module's clock moved on by that much meanwhile): the read
    of the hello is given those 0.5 s, not more. The timeout handed to the link is the only observable short of
    waiting."""
    skew, timeouts = [0.0], []
    real_prove = remote.prove_server

    def slow_proof(tls, key, fingerprint, deadline):
        real_prove(tls, key, fingerprint, deadline)
        skew[0] += remote.HANDSHAKE_S - 0.5

    class TimedLink(link.Link):
        def settimeout(self, timeout):
            timeouts.append(timeout)
            super().settimeout(timeout)

    monkeypatch.setattr(remote, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + skew[0],
                                                        sleep=time.sleep))
    monkeypatch.setattr(remote, "prove_server", slow_proof)
    monkeypatch.setattr(remote, "Link", TimedLink)
    server = InTestServer(_ack_then(lambda conn: None))
    hello = _prove_by_hand(server.address)
    hello.send(("hello", __version__, pickle.dumps((None, {}, "the hello"))))
    server.join()
    assert server.error is None and server.hello[2] == "the hello"
    assert 0.001 <= timeouts[0] <= 0.5 and timeouts[1:] == [None]  # the rest of the deadline, then blocking
    hello.close()
