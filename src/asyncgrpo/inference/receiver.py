"""The adapter receiver: runs beside vLLM on an inference node that cannot read the trainer's `lora_adapter_path`
(`adapter_delivery: http`), takes each adapter version's files over HTTP, and loads them into the co-located vLLM.

    ASYNCGRPO_VLLM_API_KEY=... python -m asyncgrpo.inference.receiver --dir /local/adapters --port 8001 \\
        --vllm-url http://127.0.0.1:8000

It never reads, writes or loads anything outside `--dir`, and keeps it bounded (`--keep`). Its routes, checks and
refusals: docs/delivery.md.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from asyncgrpo.config import API_KEY_ENV
from asyncgrpo.errors import InferenceServerError
from asyncgrpo.files import fsync_path, sha256_file
from asyncgrpo.inference.client import InferenceClient

log = logging.getLogger(__name__)

MANIFEST_NAME = "asyncgrpo_manifest.json"  # the same file name as store.py's (kept torch-free here)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHUNK = 1 << 20  # bytes read from the socket at a time
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files
DEFAULT_MAX_FILE_BYTES = 16 << 30  # a LoRA of a 70B model at rank 64 is ~1.6 GB in fp32; refuse absurd uploads


class Refused(Exception):
    """A request the receiver answers with a 4xx: `status` and the message sent back."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AdapterReceiver:
    """The receiver's state and rules, without HTTP (the handler below only parses and answers)."""

    def __init__(self, root: str | Path, vllm: InferenceClient | None, *, keep: int = 8,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.vllm = vllm  # None: store only (tests of the refusals need no server)
        self.keep = keep
        self.max_file_bytes = max_file_bytes
        self._lock = threading.Lock()  # one change to the directory (or to vLLM's adapters) at a time
        for stale in self.root.glob(".incoming-*"):  # what a receiver killed midway left
            shutil.rmtree(stale, ignore_errors=True)

    def inside(self, *parts: str) -> Path:
        """`root/parts...` after checking each part's name and the resolved result; a 400 otherwise."""
        for part in parts:
            if not _NAME.match(part):
                raise Refused(400, f"{part!r} is not a valid adapter or file name (letters, digits, '.', '_', '-', "
                                   f"starting with a letter or digit)")
        path = self.root.joinpath(*parts).resolve()
        if not path.is_relative_to(self.root) or path == self.root:
            raise Refused(400, f"{'/'.join(parts)!r} resolves outside the receiver's directory")
        return path

    def staging(self, name: str) -> Path:
        self.inside(name)
        return self.root / f".incoming-{name}"

    def put_file(self, name: str, filename: str, length: int, body) -> int:
        """Stream `length` bytes from `body` into the staging directory of `name`; returns the bytes written."""
        if filename == MANIFEST_NAME:
            raise Refused(400, f"{MANIFEST_NAME} is written by the receiver at commit; do not upload it")
        if length > self.max_file_bytes:
            raise Refused(413, f"{filename}: {length} bytes is more than --max-file-bytes {self.max_file_bytes}")
        self.inside(name, filename)
        with self._lock:
            stage = self.staging(name)
            stage.mkdir(exist_ok=True)
            target = stage / filename
            tmp = stage / f".part-{filename}"
            left = length
            with open(tmp, "wb") as f:
                while left:
                    block = body.read(min(CHUNK, left))
                    if not block:
                        tmp.unlink(missing_ok=True)
                        raise Refused(400, f"{filename}: the body ended after {length - left} of {length} bytes")
                    f.write(block)
                    left -= len(block)
            os.replace(tmp, target)
        return length

    def commit(self, name: str, manifest: dict) -> dict:
        """Check the staged files against `manifest`, then rename them into `root/name` (see the module docstring)."""
        final = self.inside(name)
        files = self._check_manifest(manifest)
        with self._lock:
            stage = self.staging(name)
            if final.is_dir():
                shutil.rmtree(stage, ignore_errors=True)  # a retry's upload: the committed copy stays
                stored = json.loads((final / MANIFEST_NAME).read_text())
                if stored != manifest:
                    raise Refused(409, f"version {name} was already committed with other files; versions are "
                                       f"immutable: publish under a new name")
                return {"path": str(final), "written": False}
            try:
                self._verify(stage, files)
            except Refused:
                shutil.rmtree(stage, ignore_errors=True)  # nothing of a bad upload stays
                raise
            for extra in set(p.name for p in stage.iterdir()) - set(files):
                (stage / extra).unlink()  # only what the manifest vouches for goes live
            (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
            for p in stage.iterdir():
                fsync_path(p)
            fsync_path(stage)
            os.rename(stage, final)
            fsync_path(self.root)
        log.info("committed %s (%d files)", name, len(files))
        return {"path": str(final), "written": True}

    def _check_manifest(self, manifest) -> dict:
        if not isinstance(manifest, dict) or not manifest:
            raise Refused(400, "the commit body must be a non-empty manifest {file: {size, sha256}}")
        for filename, want in manifest.items():
            if not _NAME.match(filename) or filename == MANIFEST_NAME:
                raise Refused(400, f"manifest entry {filename!r} is not a valid file name")
            if not (isinstance(want, dict) and isinstance(want.get("size"), int)
                    and isinstance(want.get("sha256"), str)):
                raise Refused(400, f"manifest entry {filename!r} needs an integer size and a sha256 string")
        return manifest

    @staticmethod
    def _verify(stage: Path, files: dict) -> None:
        for filename, want in files.items():
            path = stage / filename
            if not path.is_file():
                raise Refused(422, f"{filename} was not uploaded (PUT it before the commit)")
            size = path.stat().st_size
            if size != want["size"]:
                raise Refused(422, f"{filename} arrived with {size} bytes, the manifest says {want['size']}")
            digest = sha256_file(path)
            if digest != want["sha256"]:
                raise Refused(422, f"{filename} arrived with sha256 {digest[:16]}..., the manifest says "
                                   f"{want['sha256'][:16]}... (corrupted in transit)")

    def load(self, name: str) -> dict:
        """Serve the committed `root/name` from vLLM as adapter `name`; answer the path vLLM reports."""
        final = self.inside(name)
        if self.vllm is None:
            raise Refused(503, "this receiver was started without --vllm-url")
        with self._lock:
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
        versions = sorted((p for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name)),
                          key=lambda p: p.stat().st_mtime)
        for p in versions[:-self.keep] if self.keep else versions:
            if str(p) not in in_use:
                shutil.rmtree(p, ignore_errors=True)

    def committed(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST_NAME).is_file())


