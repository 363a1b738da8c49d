"""The rollout link's protection over TCP (`rollout_address` <-> `asyncgrpo rollout-serve`): the shared key
(`rollout_key`, checked at both ends; `generate_key` makes one), TLS 1.3 from the standard library's `ssl` with a
certificate the server makes for its run (`server_tls`, `client_tls`), the mutual proof of the key bound to that
certificate, the server's first (`prove_server`, `prove_client`), and `Link`, the framed pickled messages over the TLS socket, with multiprocessing Connection's
methods. The spawned child (`rollout_process: true`) uses a socketpair instead and needs none of this. Why TLS and
how the proof works: docs/rollout-internals.md, "Over TCP".
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import pickle
import secrets
import select
import socket
import ssl
import struct
import tempfile
import time
from pathlib import Path

from asyncgrpo.config import ROLLOUT_KEY_ENV
from asyncgrpo.errors import ConfigError

# Keys: `asyncgrpo keygen`'s (KEY_PREFIX, 256 random bits in hex, a checksum), or bare hex as `openssl rand -hex N`
# prints it. Nothing else: no code can tell a passphrase's randomness from its text, and whoever gets one key proof
# (see prove_server) can test guesses offline at millions a second. How a hex key is judged: `key_problem`.
KEY_PREFIX = "agk1-"
KEY_RANDOM_BYTES = 32
KEY_CHECK_BYTES = 4
KEY_MIN_HEX = 32  # `openssl rand -hex 16`: 128 bits, if random; `asyncgrpo keygen` makes 256
KEY_MIN_DISTINCT = 10  # of 16 hex digits: 32 random ones show fewer than 10 with probability ~1e-4
KEY_MAX_PATTERN = 7  # a repeated or counting run this long (2 in 100,000 random 64-digit keys) is a made-up key
KEY_FIX = (f"export {ROLLOUT_KEY_ENV}=$(asyncgrpo keygen) on one host and the same value on the other (the trainer's "
           f"and rollout-serve's), keeping it out of command lines")
MAGIC = b"AGRPOL2\n"  # opens the server's challenge: a client talking to some other TLS server learns so at once
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES  # server -> client: magic + its nonce
# client -> server: its nonce (NONCE_BYTES); server -> client: its proof (MAC_BYTES); client -> server: its proof
VERDICT_BYTES = 1  # server -> client: b"Y" or b"N"
_HEADER = struct.Struct("!Q")  # a message's length before its pickle


class KeyMismatch(Exception):
    """The other end does not prove the key this end holds (another key, or a man in the middle)."""


def generate_key() -> str:
    """A new key (`asyncgrpo keygen`): KEY_PREFIX, KEY_RANDOM_BYTES from the OS's generator in hex, `-`, a checksum
    that tells a truncated or mistyped key from another one."""
    body = secrets.token_bytes(KEY_RANDOM_BYTES).hex()
    return f"{KEY_PREFIX}{body}-{_key_check(body)}"


def _key_check(body: str) -> str:
    return hashlib.sha256(b"asyncgrpo key|" + body.encode()).digest()[:KEY_CHECK_BYTES].hex()


def _pattern(key: str) -> str | None:
    """A repeated stretch or a counting run of KEY_MAX_PATTERN characters in `key`, if it has one."""
    n = KEY_MAX_PATTERN
    seen = set()
    for i in range(len(key) - n + 1):
        chunk = key[i:i + n]
        if chunk in seen:
            return f"{chunk!r} comes twice"
        seen.add(chunk)
        steps = {int(b, 16) - int(a, 16) for a, b in zip(chunk, chunk[1:])}
        if steps <= {1} or steps <= {-1} or steps <= {0}:
            return f"{chunk!r} counts or repeats"
    return None


def key_problem(key: str) -> str | None:
    """Why `key` cannot be the link's key, or None. A generated key (KEY_PREFIX) must carry its checksum; any other
    must be hex of KEY_MIN_HEX digits or more (at least 128 bits) that looks drawn at random: KEY_MIN_DISTINCT of the
    16 digits or more, and no stretch of KEY_MAX_PATTERN digits that repeats, counts up or down, or is one digit."""
    if key.startswith(KEY_PREFIX):
        body, _, check = key[len(KEY_PREFIX):].rpartition("-")
        if len(body) != 2 * KEY_RANDOM_BYTES or not _is_hex(body) or check != _key_check(body):
            return "it starts like `asyncgrpo keygen`'s keys but its checksum does not match (cut short or mistyped)"
        return None
    if not _is_hex(key):
        return ("it is not a generated key: only `asyncgrpo keygen`'s keys or hex from `openssl rand -hex 32` are "
                "accepted, because a passphrase's randomness cannot be judged from its text")
    if len(key) < KEY_MIN_HEX:
        return f"{len(key)} hex digits are {4 * len(key)} bits at most; at least {KEY_MIN_HEX} are needed"
    distinct = len(set(key.lower()))
    if distinct < KEY_MIN_DISTINCT:
        return f"only {distinct} different hex digits: random ones show {KEY_MIN_DISTINCT} or more"
    pattern = _pattern(key.lower())
    if pattern is not None:
        return f"{pattern}: it was typed or made up, not drawn at random"
    return None


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)


def rollout_key(role: str) -> bytes:
    """ASYNCGRPO_ROLLOUT_KEY, required at both ends and judged by `key_problem`; `role` names the setting that needs
    it for the error ("--listen" or "rollout_address")."""
    key = os.environ.get(ROLLOUT_KEY_ENV, "").strip()
    why = ("the rollout connection carries pickles, so whoever holds the key can run code on either end; there is "
           "no built-in key")
    if not key:
        raise ConfigError(role, f"{ROLLOUT_KEY_ENV} is not set: {why}", KEY_FIX)
    problem = key_problem(key)
    if problem is not None:
        raise ConfigError(role, f"{ROLLOUT_KEY_ENV} is too weak ({problem}): {why}", KEY_FIX)
    return key.encode()


# ---- TLS ------------------------------------------------------------------------------------------------------
def server_tls() -> tuple[ssl.SSLContext, bytes]:
    """A TLS 1.3 server context with a new self-signed certificate (its key never leaves this process), and the
    certificate's SHA-256 fingerprint, which the key proof binds to."""
    # Imported here, where a certificate is made (`rollout-serve --listen` only): the trainer imports this module
    # through the rollout factory, and a GPU image without `cryptography` must still run the trainer's step.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncgrpo rollout-serve")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365)).sign(private, hashes.SHA256()))
    context = _context(ssl.PROTOCOL_TLS_SERVER)
    context.num_tickets = 0  # no session tickets: nothing but our messages ever arrives after the handshake
    # load_cert_chain reads files only: a private directory (mkdtemp: 0700) that is gone once they are loaded.
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-tls-") as folder:
        cert_path, key_path = Path(folder, "cert.pem"), Path(folder, "key.pem")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        context.load_cert_chain(cert_path, key_path)
    return context, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def client_tls() -> ssl.SSLContext:
    """A TLS 1.3 client context that takes any certificate: no CA vouches for a run's own, so the server is
    authenticated by the key proof bound to the certificate it showed (prove_client), not by a CA."""
    context = _context(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _context(protocol) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are asyncgrpo: nothing older to talk to
    return context


def tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    _bound(sock, deadline)
    sock.do_handshake()  # one operation: the timeout set bounds all of it, however slowly the bytes come


# ---- the key proof (inside TLS) ---------------------------------------------------------------------------------
def _proof(key: bytes, who: bytes, fingerprint: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(key, b"asyncgrpo rollout link|" + who + b"|" + fingerprint + nonce_s + nonce_c,
                    hashlib.sha256).digest()


def prove_server(sock: ssl.SSLSocket, key: bytes, fingerprint: bytes, deadline: float) -> None:
    """The server's half: challenge the client, take its nonce, prove the key first, then check the client's proof.
    Raises KeyMismatch (then tell the client with `refuse`), TimeoutError once `deadline` (time.monotonic())
    passes, OSError/EOFError for a broken connection.

    The server proves first so that the trainer, which dials whatever answers at `rollout_address`, never gives a
    key-derived byte to a server that has not proven the key: an impersonator gets a random nonce and nothing to
    guess from. Without a PAKE one end must prove first, and what it sends lets whoever reads it test guesses of the
    key offline; here that is a client of the rollout server, one proof per handshake, through the accept loop's
    throttle (throttle.py). What makes such a guess useless is the key: 256 random bits (`generate_key`), or at
    least 128 judged random (`key_problem`). docs/security.md."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    _send_within(sock, MAGIC + nonce_s, deadline)
    nonce_c = recv_exactly(sock, NONCE_BYTES, deadline)
    _send_within(sock, _proof(key, b"server", fingerprint, nonce_s, nonce_c), deadline)
    theirs = recv_exactly(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(theirs, _proof(key, b"trainer", fingerprint, nonce_s, nonce_c)):
        raise KeyMismatch("the client's key proof does not match this server's key and certificate")
    _send_within(sock, b"Y", deadline)


def refuse(sock: ssl.SSLSocket, deadline: float) -> None:
    """Tell a client whose proof failed (prove_server's KeyMismatch) that it was refused: its error then names the
    key, not a closed connection. Best effort: it may be gone already."""
    try:
        _send_within(sock, b"N", deadline)
    except OSError:
        pass


def prove_client(sock: ssl.SSLSocket, key: bytes, deadline: float) -> None:
    """The client's half, over the certificate the server showed: its nonce, the server's proof checked, then its
    own proof (never sent to a server that did not prove the key: prove_server says why). Raises KeyMismatch if the
    server cannot prove the key or refused ours, ValueError if it does not speak this protocol, TimeoutError,
    OSError, EOFError."""
    fingerprint = hashlib.sha256(sock.getpeercert(binary_form=True)).digest()
    challenge = recv_exactly(sock, CHALLENGE_BYTES, deadline)
    if challenge[:len(MAGIC)] != MAGIC:
        raise ValueError("the server does not speak the asyncgrpo rollout protocol")
    nonce_s, nonce_c = challenge[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    _send_within(sock, nonce_c, deadline)
    theirs = recv_exactly(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(theirs, _proof(key, b"server", fingerprint, nonce_s, nonce_c)):
        with contextlib.suppress(OSError):  # zeros, not a proof: a real server with another key logs the mismatch
            _send_within(sock, bytes(MAC_BYTES), deadline)
        raise KeyMismatch("the server could not prove it holds this end's key")
    _send_within(sock, _proof(key, b"trainer", fingerprint, nonce_s, nonce_c), deadline)
    if recv_exactly(sock, VERDICT_BYTES, deadline) != b"Y":
        raise KeyMismatch("the server refused this end's key")


def _bound(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    sock.settimeout(left)


def _send_within(sock: socket.socket, data: bytes, deadline: float) -> None:
    _bound(sock, deadline)
    sock.sendall(data)


def recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """`n` bytes from `sock`; EOFError if it closes first. With `deadline`: TimeoutError once it passes, however
    the bytes trickle in (each read gets only the time left)."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        if deadline is not None:
            _bound(sock, deadline)
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += read
    return buffer


# ---- the connection -------------------------------------------------------------------------------------------
class Link:
    """Pickled messages, each framed by its length, over an authenticated TLS socket: the methods of
    multiprocessing's Connection that the proxy and the serve loop use, with the same errors (EOFError when the
    other end closed, OSError when the connection broke or a message failed TLS's integrity check). multiprocessing's
    own Connection cannot be used: it reads the descriptor directly, under the TLS layer."""

    def __init__(self, sock: ssl.SSLSocket):
        self._sock = sock
        self.closed = False

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) < 1 << 16:
            self._sock.sendall(_HEADER.pack(len(data)) + data)  # one TLS record for a small message
        else:
            self._sock.sendall(_HEADER.pack(len(data)))
            self._sock.sendall(data)  # not concatenated: a published adapter's bytes are not copied again

    def recv(self):
        (size,) = _HEADER.unpack(recv_exactly(self._sock, _HEADER.size))
        return pickle.loads(recv_exactly(self._sock, size))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a read would find data (or EOF) now, waiting up to `timeout` (None: for ever). TLS may already
        hold decrypted bytes the descriptor no longer shows: those count first."""
        if self._sock.pending():
            return True
        return bool(select.select([self._sock], [], [], timeout)[0])

    def settimeout(self, seconds: float | None) -> None:
        """Bound every later read and write to `seconds` each (None: blocking, the default)."""
        self._sock.settimeout(seconds)

    def fileno(self) -> int:
        if self.closed:
            raise OSError("the rollout link is closed")
        return self._sock.fileno()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()
