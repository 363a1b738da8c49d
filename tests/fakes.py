"""The fakes the unit tests share: `FakeVLLM` (an `InferenceClient` stand-in, no HTTP), `StubServer` (an HTTP stub of
vLLM on a loopback port) with its routes, `Clock`, `DigitTokenizer`, `ParkingCondition` (says when a producer waits)
and `cfg(**values)` (a toy-world config, its required fields set).

A fake stands in for vLLM only where a real server cannot be made to do what a test needs on demand (a call refused,
a request held or dropped, a restart at a chosen moment); each test module says which. Importable as
`from fakes import FakeVLLM` (pyproject.toml puts tests/ on pytest's `pythonpath`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from asyncgrpo.config import TOY_REWARD, AsyncGRPOConfig
from asyncgrpo.errors import InferenceServerError, ServerUnreachableError


def cfg(**values) -> AsyncGRPOConfig:
    """A validated config of the toy world, named as every config must name its model, prompts and reward
    (`model_name_or_path: toy`; the toy reward beside a dataset of the test's own), with `lora_adapter_path` at
    /tmp/adapters, then `values`."""
    named = {"model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters"}
    if "environment_factory" not in values and "agent_function" not in values:
        named["reward_funcs"] = [TOY_REWARD]
    return AsyncGRPOConfig.from_dict({**named, **values})


class Clock:
    """A fake monotonic clock: call it for the time; `sleep(s)` advances it and records `s` in `sleeps`."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class DigitTokenizer:
    """A tokenizer whose ids 0-9 are the digits."""

    def __len__(self):
        return 10

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


class ParkingCondition(threading.Condition):
    """A producer schedule's condition that records when the producer thread waits on it (its send rule just said
    no): `parked` is set then. Install it as `producer.admission.cond`."""

    def __init__(self):
        super().__init__()
        self.parked = threading.Event()

    def wait(self, timeout=None):
        if threading.current_thread().name == "rollout-producer":
            self.parked.set()
        return super().wait(timeout)


class FakeVLLM:
    """A vLLM server as the code under test sees it through `InferenceClient`, in Python: every method the publisher,
    the recovery, the preflight checks and the producer call, answered as vLLM would, recorded, failed on demand.

    Records: `calls`, in order: ("pause", mode), ("resume",), ("reset",), ("load", name), ("unload", name), ("read",);
    `served` (adapter name -> path); `health_polls` (the clock's time at each health check); `requests` (the
    (adapter, prompt ids) of each generation request). `said()` gives the calls as strings ("load pol-v2").

    Faults: `fail` maps a call ("load", or "load pol-v2" for one adapter) to the exception it raises once recorded;
    `misreport` is the path the read-back reports for every adapter; `on_load(server, name)` runs inside each load
    and `on_health(server)` inside each health check (to hold them); the server is down (each call raises
    ServerUnreachableError, unrecorded) until `clock()` reaches `back_at`, for good when `back_at` is None;
    `crash(back_at)` restarts it knowing no adapters; `restart_on` and `lose_answer_of` name the call ("load p-v2")
    at which it restarts (back `restart_s` later) or acts but loses the answer; `hold=True` keeps each generation
    request until `release()` lets it through. Like vLLM, a load of a name it serves answers 400 and an unload of a
    name it does not serve 404 (`strict=False`: both just succeed).
    """

    def __init__(self, url: str = "http://fake:8000", *, clock: Callable[[], float] | None = None,
                 back_at: float | None = 0.0, fail: dict | None = None, misreport: str | None = None,
                 on_load: Callable[[FakeVLLM, str], None] | None = None,
                 on_health: Callable[[FakeVLLM], object] | None = None, strict: bool = True, hold: bool = False,
                 lora: dict | None = None, dev_mode: bool = True, lora_updating: bool = True,
                 vllm_version: str = "0.32.0", root: str = "/models/m", paused: bool = False,
                 logprobs_mode: str = "processed_logprobs", processed_scale: float = 2.0):
        self.base_url = url
        self.clock = clock or (lambda: 0.0)
        self.back_at = back_at
        self.fail = fail or {}
        self.misreport = misreport
        self.on_load, self.on_health = on_load, on_health
        self.strict = strict
        self.restart_on: str | None = None
        self.restart_s = 3.0
        self.lose_answer_of: str | None = None
        self.calls: list[tuple] = []
        self.served: dict[str, str] = {}
        self.health_polls: list[float] = []
        self.paused = paused
        self.paused_event = threading.Event()
        # what /server_info, /version and /v1/models tell the preflight checks
        self.lora, self.dev_mode, self.lora_updating = lora, dev_mode, lora_updating
        self.vllm_version, self.root = vllm_version, root
        self.logprobs_mode, self.processed_scale = logprobs_mode, processed_scale
        self.load = None  # what server_load() reports (a ServerLoad; None: /metrics unreadable)
        # generation requests, held until released when `hold`
        self.requests: list[tuple[str, list[int]]] = []
        self.held = 0
        self._released = 0 if hold else float("inf")
        self._cond = threading.Condition()

    # ---- state and faults --------------------------------------------------------------------------------------------
    def up(self) -> bool:
        return self.back_at is not None and self.clock() >= self.back_at

    def crash(self, back_at: float | None) -> None:
        """Die now; come back at `back_at` (never when None) as a fresh server that serves no adapters."""
        self.back_at, self.served = back_at, {}

    def said(self) -> list[str]:
        return [" ".join(str(part) for part in call) for call in self.calls]

    def _call(self, *call) -> None:
        what = " ".join(str(part) for part in call)
        if not self.up():
            raise ServerUnreachableError(f"{what}: cannot reach {self.base_url}")
        self.calls.append(call)
        if what == self.restart_on:
            self.restart_on, self.served = None, {}
            self.back_at = self.clock() + self.restart_s
            raise ServerUnreachableError(f"{what}: connection refused by {self.base_url}")
        for key in (what, call[0]):
            if key in self.fail:
                raise self.fail[key]

    def _answer(self, *call) -> None:
        what = " ".join(call)
        if what == self.lose_answer_of:
            self.lose_answer_of = None
            raise ServerUnreachableError(f"{what}: connection reset before the answer")

    # ---- what the publisher and the recovery call --------------------------------------------------------------------
    def health(self) -> bool:
        self.health_polls.append(self.clock())
        if self.on_health is not None:
            self.on_health(self)
        return self.up()

    def pause(self, mode="keep"):
        self._call("pause", mode)
        self.paused = True
        self.paused_event.set()

    def resume(self):
        self._call("resume")
        self.paused = False

    def reset_prefix_cache(self):
        self._call("reset")
        return True

    def load_adapter(self, name, path, inplace=False):
        self._call("load", name)
        if self.on_load is not None:
            self.on_load(self, name)
        if self.strict and name in self.served:
            raise InferenceServerError(f"{name} is already loaded", status=400)  # as vLLM answers
        self.served[name] = str(path)
        self._answer("load", name)

    def unload_adapter(self, name):
        self._call("unload", name)
        if self.served.pop(name, None) is None and self.strict:
            raise InferenceServerError(f"{name} not found", status=404)

    def adapter_paths(self):
        self._call("read")
        return {name: (self.misreport or path) for name, path in self.served.items()}

    # ---- what the preflight checks call ------------------------------------------------------------------------------
    def server_config(self):
        if not self.dev_mode:
            return None  # no /server_info without VLLM_SERVER_DEV_MODE
        return {"lora_config": self.lora, "model_config": {"logprobs_mode": self.logprobs_mode}}

    def has_route(self, method, path):
        return {"/is_paused": self.dev_mode, "/v1/load_lora_adapter": self.lora_updating}[path]

    def version(self):
        return self.vllm_version

    def models(self):
        return [{"id": self.root, "root": self.root, "parent": None}]

    def server_load(self):
        return self.load

    def base_model(self):
        return self.root

    def is_paused(self):
        if not self.dev_mode:
            raise InferenceServerError("is_paused: 404", status=404, body='{"detail":"Not Found"}')
        return self.paused

    def first_token_logprobs(self, model, prompt, *, temperature, top=5):
        raw = {"5": -0.2, "7": -1.9, "9": -3.0}
        if self.logprobs_mode == "raw_logprobs" or temperature == 1.0:
            return raw
        return {k: v * self.processed_scale for k, v in raw.items()}  # stands in for the sharper processed one

    # ---- what the producer calls -------------------------------------------------------------------------------------
    def complete(self, adapter, prompt_ids, *, n, max_tokens, temperature, top_p, seed):
        """Completion 0 is token 7 ("7"), the others token 3, completion i at logprob -0.25 * (i + 1). With `hold`,
        request k (in arrival order) answers once `release` has let k requests through."""
        with self._cond:
            self.requests.append((adapter, list(prompt_ids)))
            mine = len(self.requests)
            self.held += 1
            self._cond.wait_for(lambda: self._released >= mine)
            self.held -= 1
        return [SimpleNamespace(token_ids=[7 if i == 0 else 3], logprobs=[-0.25 * (i + 1)], finish_reason="stop",
                                text="", model=adapter) for i in range(n)]

    def release(self, k: int | float = float("inf")) -> None:
        with self._cond:
            self._released += k
            self._cond.notify_all()


# ---- vLLM over HTTP -------------------------------------------------------------------------------------------------
# A route answers (status, content type, body), or None to drop the connection without answering.
Route = Callable[["StubServer", BaseHTTPRequestHandler], "tuple[int, str, str] | None"]


class StubServer:
    """An HTTP server (http.server on 127.0.0.1, an ephemeral port unless `port`, in a thread) that records each
    request in `requests` and answers through `route`; the `stubs` fixture (tests/unit/conftest.py) starts them."""

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


def answer(body: dict, token_ids: list[list[int]], finish_reasons: list[str] | None = None,
           logprob: float = -0.5) -> tuple[int, str, str]:
    """A /v1/completions answer to `body`: completion i samples `token_ids[i]`, each token at `logprob`."""
    finish_reasons = finish_reasons or ["stop"] * len(token_ids)
    choices = [{"index": i, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": [logprob] * len(ids)},
                "finish_reason": reason} for i, (ids, reason) in enumerate(zip(token_ids, finish_reasons))]
    return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})


def generation(reply: Callable[[dict], "tuple[int, str, str] | None"]) -> Route:
    """A route for a producer's server: /health answers 200, each generation request `reply(its JSON body)`. As a
    decorator: `@generation` over `def route(body): ...`."""

    def route(stub, handler):
        if handler.path == "/health":
            return 200, "text/plain", ""
        return reply(json.loads(handler.body))

    return route


@generation
def sevens(body):
    """A route: health answers, every completion is "7"."""
    return answer(body, [[7]] * body["n"])
