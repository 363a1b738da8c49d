"""The load generator of `asyncgrpo bench producer`: an HTTP server, in a process of its own, that answers
`POST /v1/completions` at once with fixed completions in vLLM's answer shape.

    python -m asyncgrpo.bench.loadgen [--port 0] < spec.json     # prints "listening PORT" once it accepts requests

Standard library only, so that it starts fast and shares nothing (GIL included) with the process it loads. The spec
and the answers: docs/benchmarks.md ("`bench producer` and its load generator").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def choice_parts(completion: dict, index: int, max_tokens: int) -> tuple[str, str, int]:
    """One choice's JSON in two halves, around its `prompt_token_ids` value (the one part that differs between
    requests), and its token count."""
    ids = completion["token_ids"][:max_tokens]
    cut = len(ids) < len(completion["token_ids"])
    tokens = completion["tokens"][:len(ids)]
    logprobs = completion["logprobs"][:len(ids)]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    choice = {
        "index": index, "text": "".join(tokens) if cut else completion["text"],
        "logprobs": {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                     "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)]},
        "finish_reason": "length" if cut else completion["finish_reason"], "stop_reason": None,
        "token_ids": ids, "prompt_logprobs": None,
    }
    head = json.dumps(choice)[:-1] + ', "prompt_token_ids": '
    return head, "}", len(ids)


class Answers:
    """Answer bodies for the spec's completions, their choices serialised once per (n, max_tokens)."""

    def __init__(self, completions: list[dict]):
        assert completions, "the spec needs at least one completion"
        self.completions = completions
        self._choices: dict[tuple[int, int], tuple[list[tuple[str, str]], int]] = {}
        self._lock = threading.Lock()
        self.requests = 0
        self.tokens = 0

    def body(self, request: dict) -> bytes:
        n, max_tokens = int(request.get("n", 1)), int(request["max_tokens"])
        key = (n, max_tokens)
        with self._lock:
            if key not in self._choices:
                parts = [choice_parts(self.completions[i % len(self.completions)], i, max_tokens) for i in range(n)]
                self._choices[key] = ([(h, t) for h, t, _ in parts], sum(k for _, _, k in parts))
            choices, tokens = self._choices[key]
            self.requests += 1
            self.tokens += tokens
        prompt = json.dumps(request.get("prompt", []))
        prompt_tokens = len(request.get("prompt", []))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        return "".join([
            '{"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": ',
            json.dumps(request.get("model", "")), ', "choices": [',
            ", ".join(head + prompt + tail for head, tail in choices),
            '], "usage": ', json.dumps(usage), "}"]).encode()


def make_server(answers: Answers, port: int = 0) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving) on 127.0.0.1:`port` (0: a free one); keep-alive, a thread per connection."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connections, as it does with vLLM

        def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/stats":
                self._send(200, json.dumps({"requests": answers.requests, "tokens": answers.tokens}).encode())
            else:
                self._send(404, b'{"detail": "Not Found"}')

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if self.path != "/v1/completions":
                self._send(404, b'{"detail": "Not Found"}')
                return
            self._send(200, answers.body(json.loads(body)))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.bench.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    answers = Answers(json.load(sys.stdin)["completions"])
    with make_server(answers, args.port) as server, contextlib.suppress(KeyboardInterrupt):  # exit: server_close
        print(f"listening {server.server_address[1]}", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
