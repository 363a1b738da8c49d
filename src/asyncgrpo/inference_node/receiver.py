"""The adapter receiver: runs beside vLLM on an inference node that cannot read the trainer's `lora_adapter_path`
(`adapter_delivery: http`), takes each adapter version's files over HTTP, and loads them into the co-located vLLM.

    ASYNCGRPO_VLLM_API_KEY=... python -m asyncgrpo.inference_node.receiver --dir /local/adapters --host 10.0.0.5 \\
        --port 8001 --vllm-url http://127.0.0.1:8000

It never reads, writes or loads anything outside `--dir`, keeps it bounded (`--keep`), listens on loopback unless
given a key, and bounds what one client can hold (connections, time, disk). Routes and refusals: docs/delivery.md.
"""

from __future__ import annotations

import argparse
import errno
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from asyncgrpo.config import API_KEY_ENV
from asyncgrpo.errors import ConfigError, InferenceServerError
from asyncgrpo.files import fsync_path, sha256_file
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.shutdown import exit_on_signal

log = logging.getLogger(__name__)

MANIFEST_NAME = "asyncgrpo_manifest.json"  # the same file name as store.py's (kept torch-free here)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # always fullmatch: `re.match` with `$` lets a final "\n" in
_SHA256 = re.compile(r"[0-9a-f]{64}")  # what sha256_file (hexdigest) writes into the trainer's manifest
_DIGITS = re.compile(r"[0-9]{1,20}")  # a Content-Length: ASCII digits only (str.isdigit also takes "²")
STAGE_PREFIX = ".incoming-"  # `.incoming-{name}/`: a version's complete files until its commit
PART_PREFIX = ".part-"  # `.part-{random}`: one upload in flight; never a name _NAME accepts, so never served or listed
CHUNK = 1 << 20  # bytes read from the socket at a time
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files (~150 bytes each)
MAX_MANIFEST_FILES = 1000  # an adapter directory has 2-10 files (weights, config, tokenizer files)
DEFAULT_MAX_FILE_BYTES = 16 << 30  # a LoRA of a 70B model at rank 64 is ~1.6 GB in fp32; refuse absurd uploads
# The longest one read or write on a connection may wait: a live upload delivers its next bytes within milliseconds
# even on a congested link, and a client's idle keep-alive connection that the receiver closes is reopened by
# `requests` at its next call. 60 s tolerates a network hiccup, yet bounds how long a stalled upload or a silent
# connection keeps a thread and a connection slot.
SOCKET_TIMEOUT_S = 60.0
# Connections handled at once, each on its own thread. A trainer holds one per receiver (its uploads go one file at
# a time), the doctor one more: 32 leaves room for several runs on one inference node. The next one is answered 503
# and closed at once, without a thread.
MAX_CONNECTIONS = 32
# A turned-away connection stays open this long after its 503 (sending nothing more), so that the request its client
# sends meanwhile is read and dropped: closing a socket with unread bytes resets the connection, and the client would
# see a reset instead of the 503. At most MAX_LINGERING such sockets (a file descriptor each, no thread).
LINGER_S = 1.0
MAX_LINGERING = 256
# A staging directory untouched this long belongs to an upload nobody will commit (a trainer that died between its
# files and the commit): six times the trainer's per-file upload timeout (rollout/delivery.py, 600 s).
STAGE_MAX_AGE_S = 3600.0
# Left free beyond every upload in flight: a full disk would break the commit's manifest and fsync, and vLLM's and
# the system's own writes.
FREE_SPACE_MARGIN_BYTES = 64 << 20


class Refused(Exception):
    """A request the receiver answers with a 4xx (or 507): `status` and the message sent back."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _remove(path: Path) -> None:
    """Delete a file, symlink (not its target) or directory tree; gone already is fine."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


