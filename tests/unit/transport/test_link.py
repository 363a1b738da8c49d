"""The rollout link's parts one by one (transport/link.py), over a real TLS connection on a socketpair: the key's rules,
the server's certificate, what each end of the key proof reports when the other end is wrong, the handshake's one
deadline however slowly the bytes come, and Link's reads. The whole link between a trainer and a rollout server:
test_remote.py; attacks on it: tests/security/test_rollout_link.py."""

from __future__ import annotations

import datetime
import hashlib
import secrets
import socket
import threading
import time

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from liveness import returns_within

from asyncgrpo.config import ROLLOUT_KEY_ENV
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport import link

KEY = b"3e7a9c1f5b2d8e4a6c0f9b3d7e1a5c8f"
BOUND_S = 5.0  # liveness bound: each call below returns in well under a second, or at its own deadline, when right
DEADLINE_S = 0.5  # the handshake deadline in the tests of slow peers
PACE_S = 0.15  # a slow peer's pause between two bytes: every read gets a byte well within the time left


@pytest.fixture
def tls():
    """(client end, server end, the fingerprint of the server's certificate): TLS done, nothing else sent."""
    theirs, ours = socket.socketpair()
    context, fingerprint = link.server_tls()
    server = context.wrap_socket(theirs, server_side=True, do_handshake_on_connect=False)
    client = link.client_tls().wrap_socket(ours, do_handshake_on_connect=False)
    shaking = threading.Thread(target=server.do_handshake, daemon=True)
    shaking.start()
    client.do_handshake()
    shaking.join(BOUND_S)
    for end in (client, server):
        end.settimeout(BOUND_S)
    yield client, server, fingerprint
    client.close()
    server.close()


