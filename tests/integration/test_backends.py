"""The LoRA-only sync on every sharding backend: a real 2-process `accelerate launch` per backend (gloo, CPU) against
the real vLLM server. After the last sync, the adapter the server serves is the one written, it is non-trivial
(every LoRA B moved off its zero init, so no backend wrote empty or zero tensors), and loaded with PEFT onto the
unsharded base it gives the server's logprobs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.inference.server import find_free_port


REPO = Path(__file__).resolve().parents[2]
PROMPT = [3 + b for b in b"61,16>"]
# Environment per backend, as measured in shared/NOTES.md: accelerate needs ACCELERATE_USE_CPU for DDP/FSDP on a
# CPU host but must not see it for DeepSpeed, which needs DS_ACCELERATOR=cpu instead.
BACKEND_ENV = {
    "fsdp1": {"ACCELERATE_USE_CPU": "true", "ACCELERATE_TORCH_DEVICE": "cpu"},
    "fsdp2": {"ACCELERATE_USE_CPU": "true"},
    "zero2": {"DS_ACCELERATOR": "cpu"},
    "zero3": {"DS_ACCELERATOR": "cpu"},
}


def launch(backend: str, out: Path, server_url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **BACKEND_ENV[backend]})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           f"launch/accelerate/{backend}_cpu.yaml", "--main_process_port", str(find_free_port()),
           "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--max_steps", "2",
           "--per_device_train_batch_size", "16", "--learning_rate", "1e-2", "--output_dir", str(out),
           "--lora_adapter_path", str(out / "adapters"), "--vllm_server_base_url", server_url,
           "--ddp_timeout", "120"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("backend", sorted(BACKEND_ENV))
def test_sharded_training_publishes_the_trained_adapter(backend, vllm_server, client, peft_logprobs, tmp_path):
    proc = launch(backend, tmp_path, vllm_server.base_url)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["version"] == 2
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    tensors = load_file(f"{summary['adapter_path']}/adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # A and B for 7 modules in 2 layers, under PEFT's key names
    assert all(k.startswith("base_model.model.model.layers.") and "_fsdp" not in k for k in tensors)
    assert min(t.abs().max().item() for k, t in tensors.items() if "lora_B" in k) > 0

    completion = client.complete(summary["adapter_name"], PROMPT, n=1, max_tokens=3, temperature=1.0)[0]
    mine = peft_logprobs(summary["adapter_path"], PROMPT, completion.token_ids)
    assert torch.allclose(mine, torch.tensor(completion.logprobs), atol=1e-3, rtol=0)


def test_torchrun_runs_the_same_train_command_in_versioned_mode(vllm_server, client, tb_scalars, tmp_path):
    """No accelerate launcher: plain `torchrun` (DDP over gloo on this CPU host), with `sync_mode: versioned`."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(find_free_port()), "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--max_steps", "2",
           "--per_device_train_batch_size", "16", "--output_dir", str(tmp_path),
           "--lora_adapter_path", str(tmp_path / "adapters"), "--vllm_server_base_url", vllm_server.base_url,
           "--ddp_timeout", "120", "--sync_mode", "versioned"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["version"] == 2
    paused = [v for _, v in tb_scalars(tmp_path / "tensorboard", "sync/paused_s")]
    assert paused == [0.0, 0.0, 0.0]  # versions 0, 1, 2: in versioned mode the server is never paused
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert proc.stderr.count("asyncgrpo.trainer: done") == 1  # two ranks, one rank 0
