"""An in-process HTTP stub server (http.server on 127.0.0.1, an ephemeral port, in a thread) for client tests of what
a real vLLM server cannot be made to do on demand; each test module says what it stands in for."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# A route answers (status, content type, body), or None to drop the connection without answering.
Route = Callable[["StubServer", BaseHTTPRequestHandler], "tuple[int, str, str] | None"]


class StubServer:
    """An HTTP server in a thread that records each request and answers through `route`."""

    def __init__(self, route: Route, port: int = 0):
        self.route = route
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                stub.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                      "body": body})  # fmt: skip
                self.body = body  # this request's own body (stub.requests[-1] may be another thread's)
                answer = stub.route(stub, self)
                if answer is None:
                    self.close_connection = True  # hang up without a status line
                    return
                status, content_type, text = answer
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)  # quick shutdown
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    started: list[StubServer] = []

    def start(route: Route, port: int = 0) -> StubServer:
        started.append(StubServer(route, port))
        return started[-1]

    yield start
    for stub in started:
        stub.close()