def _in_thread(call) -> dict:
    """Run `call` in a daemon thread; the dict gets its "value" or its "error" (read after `["thread"].join`)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    outcome["thread"] = threading.Thread(target=run, daemon=True)
    outcome["thread"].start()
    return outcome


class Trickle:
    """Sends `data` on `sock` one byte every `pace` s from a thread, until all is sent or `stop()`; first it reads
    `after` bytes, if any (what the other end sends before it waits for `data`)."""

    def __init__(self, sock, data: bytes, pace: float = PACE_S, after: int = 0):
        self._stop = threading.Event()

        def run():
            try:
                if after:
                    link.recv_exactly(sock, after)
                for i in range(len(data)):
                    if self._stop.wait(pace):
                        return
                    sock.sendall(data[i:i + 1])
            except (OSError, EOFError):
                pass  # the other end gave up (a loaded machine: maybe before it sent what `after` waits for)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.thread.join(BOUND_S)


# ---- the key ---------------------------------------------------------------------------------------------------
GENERATED = link.generate_key()


@pytest.mark.parametrize("key, problem", [
    (GENERATED, None),  # `asyncgrpo keygen`'s
    ("3e7a9c1f5b2d8e4a6c0f9b3d7e1a5c8f", None),  # 32 hex digits that look random: the shortest accepted
    (GENERATED[:-1] + ("0" if GENERATED[-1] != "0" else "1"), "its checksum does not match"),  # one digit mistyped
    (GENERATED[:40], "its checksum does not match"),  # cut short
    ("password password password 12345", "it is not a generated key"),  # 32 characters, not hex
    ("3e7a9c1f5b2d8e4a6c0f9b3d7e1a5c8", "31 hex digits are 124 bits at most; at least 32 are needed"),
    ("0123456789abcdef0123456789abcdef", "'0123456' counts or repeats"),
    ("deadbeefcafe1234deadbeefcafe5678", "'deadbee' comes twice"),
    ("01234567" * 4, "only 8 different hex digits"),
], ids=["generated", "random-hex", "mistyped", "cut-short", "passphrase", "31-hex", "counting", "repeated", "8-digits"])
def test_keys_are_generated_or_random_looking_hex_of_128_bits(key, problem, monkeypatch):
    monkeypatch.setenv(ROLLOUT_KEY_ENV, f" {key}\n")  # as `export` of a file's line may leave it
    if problem is None:
        assert link.rollout_key("rollout_address") == key.encode()
        return
    with pytest.raises(ConfigError) as refused:
        link.rollout_key("rollout_address")
    assert refused.value.field == "rollout_address"
    assert f"{ROLLOUT_KEY_ENV} is too weak (" in str(refused.value) and problem in str(refused.value)
    assert f"Fix: export {ROLLOUT_KEY_ENV}=$(asyncgrpo keygen)" in str(refused.value)


def test_generated_keys_carry_256_random_bits_and_differ_every_time():
    keys = {link.generate_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        prefix, body, check = key.split("-")
        assert prefix + "-" == link.KEY_PREFIX and len(bytes.fromhex(body)) == 32 and len(check) == 8
        assert link.key_problem(key) is None


# ---- the certificate ---------------------------------------------------------------------------------------------
def test_the_server_certificate_is_self_signed_for_a_year_from_five_minutes_ago_and_leaves_no_file(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a key written to a relative path would land
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    theirs, ours = socket.socketpair()
    context, fingerprint = link.server_tls()
    after = datetime.datetime.now(datetime.timezone.utc)
    with context.wrap_socket(theirs, server_side=True, do_handshake_on_connect=False) as server, \
            link.client_tls().wrap_socket(ours, do_handshake_on_connect=False) as client:
        shaking = threading.Thread(target=server.do_handshake, daemon=True)
        shaking.start()
        client.do_handshake()
        shaking.join(BOUND_S)
        server.sendall(b"x")
        assert client.recv(1) == b"x"  # a session ticket would have been read on the way
        assert client.version() == "TLSv1.3" and not client.session.has_ticket  # none is sent
        der = client.getpeercert(binary_form=True)
    assert hashlib.sha256(der).digest() == fingerprint  # what the key proof binds to: what the client sees
    cert = x509.load_der_x509_certificate(der)
    assert cert.subject == cert.issuer  # self-signed
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == ["asyncgrpo rollout-serve"]
    # Valid from five minutes back (a client whose clock is a little behind), for a year.
    five_minutes = datetime.timedelta(minutes=5)
    assert before - five_minutes <= cert.not_valid_before_utc <= after - five_minutes
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(days=365) + five_minutes
    assert list(tmp_path.iterdir()) == []  # the private key and the certificate were written elsewhere, and removed


# ---- the key proof: what each end reports ----------------------------------------------------------------------
def test_a_client_with_another_key_is_refused_and_each_end_says_which_proof_failed(tls):
    client, server, fingerprint = tls
    deadline = time.monotonic() + BOUND_S
    serving = _in_thread(lambda: link.prove_server(server, KEY, fingerprint, deadline))
    trying = _in_thread(lambda: link.prove_client(client, KEY[::-1], deadline))
    # The server proves first: the client, holding another key, finds its proof wrong and stops there.
    trying["thread"].join(BOUND_S)
    assert isinstance(trying.get("error"), link.KeyMismatch)
    assert str(trying["error"]) == "the server could not prove it holds this end's key"
    serving["thread"].join(BOUND_S)  # it sent zeros instead of a proof: the server logs a key mismatch
    assert isinstance(serving.get("error"), link.KeyMismatch)
    assert str(serving["error"]) == "the client's key proof does not match this server's key and certificate"


def test_a_client_whose_proof_is_wrong_is_refused_and_told_so(tls):
    client, server, fingerprint = tls
    deadline = time.monotonic() + BOUND_S
    serving = _in_thread(lambda: link.prove_server(server, KEY, fingerprint, deadline))
    challenge = link.recv_exactly(client, link.CHALLENGE_BYTES, deadline)
    client.sendall(secrets.token_bytes(link.NONCE_BYTES))
    link.recv_exactly(client, link.MAC_BYTES, deadline)  # the server's proof
    client.sendall(secrets.token_bytes(link.MAC_BYTES))  # a proof it cannot make
    serving["thread"].join(BOUND_S)
    assert challenge.startswith(link.MAGIC) and isinstance(serving.get("error"), link.KeyMismatch)
    assert str(serving["error"]) == "the client's key proof does not match this server's key and certificate"
    link.refuse(server, deadline)  # what the accept loop does next
    assert bytes(link.recv_exactly(client, link.VERDICT_BYTES, deadline)) == b"N"


def test_a_server_that_cannot_prove_the_key_is_named_so(tls):
    client, server, _ = tls

    def impersonate():
        server.sendall(link.MAGIC + secrets.token_bytes(link.NONCE_BYTES))
        link.recv_exactly(server, link.NONCE_BYTES)
        server.sendall(secrets.token_bytes(link.MAC_BYTES))  # a proof it cannot make

    impersonating = _in_thread(impersonate)
    with pytest.raises(link.KeyMismatch) as refused:
        link.prove_client(client, KEY, time.monotonic() + BOUND_S)
    assert str(refused.value) == "the server could not prove it holds this end's key"
    impersonating["thread"].join(BOUND_S)


def test_a_server_of_another_protocol_is_named_so(tls):
    client, server, _ = tls
    server.sendall(b"HTTP/1.1 400 Bad Request\r\n".ljust(link.CHALLENGE_BYTES, b" "))
    with pytest.raises(ValueError) as failure:
        link.prove_client(client, KEY, time.monotonic() + BOUND_S)
    assert str(failure.value) == "the server does not speak the asyncgrpo rollout protocol"


def test_a_proof_started_past_its_deadline_says_so_without_reading(tls):
    client, _, _ = tls
    with pytest.raises(TimeoutError) as late:
        link.prove_client(client, KEY, time.monotonic() - 0.1)
    assert str(late.value) == "the handshake's deadline passed"


# ---- one deadline for the whole proof, however slowly the bytes come ----------------------------------------------
@pytest.mark.parametrize("stage", ["challenge", "proof"])
def test_a_server_trickling_its_part_is_given_up_at_the_deadline(tls, stage):
    """Each read gets only the time left: a server sending a byte now and then cannot stretch the proof past it."""
    client, server, _ = tls
    challenge = link.MAGIC + secrets.token_bytes(link.NONCE_BYTES)
    if stage == "challenge":
        trickle = Trickle(server, challenge)
    else:  # the challenge at once, then the server's proof byte by byte once the client's nonce is in
        server.sendall(challenge)
        trickle = Trickle(server, secrets.token_bytes(link.MAC_BYTES), after=link.NONCE_BYTES)
    deadline = time.monotonic() + DEADLINE_S
    proving = _in_thread(lambda: link.prove_client(client, KEY, deadline))
    try:
        returns_within(lambda: proving["thread"].join(), BOUND_S, f"a proof whose {stage} trickles in")
        assert isinstance(proving.get("error"), TimeoutError), proving
    finally:
        trickle.stop()


def test_a_client_trickling_its_proof_is_given_up_at_the_deadline(tls):
    client, server, fingerprint = tls
    deadline = time.monotonic() + DEADLINE_S
    trickle = Trickle(client, secrets.token_bytes(link.NONCE_BYTES), after=link.CHALLENGE_BYTES)
    serving = _in_thread(lambda: link.prove_server(server, KEY, fingerprint, deadline))
    try:
        returns_within(lambda: serving["thread"].join(), BOUND_S, "a proof whose answer trickles in")
        assert isinstance(serving.get("error"), TimeoutError), serving
    finally:
        trickle.stop()


def test_recv_exactly_gathers_bytes_that_come_one_at_a_time_and_names_a_close_midway():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        data = bytes(range(1, 9))
        trickle = Trickle(theirs, data, pace=0.02)
        got = returns_within(lambda: link.recv_exactly(ours, len(data), time.monotonic() + BOUND_S), BOUND_S + 1,
                             "a read of bytes that come one at a time")
        trickle.stop()
        assert bytes(got) == data
        theirs.sendall(data[:3])
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError) as closed:
            link.recv_exactly(ours, len(data), time.monotonic() + BOUND_S)
    assert str(closed.value) == "the connection closed after 3 of 8 bytes"


# ---- Link --------------------------------------------------------------------------------------------------------
def test_a_link_polls_without_waiting_bounds_its_reads_when_told_and_refuses_a_closed_descriptor(tls):
    client, _, _ = tls
    end = link.Link(client)
    assert end.closed is False  # a bool, as on multiprocessing's Connection
    assert returns_within(end.poll, BOUND_S, "a poll of a link with nothing to read") is False
    end.settimeout(0.1)
    with pytest.raises(TimeoutError):
        returns_within(end.recv, BOUND_S, "a read of a silent link with a timeout")
    end.close()
    assert end.closed is True
    with pytest.raises(OSError) as closed:
        end.fileno()
    assert str(closed.value) == "the rollout link is closed"
