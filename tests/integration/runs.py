"""Running the trainer and the servers in the integration tests: a test's vLLM server (`make_server`), one 2-process
run shared by a module's tests (`two_process_run`), the reproducible launches of the checkpoint tests and their
reference runs (`train_command`), a single process (`train`), and a weight sync held at a known point (`HoldingProxy`,
`held_sync`), for the tests that signal or kill the trainer there with no test hook in the product.

`HoldingProxy` forwards every call to the session's vLLM server unchanged, except the first
`POST /v1/load_lora_adapter` sent while the server is paused (a `pause` sync's load): it holds that one, the server
really paused, until a `POST /resume` has gone through (the trainer's halt), `release()` or HOLD_MAX_S, then answers
500 without passing it on, so the held version is never loaded. Standard library only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import pytest

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 300  # a CPU run reaches its first syncs within a minute; on a loaded 2-core machine, a few
HOLD_MAX_S = 600.0  # the hold gives up after this: a test that never signals fails, it does not hang for ever
FORWARD_TIMEOUT_S = 600.0  # a generation request lasts as long as the trainer's vllm_request_timeout allows
# vLLM's model worker inside its engine-core process (the uniproc executor; the CPU build allows it only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0, which AsyncLLM ignores: the engine core keeps its own process): one Python
# start-up fewer per server, 30 instead of 43 CPU seconds to /health on the toy model, measured one after the other
# on the same machine (docs/testing.md). The same engine, API and logprobs; only the worker's process differs.
ONE_ENGINE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ONE_ENGINE_PROCESS_ARGS = ["--distributed-executor-backend", "uni"]
# Not forwarded as they came: they describe one connection, and the proxy answers with its own Content-Length.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length", "date", "server"}


class HoldingProxy:
    """A loopback proxy to `upstream` (a vLLM base URL) that holds the first load sent while the server is paused.
    `base_url` is the URL to give the trainer; `holding` is set once a load is held (the server is paused then)."""

    def __init__(self, upstream: str):
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self.holding = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()  # one handler thread per connection: the state below is shared
        self._paused = False  # a POST /pause went through and no POST /resume since
        self._held = False  # only the first paused load is held
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True  # a held call never holds up the test process's exit
        self.base_url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="holding-proxy", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def release(self) -> None:
        """Answer the held load (500, not passed on), if one is held or comes later."""
        self._released.set()

    def wait_held(self, proc: subprocess.Popen, log: Path) -> None:
        """Poll until a load is held, failing at once if `proc` ends first, or after DEADLINE_S."""
        deadline = time.monotonic() + DEADLINE_S
        while not self.holding.wait(0.1):
            assert proc.poll() is None, f"the run ended before its sync was held:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no sync was held within {DEADLINE_S} s:\n{log.read_text()[-3000:]}"

    def _hold(self, route: str) -> bool:
        """Whether this call is the one to hold (then `holding` is set)."""
        with self._lock:
            if route != "/v1/load_lora_adapter" or not self._paused or self._held:
                return False
            self._held = True
        self.holding.set()
        return True

    def _forwarded(self, method: str, route: str, status: int) -> None:
        """Follow the server's paused state through the calls that change it; a resume ends the hold."""
        if method != "POST" or status >= 400 or route not in ("/pause", "/resume"):
            return
        with self._lock:
            self._paused = route == "/pause"
        if route == "/resume" and self.holding.is_set():
            self.release()

    def forward(self, method: str, path: str, headers: dict, body: bytes | None):
        """The upstream's (status, reason, headers, body) for one call."""
        conn = http.client.HTTPConnection(*self._upstream, timeout=FORWARD_TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()


def _handler(proxy: HoldingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _relay(self) -> None:
            route = urllib.parse.urlsplit(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if proxy._hold(route):
                proxy._released.wait(HOLD_MAX_S)
                self._answer(500, "Internal Server Error", [], b'{"message": "held by the test proxy, not loaded"}')
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            try:
                status, reason, out_headers, data = proxy.forward(self.command, self.path, headers, body)
            except OSError:
                self.close_connection = True  # the caller sees a broken connection, as it would without the proxy
                return
            proxy._forwarded(self.command, route, status)
            self._answer(status, reason, out_headers, data)

        def _answer(self, status: int, reason: str, headers: list, data: bytes) -> None:
            with contextlib.suppress(OSError):  # the caller may be gone (killed while its call was held)
                self.send_response(status, reason)
                for key, value in headers:
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _relay

        def log_message(self, format, *args) -> None:
            """Quiet: the trainer's own log says what it sent."""

    return Handler


def make_server(model, port: int, *, cls: type[VLLMServer] = VLLMServer, env: dict | None = None,
                extra_args=(), **kwargs) -> VLLMServer:
    """A vLLM server for a test that does not look at vLLM's own processes (test_shutdown.py does, and starts the
    product's entry point instead): `cls(model, port, **kwargs)` with its worker in the engine-core process. `env`
    and `extra_args` go after ours (vLLM takes the last value of a flag given twice)."""
    return cls(model, port, env={**ONE_ENGINE_PROCESS_ENV, **(env or {})},
               extra_args=[*ONE_ENGINE_PROCESS_ARGS, *extra_args], **kwargs)


def train_command(out: Path, server_url: str, *extra: str, backend: str = "ddp") -> list[str]:
    """`accelerate launch` of 2 ranks on `backend` (gloo), 6 steps of the demo's config that two runs reproduce
    exactly: on-policy (`max_staleness: 0`) with seeded requests, the learning rate warmed up over 4 steps (0, 1/4,
    1/2, 3/4 of it, then all of it), writing to `out`; `extra` on top."""
    # Seeded requests: 4 in flight x 8 completions x ~10 tokens stay far below the server's default
    # --max-num-batched-tokens (2048), so no prompt is chunk-prefilled (that crashes seeded requests: docs/cpu-hosts.md).
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"launch/accelerate/{backend}_cpu.yaml",
            "--main_process_port", str(find_free_port()), "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml",
            "--max_steps", "6", "--per_device_train_batch_size", "16", "--learning_rate", "1e-2",
            "--max_staleness", "0", "--seeded_generation", "true", "--max_inflight_requests", "4",
            "--output_dir", str(out), "--lora_adapter_path", str(out / "adapters"),
            "--vllm_server_base_url", server_url, "--ddp_timeout", "200", "--vllm_server_timeout", "30",
            "--vllm_request_timeout", "40", "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "4", *extra]


def run_launch(cmd: list[str]) -> dict:
    """Run a `train_command` to its end; its run summary (a failed launch fails the test with its stderr, which is
    also kept in the run's output_dir as launch.log for the tests that read it)."""
    backend = Path(cmd[cmd.index("--config_file") + 1]).name.removesuffix("_cpu.yaml")
    out = Path(cmd[cmd.index("--output_dir") + 1])
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_launch_env(backend), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (out / "launch.log").write_text(proc.stderr)
    return json.loads((out / "run_summary.json").read_text())


def version_dir(summary: dict, version: int) -> Path:
    """Where the run of `summary` wrote adapter version `version`."""
    return Path(summary["adapter_path"]).parent / f"v{version:06d}"


# The DDP reference run (conftest.py's `ddp_reference`): runs resumed from a checkpoint end at its version of their
# last step. Version k is the weights after step k whatever max_steps is (the warm-up does not depend on it).
DDP_REFERENCE_STEPS = 8
SHARDED_BACKENDS = ["fsdp1", "fsdp2", "zero2", "zero3"]
# The sharded reference runs (conftest.py's `sharded_reference`): gradient checkpointing and micro-batches packed by a
# token budget (toy sequences are ~9-10 tokens: 16 completions per rank in 3-4 micro-batches of at most 48 tokens).
REFERENCE_STEPS = 3
PACKED = ["--gradient_checkpointing", "true", "--max_tokens_per_microbatch", "48"]


def module_run(name: str, *overrides: str):
    """A module-scoped fixture named `two_process_run`: one `train_two_processes(out, *overrides)` run, shared by the
    module's tests as (out, run summary, finished process)."""

    @pytest.fixture(scope="module", name="two_process_run")
    def run(world, train_two_processes, tmp_path_factory):
        out = tmp_path_factory.mktemp(name)
        summary, proc = train_two_processes(out, *overrides)
        return out, summary, proc

    return run


def run_adapters(client: InferenceClient, summary: dict) -> list[str]:
    """The adapters of `summary`'s run that the server still serves."""
    prefix = summary["adapter_name"].rsplit("-v", 1)[0] + "-v"
    return [n for n in client.adapter_paths() if n.startswith(prefix)]


def train(url: str, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """One `asyncgrpo train` process (no launcher: it is rank 0) on configs/demo.yaml against `url`, writing to `out`,
    its output in out/train.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--vllm_server_base_url", url,
           "--lora_adapter_path", str(out / "adapters"), "--output_dir", str(out), "--per_device_train_batch_size",
           "32", "--max_inflight_requests", "4", "--ddp_timeout", "120", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env={**cpu_launch_env(), **(env or {})}, stdout=open(out / "train.log", "w"),
                            stderr=subprocess.STDOUT)


def is_paused(url: str) -> bool:
    with InferenceClient(url) as client:
        return client.is_paused()


@contextlib.contextmanager
def held_sync(url: str, out: Path, *extra: str, env: dict | None = None, others: tuple = ()):
    """`train(*extra)` with pause sync against a HoldingProxy in front of `url`, waited for until its first paused
    sync is held (and the server at `url` checked paused: the fault is real); yields (the proxy's URL, the process).
    Afterwards, whatever happened, the processes still running (`others` too) are killed and the server at `url`
    resumed, so that the session server stays usable for the next test."""
    with HoldingProxy(url) as proxy:
        proc = train(proxy.base_url, out, "--sync_mode", "pause", *extra, env=env)
        try:
            proxy.wait_held(proc, out / "train.log")
            assert is_paused(url) is True, "the held sync had not paused the server"
            yield proxy.base_url, proc
        finally:
            for p in (proc, *others):
                if p.poll() is None:
                    p.kill()
                    p.wait()
            with InferenceClient(url) as client:
                client.resume()


def in_process_config(server_url: str, out: Path, *overrides: str):
    """The demo's config for a trainer run in this process against `server_url`, writing under `out`, with
    `overrides` (`--key value` pairs) on top."""
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.demo import default_config_path

    return AsyncGRPOConfig.load(default_config_path(), [
        *overrides, "--output_dir", str(out), "--lora_adapter_path", str(out / "adapters"),
        "--vllm_server_base_url", server_url])
