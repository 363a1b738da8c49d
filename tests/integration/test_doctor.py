"""`asyncgrpo doctor` against a real vLLM server started without LoRA: the checks a real server can fail.

One extra server for this module: dev mode on (so `/server_info` answers and the LoRA checks can read the config),
no `--enable-lora` and no `VLLM_ALLOW_RUNTIME_LORA_UPDATING`. The missing dev mode is checked against a real server
in test_faults.py; a passing doctor against the session server there too.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from integration.runs import make_server

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

REPO = Path(__file__).resolve().parents[2]
START_S = 600  # a vLLM CPU start takes ~30 s alone, minutes on a loaded 2-core machine
LORA_FLAGS = {"--enable-lora": 0, "--max-lora-rank": 1, "--max-loras": 1}  # flag -> how many values follow it


class ServerWithoutLoRA(VLLMServer):
    def command(self) -> list[str]:
        cmd, out, skip = super().command(), [], 0
        for arg in cmd:
            if skip:
                skip -= 1
            elif arg in LORA_FLAGS:
                skip = LORA_FLAGS[arg]
            else:
                out.append(arg)
        return out


@pytest.fixture(scope="module")
def server_without_lora(world, tmp_path_factory):
    log = tmp_path_factory.mktemp("nolora") / "vllm.log"
    server = make_server(world.model_dir, find_free_port(), cls=ServerWithoutLoRA, max_model_len=256, log_path=log,
                         env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"})
    assert "--enable-lora" not in server.command() and "--max-lora-rank" not in server.command()
    server.start()
    try:
        server.wait_ready(START_S)
        yield server
    finally:
        server.stop()


def test_doctor_names_lora_off_and_no_runtime_updating_on_a_real_server(server_without_lora, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "doctor", "--config", "configs/demo.yaml",
                           "--vllm_server_base_url", server_without_lora.base_url, "--lora_adapter_path", str(tmp_path)],
                          cwd=REPO, env=cpu_launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "FAIL  LoRA enabled: the server serves no LoRA adapters. Fix: restart it with --enable-lora" in out, out
    assert "FAIL  runtime LoRA updating: the server has no /v1/load_lora_adapter route" in out, out
    assert "SKIP  max_lora_rank: LoRA is not enabled" in out, out
    assert "PASS  dev mode" in out and "PASS  base model" in out  # the rest of the server is fine
    assert proc.stdout.splitlines()[-1].endswith("check(s) failed")
