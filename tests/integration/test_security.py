"""The API key end to end, against a real vLLM server started with `--api-key` (its own, module-scoped: the
session server has no key). One run with the key in ASYNCGRPO_VLLM_API_KEY trains 2 steps, and the key appears
nowhere it writes: stdout/stderr, config.yaml, run_summary.json, TensorBoard event files. One run without the key
stops at start with a clear error instead of a traceback. Also pins the vLLM fact the docs warn about: the key
guards /v1/* only, and /pause answers without it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.config import API_KEY_ENV
from asyncgrpo.errors import InferenceServerError
from asyncgrpo.inference.client import InferenceClient

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-itest-91c2e7-must-not-leak"


@pytest.fixture(scope="module")
def keyed_server(world, tmp_path_factory):
    from asyncgrpo.inference_node.vllm_server import find_free_port
    from integration.runs import make_server

    log = tmp_path_factory.mktemp("vllm-keyed") / "vllm.log"
    with make_server(world.model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                     api_key=KEY, log_path=log) as server:
        yield server


def train(server, out: Path, key: str | None) -> subprocess.CompletedProcess:
    env = cpu_launch_env()
    env.pop(API_KEY_ENV, None)
    if key is not None:
        env[API_KEY_ENV] = key
    cmd = [sys.executable, "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--max_steps", "2",
           "--per_device_train_batch_size", "16", "--output_dir", str(out), "--lora_adapter_path",
           str(out / "adapters"), "--vllm_server_base_url", server.base_url, "--vllm_server_timeout", "30"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_key_is_sent_everywhere_and_written_nowhere(keyed_server, tmp_path):
    proc = train(keyed_server, tmp_path / "with-key", KEY)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "with-key" / "run_summary.json").read_text())
    assert summary["version"] == 2
    with InferenceClient(keyed_server.base_url, api_key=KEY) as client:
        assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert KEY not in proc.stdout + proc.stderr
    written = [p for p in (tmp_path / "with-key").rglob("*") if p.is_file() and "adapters" not in p.parts]
    assert {"config.yaml", "run_summary.json"} <= {p.name for p in written}
    assert any(p.name.startswith("events.out.tfevents") for p in written)
    assert [p for p in written if KEY.encode() in p.read_bytes()] == []

    proc = train(keyed_server, tmp_path / "no-key", None)
    assert proc.returncode == 2, proc.stderr[-5000:]
    assert "asyncgrpo: error:" in proc.stderr and "401" in proc.stderr and API_KEY_ENV in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_key_guards_only_v1_routes(keyed_server):
    with InferenceClient(keyed_server.base_url) as anonymous:
        with pytest.raises(InferenceServerError) as err:
            anonymous.models()
        assert err.value.status == 401
        assert not anonymous.is_paused()  # a dev route: answers without the key (vLLM's behaviour: docs/security.md)
    assert requests.get(f"{keyed_server.base_url}/v1/models", timeout=10).status_code == 401
