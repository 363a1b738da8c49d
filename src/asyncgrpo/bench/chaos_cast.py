"""The processes `bench chaos` starts, kills and restarts: the vLLM server, the adapter receiver, the training launch
(its ranks and the rollout process of rank 0, or `asyncgrpo rollout-serve` beside it); the malformed requests it
sends to every port they listen on; and the resident memory of each. Every process is a GroupProcess (children.py): nothing outlives the bench.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from asyncgrpo.children import GroupProcess
from asyncgrpo.config import API_KEY_ENV, ROLLOUT_KEY_ENV
from asyncgrpo.demo import launch_command, launch_environment
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

RECEIVER_START_S = 60.0  # the receiver imports requests and yaml only: ~1 s; room for a loaded 2-core machine
SERVER_START_S = 600.0  # a vLLM CPU start takes ~30 s alone, minutes on a loaded 2-core machine
PROBE_TIMEOUT_S = 10.0  # one malformed request's wait for an answer: vLLM's API server took over 3 s under load
CHILD = re.compile(r"rollout side running in its own process \(pid (\d+)\)")
SERVE_START_S = 300.0  # rollout-serve imports the trainer's stack (torch) before it listens: seconds, minutes loaded


def _quiet_kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tree(pid: int | None) -> list[psutil.Process]:
    """`pid` and every process below it, now (empty when it is gone, or None)."""
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rss(procs: list[psutil.Process]) -> int:
    """Resident bytes of `procs` together (those that exited meanwhile count 0)."""
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Receiver:
    """`python -m asyncgrpo.inference_node.receiver` beside the server, on a fixed port and directory (a restart
    keeps both, as a receiver restarted on the same node does)."""

    def __init__(self, directory: Path, vllm_url: str, key: str, log_path: Path):
        self.directory, self.vllm_url, self.key, self.log_path = directory, vllm_url, key, log_path
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.group: GroupProcess | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.group = GroupProcess([sys.executable, "-m", "asyncgrpo.inference_node.receiver", "--dir",
                                       str(self.directory), "--port", str(self.port), "--vllm-url", self.vllm_url],
                                      env={**os.environ, API_KEY_ENV: self.key}, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log)
        deadline = time.monotonic() + RECEIVER_START_S
        while not self.healthy():
            if self.group.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the adapter receiver did not answer /health: see {self.log_path}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crashed node: no clean-up of its own runs."""
        _quiet_kill(self.group.pgid)
        self.group.stop(grace_s=0)

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()


class Server:
    """The vLLM server, killed with SIGKILL to its whole group and restarted on the same port with the same flags."""

    def __init__(self, model_dir: str, key: str, log_path: Path):
        self.vllm = VLLMServer(model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                               api_key=key, log_path=log_path)

    @property
    def url(self) -> str:
        return self.vllm.base_url

    def start(self) -> float:
        self.vllm.start()
        try:
            return self.vllm.wait_ready(SERVER_START_S)
        except BaseException:
            self.vllm.stop()
            raise

    def kill(self) -> None:
        _quiet_kill(self.vllm.process.pid)
        self.vllm.stop(grace_s=0)

    def stop(self) -> None:
        self.vllm.stop()


def run_environment(key: str, rollout_key: str | None = None) -> dict[str, str]:
    """The environment of the run's processes: a launch's, the server's key, and the rollout link's key if any."""
    return {**launch_environment(), API_KEY_ENV: key, **({ROLLOUT_KEY_ENV: rollout_key} if rollout_key else {})}


