"""Real 2-rank launches that must stop at once, with one clear message: a start-up failure on rank 0 (here: no
inference server answers) and a launch of several ranks on a host without CUDA that did not ask for CPU. Each
launch gets a `ddp_timeout` far above the subprocess timeout, so a rank left waiting in a collective fails the test."""

import subprocess
import sys
from pathlib import Path

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference_node.vllm_server import find_free_port

REPO = Path(__file__).resolve().parents[2]


def torchrun(env: dict, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(find_free_port()), "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--output_dir",
           str(out), "--lora_adapter_path", str(out / "adapters"), "--ddp_timeout", "1800", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_a_start_up_failure_on_rank_0_stops_every_rank_with_one_message(tmp_path):
    dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    proc = torchrun(cpu_launch_env("ddp"), tmp_path, "--vllm_server_base_url", dead, "--vllm_server_timeout", "2")
    assert proc.returncode != 0
    assert proc.stderr.count("asyncgrpo: error:") == 1, proc.stderr[-3000:]  # rank 0's, printed once
    assert dead in proc.stderr


def test_several_ranks_without_cuda_stop_unless_cpu_was_asked_for(tmp_path):
    proc = torchrun(cpu_launch_env(), tmp_path, "--vllm_server_base_url", "http://127.0.0.1:9")
    assert proc.returncode != 0
    assert "CUDA is not usable on this host" in proc.stderr and "ACCELERATE_USE_CPU=true" in proc.stderr
