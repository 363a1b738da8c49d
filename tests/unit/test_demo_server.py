"""`asyncgrpo demo --server URL`: the demo trains against an inference node started elsewhere (a container:
scripts/container_check.sh) and starts no server of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from asyncgrpo import demo

ROOT = Path(__file__).resolve().parents[2]


def test_a_given_server_is_used_as_it_is_and_no_local_server_is_started(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(demo, "VLLMServer", lambda *a, **k: started.append(a))
    args = SimpleNamespace(server="http://127.0.0.1:8123/", port=0)
    with demo.inference_node(args, cfg=None, model_dir="unused", out=tmp_path) as url:
        assert url == "http://127.0.0.1:8123"
    assert started == []


def test_the_agent_demo_refuses_a_server_it_would_ignore():
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "demo", "--world", "agent", "--server",
                           "http://127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--server is for the toy world only" in proc.stderr
