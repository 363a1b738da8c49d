"""HTTP client for a vLLM inference node: completions with exact token ids and logprobs, LoRA adapter hot reload,
pause/resume.

Every answer is checked: a failure raises InferenceServerError naming the call, the URL and the HTTP status, with the
server's body verbatim. An unreachable server is retried with backoff, then reported with the fix. The server needs
the flags of `launch/vllm/serve.sh` (or `VLLMServer`); docs/publish-internals.md says why each.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from urllib3.exceptions import NewConnectionError

from asyncgrpo.config import API_KEY_ENV
from asyncgrpo.errors import AdapterNotLoadedError, InferenceServerError, ServerUnreachableError
from asyncgrpo.inference.server_load import ServerLoad, parse_server_load
from asyncgrpo.redact import redact

logger = logging.getLogger(__name__)

try:  # msgspec (vLLM installs it) parses a completions answer (~130 KB for 8 x 256 tokens) ~3x faster than json
    from msgspec import DecodeError as _FastJSONError
    from msgspec.json import decode as _fast_json
except ImportError:  # pragma: no cover - the standard parser does the same, slower
    _fast_json = None

CONNECT_TIMEOUT_S = 5.0  # a reachable server accepts a TCP connection in milliseconds, even across a cluster network
HEALTH_TIMEOUT_S = 5.0  # /health answers in milliseconds; one slower than this counts as unhealthy
ADMIN_TIMEOUT_S = 60.0  # adapter load/unload, models, pause, resume: ~4-30 ms on CPU; seconds for a big adapter on NFS
CONNECT_RETRIES = 5  # attempts after the first on a connection error or a 503 (a longer outage is recovery.py's)
CONNECT_BACKOFF_S = 0.5  # the first wait between attempts, doubling after each
HEALTH_POLL_S = 0.25  # wait_healthy's poll interval: start-up takes ~30 s on CPU, minutes on a GPU node
RETRY_STATUSES = frozenset({503})  # vLLM's "not now" (elastic scaling); every other HTTP error is final
MAX_QUOTED_CHARS = 4000  # error messages quote at most this much of a body (vLLM tracebacks can be long)
PAUSE_MODES = ("abort", "wait", "keep")
_DEV_MODE = "If the route itself is missing, start the server with VLLM_SERVER_DEV_MODE=1 (asyncgrpo.inference_node.vllm_server does)"
_LORA_UPDATES = ("If the route itself is missing (not a missing adapter directory), start the server with --enable-lora and "
                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (asyncgrpo.inference_node.vllm_server and launch/vllm/serve.sh do)")
FLAG_HINTS = {  # what a 404 from these calls most often means: the server was started without the flag
    "pause": _DEV_MODE, "resume": _DEV_MODE, "is_paused": _DEV_MODE, "reset_prefix_cache": _DEV_MODE,
    "load_adapter": _LORA_UPDATES, "unload_adapter": _LORA_UPDATES,
}

START_HINT = (
    "Start the server (`python -m asyncgrpo.inference_node.vllm_server --model MODEL --port PORT` here, "
    "`launch/vllm/serve.sh` on an inference node) or fix `vllm_server_base_url`."
)


# Every sampling field the server would otherwise fill in itself, at its neutral value. vLLM fills a field a request
# leaves out from the model's generation_config.json (`--generation-config auto`, its default; Qwen2.5-Instruct ships
# top_k 20 and repetition_penalty 1.05), and its logprobs are then those of the truncated, penalised distribution
# while the trainer scores the full softmax. Sending them all keeps the sampled distribution the one the loss models,
# whatever the server's defaults; `doctor` also checks that the server applies none (`--generation-config vllm`).
NEUTRAL_SAMPLING = {
    "top_k": -1,  # no top-k truncation (vLLM >= 0.10 prefers 0 and still accepts -1; older versions want -1)
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def sampling_fields(temperature: float, top_p: float) -> dict[str, Any]:
    """The sampling part of a /v1/completions body: temperature, top_p and every other field at its neutral value."""
    return {"temperature": temperature, "top_p": top_p, **NEUTRAL_SAMPLING}


@dataclass
class Completion:
    """One sampled completion: the generated token ids exactly as sampled (EOS included when it stopped on EOS),
    the server's logprob of each of them under the sampling distribution, and the adapter/model that served it."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or a stop token), "length" (max_tokens), "abort" (/pause?mode=abort)
    model: str


