"""Attacks on the rollout link (transport/link.py, transport/remote.py): rank 0 <-> `asyncgrpo rollout-serve` over TCP.
Keys that are missing, the old built-in one or too weak are refused at both ends; a peer that proves another key, a
server that cannot prove the key and a man in the middle with its own certificate are refused; bytes injected into
the stream after the handshake are never unpickled and drop the connection; slow or silent clients hold neither the
accept loop nor the real trainer. Everything runs on loopback, with a stub rollout side served by the real loop."""

from __future__ import annotations

import hashlib
import logging
import pickle
import secrets
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest
from liveness import returns_within

from asyncgrpo.cli import main
from asyncgrpo.config import ROLLOUT_KEY_ENV, AsyncGRPOConfig
from asyncgrpo.errors import ConfigError, RolloutProcessError
from asyncgrpo.transport import link, remote, throttle
from asyncgrpo.transport.process import RolloutProcess
from asyncgrpo.transport.remote import RemotePeer, accept_trainer
from asyncgrpo.transport.rollout_server import _answer_requests

KEY = b"9f4c1a7e3b5d8c2f6a0e4b9d7c1f3a5e8b2d6c0f4a9e7b3d"
OLD_BUILT_IN_KEY = "asyncgrpo-rollout-loopback"  # what an unset key meant on loopback before issue #25
BOUND_S = 10.0  # liveness bound of every wait below; each returns in well under a second when the code is right


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(ROLLOUT_KEY_ENV, KEY.decode())


def _proxy(tmp_path, address: str) -> RolloutProcess:
    cfg = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path=str(tmp_path), sync_mode="versioned",
                          vllm_request_timeout=1.0)
    return RolloutProcess(cfg, model_path="m", peft_config=None, groups_per_step=1, peer=RemotePeer(address))


class StubSide:
    """What the serve loop calls on a rollout side: `start`, `stats` and `close` are answered and recorded."""

    def start(self):
        self.calls.append("start")

    def __init__(self):
        self.calls: list[str] = []
        self.hold = threading.Event()  # cleared: `stats` waits until set (a request in progress)
        self.hold.set()

    def stats(self):
        self.calls.append("stats")
        self.hold.wait(BOUND_S)
        return {"queue/depth": 1.0}

    def close(self, keep_final):
        self.calls.append("close")

    def halt(self):
        self.calls.append("halt")


class RolloutServer:  # not in fakes.py: the rollout link's listener (the real accept_trainer), no vLLM stand-in
    """A loopback listener whose thread runs `accept_trainer` with `key`, acknowledges the hello, then serves a
    StubSide with the real request loop; `ended` holds what the loop returned (the trainer's keep_final after its
    `close`, None when the connection dropped)."""

    def __init__(self, key: bytes = KEY):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.side, self.ended, self.error, self.hello = StubSide(), [], None, None
        self.thread = threading.Thread(target=self._run, args=(key,), daemon=True)
        self.thread.start()

    def _run(self, key):
        try:
            conn, self.hello = accept_trainer(self.listener, key)
            conn.send(("ok", "stub rollout server"))
            self.ended.append(_answer_requests(conn, self.side))
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def join(self):
        returns_within(lambda: self.thread.join(BOUND_S), BOUND_S + 1, "the in-test rollout server")
        assert not self.thread.is_alive() and self.error is None, self.error
        self.listener.close()


def _dial_tls(address: str) -> ssl.SSLSocket:
    host, port = address.rsplit(":", 1)
    tls = link.client_tls().wrap_socket(socket.create_connection((host, int(port)), timeout=BOUND_S))
    tls.settimeout(BOUND_S)
    return tls


