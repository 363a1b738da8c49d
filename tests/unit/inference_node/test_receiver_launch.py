"""launch/vllm/receiver.sh, run here with a stand-in for python: the command it starts, its refusal to start
without an API key, and loopback only when told to start without one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    record = tmp_path / "args"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\necho "key=$ASYNCGRPO_VLLM_API_KEY" >> {record}\n')
    stand_in.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("ASYNCGRPO_VLLM_API_KEY", "API_KEY", "PORT")}
    proc = subprocess.run(["bash", "launch/vllm/receiver.sh", "--keep", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**base, "PYTHON": str(stand_in), **env})
    return proc, record


def test_receiver_sh_starts_the_receiver_beside_the_local_vllm_with_serve_sh_s_key(tmp_path):
    proc, record = _run(tmp_path, ADAPTER_DIR="/local/adapters", API_KEY="k1", PORT="8100")
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().splitlines()
    assert args[:2] == ["-m", "asyncgrpo.inference_node.receiver"]
    flags = dict(zip(args[2:-1:2], args[3:-1:2]))
    assert flags["--dir"] == "/local/adapters" and flags["--port"] == "8001"
    assert flags["--host"] == "0.0.0.0"  # with a key: every interface (the private network)
    assert flags["--vllm-url"] == "http://127.0.0.1:8100"  # serve.sh's PORT
    assert args[-2:] == ["3", "key=k1"]  # extra args passed on; the key in the environment, not on the command line
    assert "k1" not in args[:-1]


def test_receiver_sh_refuses_to_start_without_a_key(tmp_path):
    proc, record = _run(tmp_path, ADAPTER_DIR="/local/adapters")
    assert proc.returncode == 2 and "ASYNCGRPO_VLLM_API_KEY" in proc.stderr
    assert not record.exists()
    allowed, record = _run(tmp_path, ADAPTER_DIR="/local/adapters", ALLOW_NO_KEY="1")
    assert allowed.returncode == 0 and record.read_text().splitlines()[-1] == "key="
    args = record.read_text().splitlines()
    assert args[args.index("--host") + 1] == "127.0.0.1"  # keyless: loopback only, never every interface