class RolloutServe:
    """`asyncgrpo rollout-serve` on loopback, as the rollout side of another host: it serves one run and exits, so
    each launch gets a new one, on the same port (the trainer's `rollout_address` does not change)."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.work, self.env = work, env
        self.port = find_free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.group: GroupProcess | None = None
        self.starts = 0

    def start(self) -> None:
        """A new rollout-serve (the last one stopped first), once it listens."""
        self.stop()
        log_path = self.work / f"rollout-serve-{self.starts}.log"
        self.starts += 1
        with open(log_path, "wb") as log:
            self.group = GroupProcess([sys.executable, "-m", "asyncgrpo", "rollout-serve", "--listen", self.address],
                                      env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + SERVE_START_S
        while "rollout server listening" not in log_path.read_text(errors="replace"):
            if self.group.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rollout-serve did not start listening on {self.address}: see {log_path}")
            time.sleep(0.1)

    def pid(self) -> int | None:
        """Its pid while it runs."""
        return self.group.pid if self.group is not None and self.group.process.poll() is None else None

    def kill(self) -> None:
        """SIGKILL to its whole group, as a rollout host that died."""
        if self.group is not None:
            _quiet_kill(self.group.pgid)

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()


@dataclass
class Segment:
    """One `accelerate launch` of the run: the first, or one resumed from the latest checkpoint."""

    index: int
    group: GroupProcess
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    known_dirs: set = field(default_factory=set)  # adapter run directories that were there before it started

    def ranks(self) -> dict[int, psutil.Process]:
        """RANK -> its training process (the launcher's workers)."""
        out = {}
        for p in tree(self.group.pid)[1:]:
            try:
                rank = p.environ().get("RANK")
                if rank is not None and "asyncgrpo" in " ".join(p.cmdline()):
                    out.setdefault(int(rank), p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def rollout_pid(self) -> int | None:
        found = CHILD.findall(self.log_path.read_text(errors="replace")) if self.log_path.exists() else []
        return int(found[-1]) if found else None


class Launch:
    """The 2-rank training launch, started and resumed with the same arguments."""

    def __init__(self, config: Path, args: list[str], adapters: Path, key: str, work: Path, processes: int = 2,
                 rollout_key: str | None = None):
        self.config, self.args, self.adapters, self.work = config, args, adapters, work
        self.processes = processes
        self.env = run_environment(key, rollout_key)
        self.segments: list[Segment] = []

    def start(self, resume: bool) -> Segment:
        index = len(self.segments)
        log_path = self.work / f"train-{index}.log"
        args = [*self.args, *(["--resume_from_checkpoint", "latest"] if resume else [])]
        cmd = launch_command(self.processes, find_free_port(), self.config, args)
        known = {p.name for p in self.adapters.iterdir()} if self.adapters.exists() else set()
        with open(log_path, "wb") as log:
            group = GroupProcess(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.segments.append(Segment(index, group, log_path, known_dirs=known))
        return self.segments[-1]

    def step(self, segment: Segment) -> int:
        """The newest adapter version the segment has written (one per step: weight_sync_steps 1); 0 before any."""
        best = 0
        if not self.adapters.exists():
            return 0
        for run_dir in self.adapters.iterdir():
            if run_dir.name in segment.known_dirs or not run_dir.is_dir():
                continue
            for version in run_dir.glob("v[0-9]*"):
                if version.name[1:].isdigit():
                    best = max(best, int(version.name[1:]))
        return best


# ---- malformed requests -------------------------------------------------------------------------------------

def malformed_requests(rng: random.Random) -> dict[str, bytes]:
    """The four kinds sent to every port, each on a connection of its own."""
    body = b'{"model": ["unterminated'
    wrong = json.dumps({"modle": "x", "promt": [1, 2], "max_tokens": "many"}).encode()
    return {
        "garbage_bytes": bytes(rng.getrandbits(8) for _ in range(2048)),
        "bad_json": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body)) + body,
        "oversized_header": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Fill: " + b"a" * 200_000 + b"\r\n\r\n",
        "wrong_keys": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer not-the-key\r\nContent-Length: %d\r\n\r\n" % len(wrong)) + wrong,
    }


def send_raw(port: int, payload: bytes, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Send `payload` to 127.0.0.1:`port` and return the answer's first line, or how the connection ended."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:  # the peer closed (a header too large) or stopped reading
                return f"sending failed ({exc.__class__.__name__})"
            data = sock.recv(256)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return f"connection failed ({exc.__class__.__name__})"
    return data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed without an answer"


def listening_ports(owners: dict[str, list[psutil.Process]]) -> dict[int, tuple[str, int]]:
    """port -> (the role, the pid) of the process that listens on it (TCP, any address), for every process in
    `owners`."""
    ports = {}
    for role, procs in owners.items():
        for p in procs:
            try:
                for conn in p.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN:
                        ports.setdefault(conn.laddr.port, (role, p.pid))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return ports