# ---- the key ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, problem", [
    (None, f"{ROLLOUT_KEY_ENV} is not set"),
    (OLD_BUILT_IN_KEY, f"{ROLLOUT_KEY_ENV} is too weak (it is not a generated key"),
    # 32 characters of 14 different ones, which the old length rule accepted: a passphrase, not a random key
    ("password password password 12345", f"{ROLLOUT_KEY_ENV} is too weak (it is not a generated key"),
    ("0123456789abcdef0123456789abcde", f"{ROLLOUT_KEY_ENV} is too weak (31 hex digits"),  # one short of 32
    ("ab" * 20, f"{ROLLOUT_KEY_ENV} is too weak (only 2 different hex digits"),
], ids=["unset", "old-built-in", "passphrase", "short", "repetitive"])
def test_a_missing_old_or_weak_key_is_refused_at_both_ends_before_any_connection(key, problem, tmp_path,
                                                                                   monkeypatch, capsys):
    if key is None:
        monkeypatch.delenv(ROLLOUT_KEY_ENV)
    else:
        monkeypatch.setenv(ROLLOUT_KEY_ENV, key)
    # The rollout server: refuses to listen, on loopback too, naming the variable and how to make a key.
    assert main(["rollout-serve", "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert f"config `--listen`: {problem}" in err and "there is no built-in key" in err
    assert f"Fix: export {ROLLOUT_KEY_ENV}=$(asyncgrpo keygen)" in err
    # The trainer: refuses before dialling (a listener it would reach sees no connection).
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ConfigError) as refused:
            _proxy(tmp_path, "127.0.0.1:%d" % listener.getsockname()[1]).start()
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert refused.value.field == "rollout_address" and problem in str(refused.value)


def test_a_client_proving_the_old_built_in_key_is_refused_and_the_real_trainer_still_gets_in(tmp_path, caplog):
    server = RolloutServer()
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        with _dial_tls(server.address) as tls:  # speaks the protocol, with the key every old copy knew
            with pytest.raises(link.KeyMismatch, match="the server could not prove it holds this end's key"):
                link.prove_client(tls, OLD_BUILT_IN_KEY.encode(), time.monotonic() + BOUND_S)
        proxy = _proxy(tmp_path, server.address)
        returns_within(proxy.start, BOUND_S, "the real trainer's start after a refused client")
    assert server.side.calls == ["start"] and server.hello[2] == proxy.run_id
    refusals = [r.getMessage() for r in caplog.records if "did not prove this server's key" in r.getMessage()]
    assert len(refusals) == 1
    proxy.close(keep_final=True)
    server.join()
    assert server.ended == [True] and server.side.calls == ["start", "close"]


def test_a_fake_server_gets_nothing_from_the_trainer_to_guess_the_key_from(tmp_path):
    """An impersonator at `rollout_address` (a squatted port, a spoofed name): TLS and the challenge are easy, the
    proof of the key is not. It records every byte the trainer sends until the trainer hangs up: the trainer's nonce
    and zeros, nothing computed from the key, so there is nothing to test guesses against offline (before, the
    trainer proved itself first and a 33-character passphrase fell to an offline guess in microseconds). The
    trainer refuses it, so its config never reaches it."""
    context, fingerprint = link.server_tls()
    listener = socket.create_server(("127.0.0.1", 0))
    seen = {}

    def impersonate():
        sock, _ = listener.accept()
        with context.wrap_socket(sock, server_side=True) as tls:
            tls.settimeout(BOUND_S)
            seen["challenge"] = link.MAGIC + secrets.token_bytes(link.NONCE_BYTES)
            tls.sendall(seen["challenge"])
            received = b""
            while len(received) < link.NONCE_BYTES:
                received += tls.recv(4096)
            tls.sendall(secrets.token_bytes(link.MAC_BYTES))  # a proof of the key it cannot make (today's protocol)
            tls.sendall(b"Y" + secrets.token_bytes(link.MAC_BYTES))  # "accepted" (the protocol before this one)
            while chunk := tls.recv(4096):  # everything until the trainer closes
                received += chunk
            seen["received"] = received

    thread = threading.Thread(target=impersonate, daemon=True)
    thread.start()
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    with pytest.raises(RolloutProcessError) as failure:
        returns_within(_proxy(tmp_path, address).start, BOUND_S, "a start against an impersonator")
    thread.join(BOUND_S)
    listener.close()
    received, nonce_s = seen["received"], seen["challenge"][len(link.MAGIC):]
    nonce_c = received[:link.NONCE_BYTES]
    assert received[link.NONCE_BYTES:] == bytes(link.MAC_BYTES)  # then zeros, and the trainer hung up
    # The attacker's offline test: does any 32 bytes the trainer sent equal an HMAC of the transcript under a guess?
    # Even the right guess (the key itself) finds none.
    proofs = {link._proof(KEY, who, fingerprint, nonce_s, nonce_c) for who in (b"trainer", b"server")}
    assert not any(received[i:i + link.MAC_BYTES] in proofs for i in range(len(received) - link.MAC_BYTES + 1))
    assert "could not prove it holds this end's key" in str(failure.value)
    assert f"Fix: set {ROLLOUT_KEY_ENV} to the same secret on both hosts" in str(failure.value)


def test_a_man_in_the_middle_with_its_own_certificate_is_refused_by_both_ends(tmp_path, caplog):
    """It ends the trainer's TLS with a certificate of its own and opens its own TLS to the server, relaying the
    proofs unchanged: each end's proof covers the certificate it saw, which differ, so neither end accepts."""
    server = RolloutServer()
    context, _ = link.server_tls()
    front = socket.create_server(("127.0.0.1", 0))
    relayed = {}

    def middle():
        sock, _ = front.accept()
        with context.wrap_socket(sock, server_side=True) as trainer, _dial_tls(server.address) as upstream:
            trainer.settimeout(BOUND_S)
            trainer.sendall(link.recv_exactly(upstream, link.CHALLENGE_BYTES))
            upstream.sendall(link.recv_exactly(trainer, link.NONCE_BYTES))
            trainer.sendall(link.recv_exactly(upstream, link.MAC_BYTES))  # the server's proof, over its certificate
            upstream.sendall(link.recv_exactly(trainer, link.MAC_BYTES))  # the trainer's answer: zeros
            relayed["verdict"] = bytes(link.recv_exactly(upstream, link.VERDICT_BYTES))

    thread = threading.Thread(target=middle, daemon=True)
    thread.start()
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        with pytest.raises(RolloutProcessError,
                           match="different connection keys .*the server could not prove it holds this end's key"):
            returns_within(_proxy(tmp_path, "127.0.0.1:%d" % front.getsockname()[1]).start, BOUND_S,
                           "a start through a man in the middle")
        thread.join(BOUND_S)
        assert relayed == {"verdict": b"N"}  # the server refused the relayed proof
        assert any("did not prove this server's key" in r.getMessage() for r in caplog.records)
        proxy = _proxy(tmp_path, server.address)  # the server is still there for the real trainer
        returns_within(proxy.start, BOUND_S, "the real trainer's start")
    front.close()
    proxy.close(keep_final=True)
    server.join()
    assert server.side.calls == ["start", "close"] and server.ended == [True]


# ---- injection after the handshake ----------------------------------------------------------------------------
class CreatesFile:
    """Unpickled, it creates `path`: what an attacker's message would do to an end that unpickles it."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


class Relay:
    """A loopback TCP relay between the trainer and the server, bytes unchanged both ways, that can also write bytes
    of its own into the stream towards the server (`inject`): someone on the network path."""

    def __init__(self, upstream: str):
        self.front = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.front.getsockname()[1]
        host, port = upstream.rsplit(":", 1)
        self.upstream_address = (host, int(port))
        self.server_side: socket.socket | None = None
        self.trainer_side: socket.socket | None = None
        self.server_closed = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        self.trainer_side, _ = self.front.accept()
        self.server_side = socket.create_connection(self.upstream_address)
        threading.Thread(target=self._pump, args=(self.trainer_side, self.server_side, None), daemon=True).start()
        self._pump(self.server_side, self.trainer_side, self.server_closed)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, closed: threading.Event | None):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        if closed is not None:
            closed.set()
        for sock in (sink, source):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, data: bytes, towards: str = "server"):
        (self.server_side if towards == "server" else self.trainer_side).sendall(data)


@pytest.mark.parametrize("wrapping", ["framed-pickle", "tls-record"])
def test_a_message_injected_after_the_handshake_is_never_unpickled_and_drops_the_connection(wrapping, tmp_path):
    marker = tmp_path / "injected-code-ran"
    payload = pickle.dumps(CreatesFile(marker))
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(CreatesFile(control)))
    assert control.exists()  # the payload does what it says once unpickled
    framed = struct.pack("!Q", len(payload)) + payload  # the link's own framing, as a plaintext link would take it
    if wrapping == "tls-record":  # an application-data record header: it reaches TLS's integrity check
        framed = b"\x17\x03\x03" + struct.pack("!H", len(framed)) + framed
    server = RolloutServer()
    relay = Relay(server.address)
    proxy = _proxy(tmp_path, relay.address)
    returns_within(proxy.start, BOUND_S, "a start through the relay")
    assert proxy.stats() == {"queue/depth": 1.0}  # the relay passes the real traffic
    relay.inject(framed)  # while the trainer waits for nothing: the server's loop is reading
    assert returns_within(lambda: relay.server_closed.wait(BOUND_S), BOUND_S + 1, "the server dropping the link")
    server.join()
    assert server.ended == [None]  # the loop ended as for a trainer gone, answering nothing more
    assert server.side.calls == ["start", "stats"]
    assert not marker.exists()
    with pytest.raises(RolloutProcessError, match=f"the rollout server at {relay.address}"):
        returns_within(proxy.stats, BOUND_S, "the next call after the link was dropped")
    proxy.close(keep_final=False)


def test_a_message_injected_towards_the_trainer_fails_its_integrity_check_and_the_call_raises(tmp_path):
    marker = tmp_path / "injected-code-ran"
    payload = pickle.dumps(("ok", CreatesFile(marker)))  # an answer, as the serve loop would frame it
    server = RolloutServer()
    relay = Relay(server.address)
    proxy = _proxy(tmp_path, relay.address)
    returns_within(proxy.start, BOUND_S, "a start through the relay")
    server.side.hold.clear()  # the next `stats` waits: the trainer is reading when the forged answer comes
    calling = threading.Thread(target=lambda: relay.inject(b"\x17\x03\x03" + struct.pack("!H", len(payload) + 8)
                                                           + struct.pack("!Q", len(payload)) + payload, "trainer"))
    with pytest.raises(RolloutProcessError) as failure:
        returns_within(lambda: (calling.start(), proxy.stats()), BOUND_S, "a call answered by a forged record")
    assert f"the rollout server at {relay.address} sent data that failed TLS's integrity check" in str(failure.value)
    assert not marker.exists()
    server.side.hold.set()
    proxy.close(keep_final=False)  # sends nothing more: the connection is broken
    server.join()
    assert server.ended == [None] and server.side.calls[:2] == ["start", "stats"] and "close" not in server.side.calls


# ---- slow and silent clients ----------------------------------------------------------------------------------
class SlowLoris:
    """Connects and trickles the start of a TLS record, one byte per `every` s, until the server closes the
    connection (`closed_after`: seconds from connect) or `stop()`."""

    def __init__(self, address: str, every: float = 0.05):
        host, port = address.rsplit(":", 1)
        self._started = time.monotonic()  # before the connect: the server's deadline starts after it
        self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(every)  # the pace: each read waits this long for the server's close
        self.closed_after: float | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self):
        stream = b"\x16\x03\x01\x02\x00" + bytes(512)  # a handshake record announcing 512 bytes, never complete
        try:
            for i in range(len(stream)):
                if self._stop.is_set():
                    return
                self.sock.sendall(stream[i:i + 1])
                try:
                    if self.sock.recv(1) == b"":
                        break
                except TimeoutError:
                    continue
        except OSError:
            pass  # reset by the server: closed too
        self.closed_after = time.monotonic() - self._started

    def ended(self) -> float:
        returns_within(lambda: self.thread.join(BOUND_S), BOUND_S + 1, "the slow client's end")
        return self.closed_after

    def stop(self):
        self._stop.set()
        self.thread.join(BOUND_S)
        self.sock.close()


def test_a_slow_client_is_dropped_at_the_handshake_deadline_however_it_trickles(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 0.5)
    server = RolloutServer()
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        loris = SlowLoris(server.address)  # a byte every 50 ms: no single read ever waits long
        closed_after = loris.ended()
        assert closed_after is not None and 0.5 <= closed_after < 3.0, closed_after
        drops = [r.getMessage() for r in caplog.records if "no rollout handshake within" in r.getMessage()]
        assert len(drops) == 1 and "TimeoutError" in drops[0], drops
    proxy = _proxy(tmp_path, server.address)
    returns_within(proxy.start, BOUND_S, "the real trainer after the slow client")
    proxy.close(keep_final=False)
    server.join()
    loris.stop()


def test_slow_clients_do_not_keep_the_real_trainer_from_being_served_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 30.0)  # they would hold a serial accept loop for 30 s each
    server = RolloutServer()
    lorises = [SlowLoris(server.address) for _ in range(3)]
    proxy = _proxy(tmp_path, server.address)
    # Within BOUND_S (10 s), a third of the slow clients' deadline: served without waiting for any of them.
    returns_within(proxy.start, BOUND_S, "the real trainer's start beside slow clients")
    assert proxy.stats() == {"queue/depth": 1.0}
    # The run is taken: the slow clients' handshakes are cut at once, not left to their deadline.
    assert all(loris.ended() < 10.0 for loris in lorises)
    proxy.close(keep_final=False)
    server.join()
    for loris in lorises:
        loris.stop()


def test_past_the_handshake_limit_the_oldest_is_evicted_so_a_flood_of_silent_clients_cannot_lock_out(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 30.0)
    monkeypatch.setattr(remote, "MAX_HANDSHAKES", 2)
    server = RolloutServer()
    silent = [socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1]))) for _ in range(3)]
    for sock in silent:
        sock.settimeout(BOUND_S)
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        assert silent[0].recv(1) == b""  # the third evicted the first, the oldest
        proxy = _proxy(tmp_path, server.address)
        returns_within(proxy.start, BOUND_S, "the real trainer's start past the handshake limit")
        assert [sock.recv(1) for sock in silent[1:]] == [b"", b""]  # evicted by the trainer, then cut once it won
    evictions = [r.getMessage() for r in caplog.records if "2 handshakes were in progress" in r.getMessage()]
    assert len(evictions) == 2
    # The log names whom it dropped: the first silent client, by the address it connected from.
    assert evictions[0].startswith("dropped the connection from %s:%d: " % silent[0].getsockname()), evictions
    proxy.close(keep_final=False)
    server.join()
    for sock in silent:
        sock.close()


def test_the_certificate_is_new_for_each_server_and_the_proof_is_bound_to_it():
    (_, first), (_, second) = link.server_tls(), link.server_tls()
    assert first != second and len(first) == hashlib.sha256().digest_size
    nonces = (b"s" * link.NONCE_BYTES, b"c" * link.NONCE_BYTES)
    assert link._proof(KEY, b"trainer", first, *nonces) != link._proof(KEY, b"trainer", second, *nonces)
    assert link._proof(KEY, b"trainer", first, *nonces) != link._proof(KEY, b"server", first, *nonces)


def test_a_flood_of_failing_handshakes_is_limited_in_log_lines_and_tls_work_and_then_let_in_again(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(throttle, "WINDOW_S", 2.0)  # the block ages out quickly, for the real trainer at the end
    tls_handshakes = []
    real_tls_handshake = remote.tls_handshake
    monkeypatch.setattr(remote, "tls_handshake", lambda tls, deadline: (tls_handshakes.append(1),
                                                                        real_tls_handshake(tls, deadline)))
    server = RolloutServer()
    host, port = server.address.rsplit(":", 1)
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.transport.remote"):
        for _ in range(5 * throttle.BLOCK_AFTER):  # not TLS at all: each costs the server a failed TLS handshake
            with socket.create_connection((host, int(port)), timeout=BOUND_S) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                _read_until_closed(sock)  # the server has counted this failure before it closes
        lines = [r.getMessage() for r in caplog.records]
        # The first BLOCK_AFTER cost a TLS handshake each; the rest were closed at accept, before any TLS.
        assert len(tls_handshakes) == throttle.BLOCK_AFTER
        assert len(lines) <= throttle.LOG_BURST + 1, lines
        assert any("more connections from 127.0.0.1 failed or were closed at accept" in line for line in lines)

        proxy = _proxy(tmp_path, server.address)
        deadline = time.monotonic() + BOUND_S  # once the failures age out of the window, the trainer gets in
        while True:
            try:
                proxy.start()
                break
            except RolloutProcessError:
                assert time.monotonic() < deadline, "the real trainer was never let in again"
                proxy = _proxy(tmp_path, server.address)
    proxy.close(keep_final=False)
    server.join()


def _read_until_closed(sock: socket.socket) -> None:
    try:
        while sock.recv(1024):  # a TLS alert, then the end
            pass
    except ConnectionResetError:
        pass