class InferenceClient:
    """Client for one vLLM OpenAI-compatible server. Safe to share between threads: each thread has a requests.Session
    of its own while it runs (a Session is not documented as thread-safe), handed on to a later thread when it ends;
    the calls may overlap on the server.

    `timeout_s` bounds calls that last as long as generation does: completions and `pause(mode="wait")`.
    Environment proxies and ~/.netrc are ignored (`trust_env = False`): the inference node is on a private
    network, and a netrc entry would replace the bearer token.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        connect_retries: int = CONNECT_RETRIES,
        backoff_s: float = CONNECT_BACKOFF_S,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_retries = connect_retries
        self.backoff_s = backoff_s
        self._api_key = api_key
        self._local = threading.local()
        self._sessions: list[requests.Session] = []  # every session made (closed by close())
        self._idle: deque[requests.Session] = deque()  # sessions whose thread has ended, free for a new thread
        self._sessions_lock = threading.Lock()

    @property
    def _session(self) -> requests.Session:
        """This thread's session: one a finished thread left (its keep-alive connection still open), else a new one.
        The producer makes a thread per request: without the hand-over each request would open a connection of its
        own and leave it open (one socket per request for the client's lifetime)."""
        holder = getattr(self._local, "holder", None)
        if holder is not None:
            return holder.session
        try:
            session = self._idle.pop()  # deque.pop is atomic: no lock needed
        except IndexError:
            session = requests.Session()
            session.trust_env = False
            if self._api_key:
                session.headers["Authorization"] = f"Bearer {self._api_key}"
            with self._sessions_lock:
                self._sessions.append(session)
        holder = self._local.holder = _SessionHolder(session)
        # When this thread ends its thread-local holder is freed and the session goes back to the idle ones (unless
        # the client was closed meanwhile). The callback holds no lock: it may run in any thread.
        weakref.finalize(holder, _release, self._sessions, self._idle, session).atexit = False  # nothing to do then
        return session

    def __repr__(self) -> str:
        return f"InferenceClient({self.base_url!r}, api_key={'***' if self._api_key else None})"

    def close(self) -> None:
        with self._sessions_lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()
            self._idle.clear()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- health and read-back ------------------------------------------------------------------------

    def health(self) -> bool:
        """True when `GET /health` answers 200 now (no retries)."""
        try:
            resp = self._session.get(f"{self.base_url}/health", timeout=(CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S))
        except requests.RequestException:
            return False
        return resp.status_code == 200

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll `/health` until it answers 200; return the seconds waited. Raises InferenceServerError at the
        deadline."""
        start = time.monotonic()
        deadline = start + timeout_s
        while not self.health():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceServerError(
                    f"no healthy vLLM server at {self.base_url}/health within {timeout_s:g} s. {START_HINT}"
                )
            time.sleep(min(HEALTH_POLL_S, remaining))
        return time.monotonic() - start

    def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models` data: the base model (`parent` None) and each loaded adapter (`root` = its path)."""
        return self._json("models", self._request("models", "GET", "/v1/models"))["data"]

    def adapter_paths(self) -> dict[str, str]:
        """Loaded LoRA adapters by name -> the path the server loaded each from (read back what is served)."""
        return {m["id"]: m["root"] for m in self.models() if m.get("parent") is not None}

    def base_model(self) -> str:
        """The base model's name on the server (what `--model` was given)."""
        for m in self.models():
            if m.get("parent") is None:
                return m["id"]
        raise InferenceServerError(f"models: {self.base_url}/v1/models lists no base model (every entry has a parent)")

    def version(self) -> str:
        """The server's vLLM version (`GET /version`), e.g. "0.32.0"."""
        return str(self._json("version", self._request("version", "GET", "/version")).get("version", "unknown"))

    def has_route(self, method: str, path: str) -> bool:
        """Whether the server has the route at all: an empty body gets a validation error (4xx other than 404)
        from a route that exists, and FastAPI's plain 404 `{"detail": "Not Found"}` from one that does not
        (vLLM adds its adapter and dev-mode routes only when their environment variable is set)."""
        try:
            self._request(f"route {path}", method, path, body={} if method == "POST" else None)
        except InferenceServerError as exc:
            if exc.status == 404 and '"Not Found"' in (exc.body or ""):
                return False
            if exc.status is None or exc.status == 401:
                raise
        return True

    def server_load(self) -> ServerLoad | None:
        """Sequences running and waiting and the KV cache in use now, from vLLM's Prometheus `GET /metrics`; None
        when it cannot be read (no answer within HEALTH_TIMEOUT_S, no such route, not vLLM's metrics)."""
        try:
            resp = self._session.get(f"{self.base_url}/metrics", timeout=(CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S))
        except requests.RequestException:
            return None
        return parse_server_load(resp.text) if resp.status_code == 200 else None

    def server_config(self) -> dict[str, Any] | None:
        """The server's engine configuration (`GET /server_info`, a dev-mode route), or None where the route is
        absent (a server started without VLLM_SERVER_DEV_MODE=1)."""
        try:
            resp = self._request("server_info", "GET", "/server_info", params={"config_format": "json"})
        except InferenceServerError as exc:
            if exc.status == 404:
                return None
            raise
        return self._json("server_info", resp).get("vllm_config")

    # ---- generation ----------------------------------------------------------------------------------

    def complete(
        self,
        model: str,
        prompt_token_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of one tokenized prompt with `model` (base model or adapter name).

        Returns them in choice order, each with its exact token ids and one logprob per token.
        A per-request `seed` can crash the CPU engine under chunked prefill: see docs/cpu-hosts.md, "Seeded requests".
        """
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt_token_ids),
            "n": n,
            "max_tokens": max_tokens,
            **sampling_fields(temperature, top_p),
            "logprobs": 0,  # the sampled token's own logprob, no alternatives
            "return_token_ids": True,  # choices[i].token_ids: exact ids, EOS included; no re-tokenizing text
        }
        if seed is not None:
            body["seed"] = seed
        body.update(extra or {})
        resp = self._post_completion(model, body)
        data = self._json("complete", resp, fast=True)
        return [self._completion(choice, data.get("model", model), resp.url) for choice in
                sorted(data["choices"], key=lambda c: c["index"])]  # fmt: skip

    def complete_until(
        self,
        model: str,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        interrupted: Callable[[], bool],
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`complete` for one or more tokenized prompts, streamed, reading until every choice ends or `interrupted()`
        turns true (asked after each chunk); then it closes the stream, and vLLM aborts what it was still sampling.

        Returns len(prompts) x n completions in order (prompt p's i-th at p * n + i), each with every token read so
        far and its logprob; one cut off here has finish_reason "" (one the server aborted, "abort": a pause in
        abort mode). Its tokens are whole: a stream chunk carries a token's id and logprob together."""
        body: dict[str, Any] = {"model": model, "prompt": [list(p) for p in prompts], "n": n,
                                "max_tokens": max_tokens, **sampling_fields(temperature, top_p), "logprobs": 0,
                                "return_token_ids": True, "stream": True}
        if seed is not None:
            body["seed"] = seed
        body.update(extra or {})
        out = [Completion([], [], "", "", model) for _ in range(len(prompts) * n)]
        resp = self._post_completion(model, body, stream=True)
        with resp:  # leaving it closes the connection: the server aborts whatever it still generates
            try:
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    self._stream_chunk(self._chunk_json(line[6:], resp.url), out, resp.url)
                    if all(c.finish_reason for c in out) or interrupted():
                        break
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                raise self._error(f"complete: the stream from {resp.url} broke ({_reason(exc)})",
                                  unreachable=True) from exc
        return out

    def _post_completion(self, model: str, body: dict[str, Any], stream: bool = False) -> requests.Response:
        """POST /v1/completions; a 404 naming `model` as unknown (vLLM's text) is AdapterNotLoadedError."""
        try:
            return self._request("complete", "POST", "/v1/completions", body=body, read_timeout_s=self.timeout_s,
                                 stream=stream)
        except InferenceServerError as exc:
            if exc.status == 404 and f"`{model}` does not exist" in (exc.body or ""):
                raise AdapterNotLoadedError(str(exc), status=exc.status, body=exc.body) from exc
            raise

    def _chunk_json(self, data: bytes, url: str) -> dict[str, Any]:
        try:
            return _fast_json(data) if _fast_json is not None else json.loads(data)
        except ValueError as exc:  # msgspec's DecodeError is a ValueError
            raise self._error(f'complete: {url} streamed a chunk that is not JSON: "{data[:MAX_QUOTED_CHARS]!r}"'
                              ) from exc

    def _stream_chunk(self, chunk: dict[str, Any], out: list[Completion], url: str) -> None:
        """Add one stream chunk's tokens and finish reasons to `out`."""
        if "error" in chunk:
            raise self._error(f"complete: {url} failed mid-stream: {chunk['error']}", body=str(chunk["error"]))
        for choice in chunk.get("choices", ()):
            c = out[choice["index"]]
            ids = choice.get("token_ids") or []
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(ids) != len(lps):
                raise InferenceServerError(f"complete: {url} streamed {len(ids)} token ids but {len(lps)} logprobs "
                                           f"for choice {choice['index']}")
            c.token_ids.extend(map(int, ids))
            c.logprobs.extend(map(float, lps))
            c.text += choice.get("text") or ""
            c.finish_reason = choice.get("finish_reason") or c.finish_reason

    @staticmethod
    def _completion(choice: dict[str, Any], model: str, url: str) -> Completion:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None:
            raise InferenceServerError(
                f"complete: {url} returned no token_ids/logprobs for choice {choice.get('index')} "
                "(the server ignored `return_token_ids`/`logprobs`: it needs vLLM >= 0.10.2)"
            )
        if len(token_ids) != len(logprobs):
            raise InferenceServerError(
                f"complete: {url} returned {len(token_ids)} token ids but {len(logprobs)} logprobs "
                f"for choice {choice.get('index')}"
            )
        return Completion(
            token_ids=list(map(int, token_ids)),  # map: the same conversions, ~2x faster than a comprehension
            logprobs=list(map(float, logprobs)),
            text=choice.get("text", ""),
            finish_reason=choice.get("finish_reason") or "",
            model=model,
        )

    def score(self, model: str, token_ids: list[int]) -> list[float | None]:
        """The server's logprob of each token of a fixed sequence under `model` (None for the first token),
        via `prompt_logprobs`: how a policy-equivalence check reads what the server would have sampled."""
        body = {"model": model, "prompt": list(token_ids), "max_tokens": 1, **sampling_fields(1.0, 1.0),
                "prompt_logprobs": 0}
        data = self._json("score", self._request("score", "POST", "/v1/completions", body=body,
                                                 read_timeout_s=self.timeout_s))
        entries = data["choices"][0].get("prompt_logprobs")
        if entries is None or len(entries) != len(token_ids):
            raise InferenceServerError(f"score: {self.base_url} returned no prompt_logprobs for {len(token_ids)} "
                                       f"tokens (needs vLLM with prompt_logprobs support)")
        out: list[float | None] = [None]
        for tok, entry in zip(token_ids[1:], entries[1:]):
            out.append(float(entry[str(tok)]["logprob"]))
        return out

    def next_token_logprobs(self, model: str, prompt_token_ids: list[int], *, k: int,
                            sampling: dict[str, Any]) -> dict[int, float]:
        """The `k` most likely next tokens after the prompt and the server's logprob of each (token id -> logprob),
        under exactly the sampling fields in `sampling` (nothing else is sent: omitted fields get the server's
        defaults). What `doctor` compares to see whether the server applies defaults of its own."""
        body = {"model": model, "prompt": list(prompt_token_ids), "max_tokens": 1, "logprobs": k,
                "return_tokens_as_token_ids": True, **sampling}  # keys "token_id:N": no decoding, no collisions
        data = self._json("next_token_logprobs", self._request("next_token_logprobs", "POST", "/v1/completions",
                                                               body=body, read_timeout_s=self.timeout_s))
        top = ((data["choices"][0].get("logprobs") or {}).get("top_logprobs") or [None])[0]
        if not top:
            raise InferenceServerError(f"next_token_logprobs: {self.base_url} returned no top_logprobs")
        return {int(key.rsplit(":", 1)[-1]): float(lp) for key, lp in top.items()}

    def first_token_logprobs(self, model: str, prompt_token_ids: list[int], *, temperature: float,
                             top: int = 5) -> dict[int, float]:
        """The `top` most likely first tokens after a prompt and their logprobs as the server reports them at
        `temperature`, every other sampling field neutral. Raw logprobs do not depend on the temperature; processed
        ones (`--logprobs-mode processed_logprobs`) do: how `doctor` tells the two apart on a server without dev
        mode."""
        return self.next_token_logprobs(model, prompt_token_ids, k=top,
                                        sampling={**NEUTRAL_SAMPLING, "temperature": temperature, "top_p": 1.0})

    # ---- adapters ------------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path, *, inplace: bool = False) -> None:
        """Serve the PEFT adapter in `path` as `name`; `path` is read by the server, not by us.

        Without `inplace`, a name already loaded is an error (400). `inplace=True` replaces the weights of a
        loaded `name` (and loads a name that is not loaded yet). What vLLM 0.32 does with it (measured):
        - requests already running on `name` may continue with the new weights mid-sequence; a fresh name
          (or unload + load, which gets a new adapter id) keeps them on the old weights;
        - vLLM remembers the flag: requests sent after an in-place load re-read their adapter from `path` at
          every engine step. Keep `path` until no such request can be running: a missing directory kills
          the engine (every later request answers 500)."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
        # A retried in-place load is harmless; a retried fresh load would answer 400 "already loaded".
        self._request("load_adapter", "POST", "/v1/load_lora_adapter", body=body, idempotent=inplace)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (404 if it is not loaded)."""
        self._request("unload_adapter", "POST", "/v1/unload_lora_adapter", body={"lora_name": name}, idempotent=False)

    # ---- pause / resume ------------------------------------------------------------------------------

    def pause(self, mode: str = "keep") -> None:
        """Pause generation. `keep`: in-flight requests freeze and complete normally after `resume` (with
        whatever weights are loaded then); `wait`: returns once they have finished; `abort`: they end now and
        answer 200 with finish_reason "abort" and the tokens made so far. Requests sent while paused wait.
        Always pair with `resume` in `finally`: a paused server holds every request."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        timeout = self.timeout_s if mode == "wait" else ADMIN_TIMEOUT_S  # "wait" lasts as long as generation
        self._request("pause", "POST", "/pause", params={"mode": mode}, read_timeout_s=timeout)

    def resume(self) -> None:
        self._request("resume", "POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._json("is_paused", self._request("is_paused", "GET", "/is_paused"))["is_paused"])

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Drop cached prefix blocks (they may hold KV computed with an adapter's previous weights).

        Returns vLLM's `success`: False while running or frozen requests still hold blocks, unless
        `reset_running_requests` (which makes vLLM recompute those requests)."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        resp = self._request("reset_prefix_cache", "POST", "/reset_prefix_cache", params=params)
        return bool(self._json("reset_prefix_cache", resp).get("success"))

    # ---- transport -----------------------------------------------------------------------------------

    def _request(
        self,
        call: str,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        read_timeout_s: float = ADMIN_TIMEOUT_S,
        idempotent: bool = True,
        stream: bool = False,
    ) -> requests.Response:
        """One call with retries on unreachable servers and 503; any other failure raises InferenceServerError.

        A connection that breaks after the request went out is retried only when `idempotent`: the server may
        have applied the request already."""
        url = f"{self.base_url}{path}"
        attempts = self.connect_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                resp = self._session.request(
                    method, url, json=body, params=params, timeout=(CONNECT_TIMEOUT_S, read_timeout_s), stream=stream
                )
            except requests.ReadTimeout as exc:
                raise self._error(
                    f"{call}: {method} {url} got no answer within {read_timeout_s:g} s; the server is overloaded "
                    f"or stuck (is it paused? GET {self.base_url}/is_paused; if true, resume it with "
                    f"`curl -X POST {self.base_url}/resume`). Raise vllm_request_timeout for long generations"
                ) from exc
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                # ChunkedEncodingError: the server died while it was sending its answer
                sent = not _never_connected(exc)
                if sent and not idempotent:
                    raise self._error(
                        f"{call}: the connection to {url} broke after the request was sent ({_reason(exc)}); the "
                        "server may or may not have applied it: read back with adapter_paths()",
                        unreachable=True,
                    ) from exc
                if attempt == attempts:
                    raise self._error(
                        f"{call}: cannot reach {url} after {attempts} attempts ({_reason(exc)}). {START_HINT}",
                        unreachable=True,
                    ) from exc
                what = f"connection failed ({_reason(exc)})"
            except requests.RequestException as exc:
                raise self._error(f"{call}: {method} {url} failed: {exc}") from exc
            else:
                if resp.status_code not in RETRY_STATUSES or attempt == attempts:
                    if not resp.ok:
                        raise self._http_error(call, method, url, resp)
                    return resp
                what = f"HTTP {resp.status_code}"
            delay = self.backoff_s * 2 ** (attempt - 1)
            # Debug: a dead server makes every call in flight retry; the outage is logged once (recovery.py).
            logger.debug("%s: %s %s: %s; retry %d/%d in %.1f s", call, method, url, what, attempt,
                         attempts - 1, delay)  # fmt: skip
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _http_error(self, call: str, method: str, url: str, resp: requests.Response) -> InferenceServerError:
        text = redact(resp.text, self._api_key)  # before the cut: a cut could leave a part of the key unrecognised
        quoted = text if len(text) <= MAX_QUOTED_CHARS else f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} chars)"
        message = f'{call}: {method} {url} answered HTTP {resp.status_code} {resp.reason}: "{quoted}"'
        if resp.status_code == 401:
            message += (f". The server wants an API key (vLLM --api-key / VLLM_API_KEY): set {API_KEY_ENV} to the "
                        f"same key in the trainer's environment" if not self._api_key else
                        f". The server refused the API key in {API_KEY_ENV}: set it to the key the server was "
                        f"started with (vLLM --api-key / VLLM_API_KEY)")
        elif resp.status_code == 404 and call in FLAG_HINTS:
            message += f". {FLAG_HINTS[call]}"
        return self._error(message, status=resp.status_code, body=text)

    def _json(self, call: str, resp: requests.Response, fast: bool = False) -> dict[str, Any]:
        """The answer's JSON; `fast`: with msgspec where it is installed (the same objects), falling back to the
        standard parser for what msgspec refuses (e.g. the NaN and Infinity literals Python's json writes)."""
        if fast and _fast_json is not None:
            try:
                return _fast_json(resp.content)
            except _FastJSONError:
                pass
        try:
            return resp.json()
        except ValueError as exc:
            raise self._error(
                f'{call}: {resp.request.method} {resp.url} answered {resp.status_code} with a body that is not '
                f'JSON: "{redact(resp.text, self._api_key)[:MAX_QUOTED_CHARS]}"',
                status=resp.status_code, body=resp.text,
            ) from exc  # fmt: skip

    def _error(self, message: str, status: int | None = None, body: str | None = None,
               unreachable: bool = False) -> InferenceServerError:
        """An InferenceServerError (ServerUnreachableError when no answer came) with the API key, any 8-character run
        of it and of its encodings, scrubbed from everything it carries (redact.py)."""
        message = redact(message, self._api_key)
        body = redact(body, self._api_key) if body is not None else None
        kind = ServerUnreachableError if unreachable else InferenceServerError
        return kind(message, status=status, body=body)


class _SessionHolder:
    """What a thread's local storage holds: its session. Freed with the thread, which hands the session back."""

    __slots__ = ("session", "__weakref__")

    def __init__(self, session: requests.Session):
        self.session = session


def _release(sessions: list[requests.Session], idle: deque, session: requests.Session) -> None:
    """A thread that used `session` ended: keep it for the next thread, unless the client was closed since."""
    if any(s is session for s in sessions):
        idle.append(session)


def _never_connected(exc: requests.ConnectionError) -> bool:
    """True when no TCP connection was made (refused, unresolvable, connect timeout): nothing reached the server."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, NewConnectionError)


def _reason(exc: requests.RequestException) -> str:
    """The short cause of a requests failure ("[Errno 111] Connection refused") instead of its long repr."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    text = str(reason if reason is not None else exc)
    return text.rsplit(": ", 1)[-1] if "Failed to establish a new connection" in text else text
