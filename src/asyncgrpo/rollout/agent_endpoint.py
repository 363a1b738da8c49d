"""The agent endpoint: OpenAI's `/v1/chat/completions` and `/v1/models` over HTTP, on the rollout side.

Each model name is one live episode (rollout/capture.py serves its calls); a name that is not live answers 404. It
listens on 127.0.0.1 unless `agent_endpoint_host` says otherwise, and then asks for ASYNCGRPO_AGENT_KEY as the bearer
token. One thread per connection: as many calls in flight as the agents make.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from asyncgrpo.rollout.capture import (CaptureEpisode, CaptureRefused, chat_response, check_chat_request,
                                       stream_chunks)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20  # a chat request larger than this is refused before it is read


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a call still running when the run ends does not hold the process
    allow_reuse_address = True
    # Connections waiting to be accepted: every episode in flight opens one, and the OpenAI client gives up on a
    # connect after 5 s; the default backlog of 5 dropped connections of a 2-process demo on a busy host.
    request_queue_size = 1024

    def __init__(self, address, handler, endpoint: AgentEndpoint):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.endpoint = endpoint
        super().__init__(address, handler)


class AgentEndpoint:
    """The HTTP server and the episodes it serves: `register` an episode before its agent runs, `unregister` after."""

    def __init__(self, host: str, port: int, *, temperature: float, top_p: float, key: str | None = None):
        self.temperature, self.top_p, self.key = temperature, top_p, key
        self._episodes: dict[str, CaptureEpisode] = {}
        self._lock = threading.Lock()
        self._server = _Server((host, port), _Handler, self)
        self.port = self._server.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{self.port}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()
        log.info("agent endpoint listening at %s", self.base_url)

    def register(self, episode: CaptureEpisode) -> None:
        with self._lock:
            self._episodes[episode.name] = episode

    def unregister(self, episode: CaptureEpisode) -> None:
        with self._lock:
            self._episodes.pop(episode.name, None)

    def episode(self, model: str) -> CaptureEpisode:
        with self._lock:
            found = self._episodes.get(model)
        if found is None:
            raise CaptureRefused(404, f"the model {model!r} is not a live episode: use the `model` your agent function "
                                 "was called with, while that call runs", param="model", code="model_not_found")
        return found

    def names(self) -> list[str]:
        with self._lock:
            return list(self._episodes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("agent endpoint: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._authorised()
            if self.path.rstrip("/") != "/v1/models":
                raise CaptureRefused(404, f"no route GET {self.path}")
            names = self.server.endpoint.names()
            self._json(200, {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "asyncgrpo"}
                                                         for n in names]})
        except CaptureRefused as exc:
            self._json(exc.status, exc.body())

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._authorised()
            body = self._body()
            if self.path.rstrip("/") != "/v1/chat/completions":
                raise CaptureRefused(404, f"no route POST {self.path}: the agent endpoint serves /v1/chat/completions")
            endpoint = self.server.endpoint
            request = check_chat_request(body, temperature=endpoint.temperature, top_p=endpoint.top_p)
            turn = endpoint.episode(request.model).chat(request)
        except CaptureRefused as exc:
            self._json(exc.status, exc.body())
            return
        except Exception as exc:  # noqa: BLE001 - a bug here must reach the agent (and the log), not hang it
            log.exception("agent endpoint: a call failed")
            self._json(500, CaptureRefused(500, f"{type(exc).__name__}: {exc}").body())
            return
        if not request.stream:
            self._json(200, chat_response(request.model, turn))
            return
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n"
                        for c in stream_chunks(request.model, turn, request.include_usage)) + b"data: [DONE]\n\n"
        self._send(200, data, "text/event-stream")

    def _authorised(self) -> None:
        key = self.server.endpoint.key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise CaptureRefused(401, "missing or wrong API key: send the key in ASYNCGRPO_AGENT_KEY as the client's "
                                 "api_key", code="invalid_api_key")

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise CaptureRefused(413, f"the request body is {length} bytes, over {MAX_BODY_BYTES}")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            raise CaptureRefused(400, "the request body is not JSON") from None

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