class AdapterReceiver:
    """The receiver's state and rules, without HTTP (the handler below only parses and answers).

    Uploads stream into their own `.part-*` file without any lock; `_lock` covers only the short changes to the
    directory (a finished file renamed into staging, a commit, a load), so a stalled upload blocks nothing else."""

    def __init__(self, root: str | Path, vllm: InferenceClient | None, *, keep: int = 8,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, stage_max_age_s: float = STAGE_MAX_AGE_S):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.vllm = vllm  # None: store only (tests of the refusals need no server)
        self.keep = keep
        self.max_file_bytes = max_file_bytes
        self.stage_max_age_s = stage_max_age_s
        self._lock = threading.Lock()  # one change to the directory (or to vLLM's adapters) at a time
        self._reserved_lock = threading.Lock()
        self._reserved: dict[Path, int] = {}  # each upload in flight: the bytes it was admitted with
        for stale in [*self.root.glob(STAGE_PREFIX + "*"), *self.root.glob(PART_PREFIX + "*")]:
            _remove(stale)  # what a receiver killed midway left: nothing is in flight at start

    def inside(self, *parts: str) -> Path:
        """`root/parts...` after checking each part's name, and that no symlink lies on the way; a 400 otherwise."""
        for part in parts:
            if not isinstance(part, str) or not _NAME.fullmatch(part):
                raise Refused(400, f"{part!r} is not a valid adapter or file name (letters, digits, '.', '_', '-', "
                                   f"starting with a letter or digit)")
        path = self.root.joinpath(*parts)
        resolved = path.resolve()  # root is resolved and no name is "..": any difference is a symlink on the way
        if resolved != path:
            raise Refused(400, f"{'/'.join(parts)!r} is a symlink (to {resolved}); the receiver follows none")
        return path

    def _stage(self, name: str, create: bool = False) -> Path:
        """`root/.incoming-{name}`, made when `create`; a 409 when something other than a directory is there (a
        planted symlink would send the files elsewhere)."""
        self.inside(name)
        stage = self.root / f"{STAGE_PREFIX}{name}"
        try:
            mode = os.lstat(stage).st_mode  # lstat: a symlink is seen as one, not followed
        except FileNotFoundError:
            if create:
                os.mkdir(stage)
            return stage
        if not stat.S_ISDIR(mode):
            log.warning("refused to write through %s: not a directory this receiver made", stage)
            raise Refused(409, f"the receiver's staging path {stage.name} is a symlink or a file, not a directory it "
                               f"made; it writes through neither. Remove {stage} on the receiver's host")
        return stage

    def _reserve(self, part: Path, length: int) -> None:
        """Admit an upload of `length` bytes only if the disk has room for it beyond every other upload in flight
        (their full lengths: conservative while they write); a 507 otherwise."""
        with self._reserved_lock:
            free = shutil.disk_usage(self.root).free
            pending = sum(self._reserved.values())
            if length + pending + FREE_SPACE_MARGIN_BYTES > free:
                raise Refused(507, f"{length} bytes do not fit: {free} bytes free under the receiver's directory, "
                                   f"{pending} promised to uploads in progress, {FREE_SPACE_MARGIN_BYTES} kept free. "
                                   f"Free space on the receiver's host or lower --keep")
            self._reserved[part] = length

    def put_file(self, name: str, filename: str, length: int, body) -> int:
        """Stream `length` bytes from `body` into a `.part` file, then (under the lock) rename it into the staging
        directory of `name`; returns the bytes written. A failed upload leaves nothing behind."""
        if filename == MANIFEST_NAME:
            raise Refused(400, f"{MANIFEST_NAME} is written by the receiver at commit; do not upload it")
        self.inside(name, filename)
        if length > self.max_file_bytes:
            raise Refused(413, f"{filename}: {length} bytes is more than --max-file-bytes {self.max_file_bytes}")
        part = self.root / f"{PART_PREFIX}{secrets.token_hex(8)}"  # its own file: uploads never share one
        self._reserve(part, length)
        try:
            # O_EXCL | O_NOFOLLOW: never through anything already there, a planted symlink included
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            read = getattr(body, "read1", body.read)  # read1: what has arrived, so a stall loses no counted bytes
            with os.fdopen(fd, "wb") as f:
                left = length
                while left:
                    try:
                        block = read(min(CHUNK, left))
                    except TimeoutError as exc:
                        raise Refused(408, f"{filename}: the upload stalled after {length - left} of {length} bytes "
                                           f"(nothing arrived within the receiver's socket timeout)") from exc
                    if not block:
                        raise Refused(400, f"{filename}: the body ended after {length - left} of {length} bytes")
                    f.write(block)
                    left -= len(block)
            with self._lock:
                os.replace(part, self._stage(name, create=True) / filename)  # replaces a symlink there, never follows
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise Refused(507, f"{filename}: the receiver's disk filled up during the upload ({exc.strerror}). "
                                   f"Free space on the receiver's host or lower --keep") from exc
            raise
        finally:
            part.unlink(missing_ok=True)  # renamed already: nothing; failed or abandoned: its bytes go
            with self._reserved_lock:
                self._reserved.pop(part, None)
        return length

    def commit(self, name: str, manifest: dict) -> dict:
        """Check the staged files against `manifest`, then rename them into `root/name` (see the module docstring)."""
        final = self.inside(name)
        files = self._check_manifest(manifest)
        with self._lock:
            self._expire_stages()
            stage = self._stage(name)
            if final.is_dir():
                _remove(stage)  # a retry's upload: the committed copy stays
                try:
                    stored = json.loads((final / MANIFEST_NAME).read_text())
                except (OSError, ValueError):
                    stored = None
                if stored != manifest:
                    raise Refused(409, f"version {name} was already committed with other files; versions are "
                                       f"immutable: publish under a new name")
                return {"path": str(final), "written": False}
            try:
                self._verify(stage, files)
            except Refused:
                _remove(stage)  # nothing of a bad upload stays
                raise
            for extra in set(os.listdir(stage)) - set(files):
                _remove(stage / extra)  # only what the manifest vouches for goes live
            (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
            for p in stage.iterdir():
                fsync_path(p)
            fsync_path(stage)
            os.rename(stage, final)
            fsync_path(self.root)
        log.info("committed %s (%d files)", name, len(files))
        return {"path": str(final), "written": True}

    @staticmethod
    def _check_manifest(manifest) -> dict:
        """A flat, non-empty {file: {"size": int >= 0, "sha256": 64 hex}}; a 400 naming the first entry that is not."""
        if not isinstance(manifest, dict) or not manifest:
            raise Refused(400, "the commit body must be a non-empty manifest {file: {size, sha256}}")
        if len(manifest) > MAX_MANIFEST_FILES:
            raise Refused(400, f"the manifest lists {len(manifest)} files; at most {MAX_MANIFEST_FILES}")
        for filename, want in manifest.items():
            if not _NAME.fullmatch(filename) or filename == MANIFEST_NAME:
                raise Refused(400, f"manifest entry {filename!r} is not a valid file name")
            if not (isinstance(want, dict) and set(want) == {"size", "sha256"}
                    and type(want["size"]) is int and want["size"] >= 0  # type(): True is an int too
                    and isinstance(want["sha256"], str) and _SHA256.fullmatch(want["sha256"])):
                raise Refused(400, f"manifest entry {filename!r} must be exactly {{\"size\": a whole number >= 0, "
                                   f"\"sha256\": 64 lowercase hex digits}}")
        return manifest

    @staticmethod
    def _verify(stage: Path, files: dict) -> None:
        for filename, want in files.items():
            path = stage / filename
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                raise Refused(422, f"{filename} was not uploaded (PUT it before the commit)") from None
            if not stat.S_ISREG(info.st_mode):  # only files the receiver renamed in; never read through a symlink
                raise Refused(422, f"{filename} in the staging directory is not a regular file; upload it again")
            if info.st_size != want["size"]:
                raise Refused(422, f"{filename} arrived with {info.st_size} bytes, the manifest says {want['size']}")
            digest = sha256_file(path)
            if digest != want["sha256"]:
                raise Refused(422, f"{filename} arrived with sha256 {digest[:16]}..., the manifest says "
                                   f"{want['sha256'][:16]}... (corrupted in transit)")

    def _expire_stages(self) -> None:
        """Delete staging directories nothing was added to for `stage_max_age_s` (call under the lock)."""
        cutoff = time.time() - self.stage_max_age_s
        for stage in self.root.glob(STAGE_PREFIX + "*"):
            try:
                old = os.lstat(stage).st_mtime < cutoff
            except FileNotFoundError:
                continue
            if old:
                log.info("removing %s: an upload not committed for %.0f s", stage.name, self.stage_max_age_s)
                _remove(stage)

    def load(self, name: str) -> dict:
        """Serve the committed `root/name` from vLLM as adapter `name`; answer the path vLLM reports."""
        final = self.inside(name)
        if self.vllm is None:
            raise Refused(503, "this receiver was started without --vllm-url")
        with self._lock:
            self._expire_stages()
            if not (final / MANIFEST_NAME).is_file():
                raise Refused(404, f"version {name} is not committed here; upload and commit it first")
            served = self.vllm.adapter_paths()
            if served.get(name) != str(final):
                self.vllm.load_adapter(name, str(final))
                served = self.vllm.adapter_paths()
            self._prune(set(served.values()))
        return {"path": served.get(name)}

    def _prune(self, in_use: set[str]) -> None:
        """Delete committed versions vLLM does not serve, beyond the newest `keep`."""
        versions = sorted((p for p in self.root.iterdir()
                           if _NAME.fullmatch(p.name) and not p.is_symlink() and p.is_dir()),
                          key=lambda p: p.stat().st_mtime)
        for p in versions[:-self.keep] if self.keep else versions:
            if str(p) not in in_use:
                shutil.rmtree(p, ignore_errors=True)

    def committed(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()
                      if _NAME.fullmatch(p.name) and not p.is_symlink() and (p / MANIFEST_NAME).is_file())


def make_handler(receiver: AdapterReceiver, api_key: str | None, timeout_s: float = SOCKET_TIMEOUT_S):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = timeout_s  # set on the socket by StreamRequestHandler.setup: every read and write of the connection

        def log_message(self, fmt, *args):  # through logging, not stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def send_error(self, code, message=None, explain=None):
            """What http.server refuses itself (a malformed request line or header, an unknown method): JSON, as
            every other answer, and the connection closed."""
            if self.request_version == "HTTP/0.9":  # set for a request line it could not parse: answer with a
                self.request_version = "HTTP/1.1"    # status line and headers all the same
            if code == 501:  # http.server's answer to a method it has no do_X for: the client's mistake, a 4xx
                code, message = 405, f"method {self.command!r} is not accepted (GET, PUT, POST)"
            self._answer(code, {"error": message or self.responses.get(code, ("error",))[0]}, close=True)

        def _answer(self, status: int, body: dict, close: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:  # a refused request's body may be unread: it must not be taken for the next request
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _length(self) -> int | None:
            """The request's Content-Length (None without one); a 400 for anything but one non-negative integer."""
            values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
            if not values:
                return None
            if len(values) > 1 or not _DIGITS.fullmatch(next(iter(values))):
                raise Refused(400, f"Content-Length must be one whole number of bytes, got {sorted(values)!r}")
            return int(next(iter(values)))

        def _read(self, length: int) -> bytes:
            try:
                data = self.rfile.read(length)
            except TimeoutError as exc:
                raise Refused(408, "the request body stalled (nothing arrived within the socket timeout)") from exc
            if len(data) != length:
                raise Refused(400, f"the body ended after {len(data)} of {length} bytes")
            return data

        def _route(self, method: str) -> None:
            parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
            has_body = self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers
            try:
                if method == "GET" and parts == ["health"]:
                    return self._answer(200, {"status": "ok"}, close=has_body)
                self._authorise()
                if "Transfer-Encoding" in self.headers:  # chunked bodies are not parsed: never guess where one ends
                    raise Refused(411, "send the body with a Content-Length; Transfer-Encoding is not accepted")
                length = self._length()
                if method == "PUT" and len(parts) == 3 and parts[0] == "adapters":
                    if length is None:
                        raise Refused(411, "Content-Length is required")
                    return self._answer(200, {"bytes": receiver.put_file(parts[1], parts[2], length, self.rfile)})
                if method == "POST" and len(parts) == 3 and parts[0] == "adapters" and parts[2] == "commit":
                    if length is None:
                        raise Refused(411, "the commit needs a JSON manifest body with a Content-Length")
                    if length > MAX_MANIFEST_BYTES:
                        raise Refused(413, f"a manifest of {length} bytes; at most {MAX_MANIFEST_BYTES}")
                    try:
                        manifest = json.loads(self._read(length) or b"null")
                    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
                        raise Refused(400, f"the manifest is not JSON of a sane depth ({exc})"[:300]) from exc
                    return self._answer(200, receiver.commit(parts[1], manifest))
                if method == "POST" and len(parts) == 3 and parts[0] == "adapters" and parts[2] == "load":
                    return self._answer(200, receiver.load(parts[1]), close=has_body)
                if method == "GET" and parts == ["adapters"]:
                    return self._answer(200, {"committed": receiver.committed()}, close=has_body)
                raise Refused(404, f"no route {method} {self.path[:200]}")
            except Refused as exc:
                self._safely(exc.status, str(exc))
            except InferenceServerError as exc:
                self._safely(502, f"the co-located vLLM refused: {exc}")
            except OSError as exc:  # the client went away or stopped reading: nobody to answer
                log.info("%s: connection dropped during %s %s (%s)", self.address_string(), method,
                         self.path[:200], exc)
                self.close_connection = True
            except Exception:  # a bug: the client still gets an answer, the log the traceback
                log.exception("%s %s failed", method, self.path[:200])
                self._safely(500, "internal error in the receiver; its log has the traceback")

        def _safely(self, status: int, message: str) -> None:
            try:
                self._answer(status, {"error": message}, close=True)
            except OSError:
                self.close_connection = True

        def _authorise(self) -> None:
            if not api_key:
                return
            sent = self.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
                raise Refused(401, f"missing or wrong API key: send `Authorization: Bearer <key>` with the key in "
                                   f"{API_KEY_ENV}")

        def do_GET(self):
            self._route("GET")

        def do_PUT(self):
            self._route("PUT")

        def do_POST(self):
            self._route("POST")

        def do_DELETE(self):
            self._route("DELETE")

        def do_PATCH(self):
            self._route("PATCH")

    return Handler


class ReceiverServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` handled at once: the next is answered 503 and closed
    from the accepting thread, so no client can make the receiver start unbounded threads."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 makes a burst of connects wait on SYN retries)
    block_on_close = False  # server_close does not wait for stalled connections: each ends at its socket timeout

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._turned_away = 0
        self._lingering: deque[tuple[float, socket.socket]] = deque()  # (when to close, turned-away socket)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._turn_away(request)
            return
        # ThreadingMixIn's thread, named after the receiver's port and the peer (thread dumps, and tests count them)
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True,
                                  name=f"receiver:{self.server_address[1]} {client_address[0]}:{client_address[1]}")
        try:
            thread.start()
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _turn_away(self, request: socket.socket) -> None:
        self._turned_away += 1
        if self._turned_away == 1 or self._turned_away % 100 == 0:  # a flood must not flood the log too
            log.warning("turned away %d connection(s) so far: %d open already (the limit)", self._turned_away,
                        self.max_connections)
        body = json.dumps({"error": f"the receiver has {self.max_connections} connections open (its limit); retry "
                                    f"shortly"}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                f"\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)  # never wait on this client: a fresh socket's buffer takes the answer at once
            request.send(head + body)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            _drain_and_close(request)
            return
        self._lingering.append((time.monotonic() + LINGER_S, request))
        while len(self._lingering) > MAX_LINGERING:
            _drain_and_close(self._lingering.popleft()[1])

    def service_actions(self):
        """Each turn of serve_forever's loop: close the turned-away sockets whose linger is over."""
        super().service_actions()
        now = time.monotonic()
        while self._lingering and self._lingering[0][0] <= now:
            _drain_and_close(self._lingering.popleft()[1])

    def server_close(self):
        super().server_close()
        while self._lingering:
            _drain_and_close(self._lingering.popleft()[1])


def _drain_and_close(sock: socket.socket) -> None:
    """Read what the client sent (non-blocking, a bounded amount), then close: no reset for a well-behaved client."""
    try:
        for _ in range(16):
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass  # nothing more to read now (or the client is gone)
    sock.close()


def serve(receiver: AdapterReceiver, host: str, port: int, api_key: str | None, *,
          socket_timeout_s: float = SOCKET_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> ReceiverServer:
    """A started-on-call server (call `serve_forever()`, or run it on a thread); `server_address` has the port."""
    return ReceiverServer((host, port), make_handler(receiver, api_key, socket_timeout_s), max_connections)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (an unknown name is not)."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def check_args(args: argparse.Namespace, api_key: str | None) -> None:
    """Every flag in range, and no listening beyond loopback without a key; a ConfigError naming the flag."""
    if not api_key and not is_loopback(args.host):
        raise ConfigError("--host", f"{args.host!r} is not a loopback address and {API_KEY_ENV} is not set: anyone "
                                    f"who reaches the port could write files and have them loaded",
                          f"set {API_KEY_ENV} to the trainer's key in the receiver's environment, or listen on "
                          f"--host 127.0.0.1 (an SSH tunnel brings the trainer there)")
    for flag, value, low, high in (("--port", args.port, 0, 65535), ("--keep", args.keep, 0, 10_000),
                                   ("--max-file-bytes", args.max_file_bytes, 1, 1 << 40),
                                   ("--socket-timeout", args.socket_timeout, 0.1, 3600.0),
                                   ("--max-connections", args.max_connections, 1, 4096)):
        if not low <= value <= high:
            raise ConfigError(flag, f"{value} is out of range", f"give {flag} a value from {low} to {high}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.inference_node.receiver", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="local directory the adapters are written to and loaded from")
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="the co-located vLLM server")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"interface to listen on; other than loopback only with {API_KEY_ENV} set (a private "
                             f"network: docs/security.md)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--keep", type=int, default=8, help="versions kept on disk beyond those vLLM serves")
    parser.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES)
    parser.add_argument("--socket-timeout", type=float, default=SOCKET_TIMEOUT_S,
                        help="seconds a connection may stay silent before it is closed")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="connections handled at once; more are answered 503")
    args = parser.parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV) or None  # the environment, never the command line (`ps` shows that)
    try:
        check_args(args, api_key)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")  # before anything is made or bound
    logging.basicConfig(level=logging.INFO, format="%(asctime)s receiver %(levelname)s %(message)s")
    vllm = InferenceClient(args.vllm_url, api_key=api_key)
    receiver = AdapterReceiver(args.dir, vllm, keep=args.keep, max_file_bytes=args.max_file_bytes)
    try:
        server = serve(receiver, args.host, args.port, api_key, socket_timeout_s=args.socket_timeout,
                       max_connections=args.max_connections)
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: cannot listen on {args.host}:{args.port} ({exc.strerror}). Fix: "
                       f"choose a free --port, or stop what holds it\n")
    try:
        with exit_on_signal(lambda: None):  # SIGTERM/SIGHUP too: close the socket, exit 143/129 (nothing to resume)
            log.info("receiving adapters into %s on %s:%d for %s (API key %s)", receiver.root, args.host,
                     server.server_address[1], args.vllm_url, "required" if api_key else "NOT set: loopback only")
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