def make_handler(receiver: AdapterReceiver, api_key: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # through logging, not stderr
            log.debug("%s " + fmt, self.address_string(), *args)

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

        def _route(self, method: str) -> None:
            parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
            try:
                if method == "GET" and parts == ["health"]:
                    return self._answer(200, {"status": "ok"})
                self._authorise()
                length = int(self.headers.get("Content-Length") or -1)
                if method == "PUT" and len(parts) == 3 and parts[0] == "adapters":
                    if length < 0:
                        raise Refused(411, "Content-Length is required")
                    return self._answer(200, {"bytes": receiver.put_file(parts[1], parts[2], length, self.rfile)})
                if method == "POST" and len(parts) == 3 and parts[0] == "adapters" and parts[2] == "commit":
                    if not 0 <= length <= MAX_MANIFEST_BYTES:
                        raise Refused(400, "the commit needs a JSON manifest body with a Content-Length")
                    try:
                        manifest = json.loads(self.rfile.read(length) or b"null")
                    except ValueError as exc:
                        raise Refused(400, f"the manifest is not JSON ({exc})") from exc
                    return self._answer(200, receiver.commit(parts[1], manifest))
                if method == "POST" and len(parts) == 3 and parts[0] == "adapters" and parts[2] == "load":
                    return self._answer(200, receiver.load(parts[1]))
                if method == "GET" and parts == ["adapters"]:
                    return self._answer(200, {"committed": receiver.committed()})
                raise Refused(404, f"no route {method} {self.path}")
            except Refused as exc:
                self._answer(exc.status, {"error": str(exc)}, close=True)
            except InferenceServerError as exc:
                self._answer(502, {"error": f"the co-located vLLM refused: {exc}"})

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

    return Handler


def serve(receiver: AdapterReceiver, host: str, port: int, api_key: str | None) -> ThreadingHTTPServer:
    """A started-on-call server (call `serve_forever()`, or run it on a thread); `server_address` has the port."""
    return ThreadingHTTPServer((host, port), make_handler(receiver, api_key))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.inference.receiver", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="local directory the adapters are written to and loaded from")
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="the co-located vLLM server")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (a private network: see SECURITY)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--keep", type=int, default=8, help="versions kept on disk beyond those vLLM serves")
    parser.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s receiver %(levelname)s %(message)s")
    api_key = os.environ.get(API_KEY_ENV) or None  # the environment, never the command line (`ps` shows that)
    vllm = InferenceClient(args.vllm_url, api_key=api_key)
    receiver = AdapterReceiver(args.dir, vllm, keep=args.keep, max_file_bytes=args.max_file_bytes)
    server = serve(receiver, args.host, args.port, api_key)
    log.info("receiving adapters into %s on %s:%d for %s (API key %s)", receiver.root, args.host,
             server.server_address[1], args.vllm_url, "required" if api_key else "NOT set: anyone may upload")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
