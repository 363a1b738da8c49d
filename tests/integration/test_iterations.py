"""num_iterations: each generated batch is taken once and trained on for several optimizer steps (TRL's
num_iterations), against the real server."""

import json
import subprocess
import sys
from pathlib import Path

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.trainer.recipe import GRPORecipe

REPO = Path(__file__).resolve().parents[2]


def test_each_batch_is_taken_once_trained_twice_and_its_reference_computed_once(vllm_server, tmp_path, tb_scalars):
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--max_steps", "4", "--per_device_train_batch_size", "64", "--num_iterations", "2",
        "--weight_sync_steps", "2", "--max_staleness", "0", "--beta", "0.04", "--learning_rate", "1e-2",
        "--output_dir", str(tmp_path), "--lora_adapter_path", str(tmp_path / "adapters"),
        "--vllm_server_base_url", vllm_server.base_url])
    trainer = GRPORecipe(cfg)
    forwards = []
    try:
        trainer.setup()
        scored = trainer.policy_logprobs
        trainer.policy_logprobs = lambda batch, **kw: forwards.append(trainer.step) or scored(batch, **kw)
        trainer.train()
    finally:
        trainer.cleanup()
    groups_per_step = 64 // 8
    assert trainer.rollout.parts.queue.batches_taken == 2  # 4 steps, 2 batches
    assert trainer.data_position == 2 * groups_per_step
    # One micro-batch per step: policy forwards at every step, the reference (beta > 0) once per batch.
    assert forwards == [0, 0, 1, 2, 2, 3]
    tb = tmp_path / "tensorboard"
    assert [v for _, v in tb_scalars(tb, "policy/version")] == [0.0, 1.0, 1.0, 2.0]  # published once per batch
    assert [v for _, v in tb_scalars(tb, "staleness/max")] == [0.0] * 4  # synchronous: every batch from the
    waits = [v for _, v in tb_scalars(tb, "time/wait_for_data_s")]      # version that trains it
    assert waits[1] == 0.0 and waits[3] == 0.0  # second passes take nothing from the queue
    ratio = [v for _, v in tb_scalars(tb, "train/max_abs_log_ratio")]
    # First passes are on-policy (fp32: numerical noise); second passes score the same tokens after one update.
    assert ratio[0] <= 1e-3 and ratio[2] <= 1e-3
    assert ratio[1] > 1e-3 and ratio[3] > 1e-3
    kl = [v for _, v in tb_scalars(tb, "train/kl")]
    assert kl[0] == 0.0 and kl[1] > 0.0  # the kept reference, against the updated policy


def test_fsdp2_ranks_train_their_cached_shares_in_step(vllm_server, tmp_path, tb_scalars):
    """Two FSDP2 ranks, each with its own share of a batch trained twice and a reference computed once: every forward
    all-gathers, so a rank that re-collated or recomputed differently would hang or fail the run."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "launch/accelerate/fsdp2_cpu.yaml",
           "--main_process_port", str(find_free_port()), "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml",
           "--max_steps", "4", "--per_device_train_batch_size", "16", "--num_iterations", "2",
           "--weight_sync_steps", "2", "--max_staleness", "0", "--beta", "0.04", "--learning_rate", "1e-2",
           "--output_dir", str(tmp_path), "--lora_adapter_path", str(tmp_path / "adapters"),
           "--vllm_server_base_url", vllm_server.base_url, "--ddp_timeout", "200", "--vllm_server_timeout", "30",
           "--vllm_request_timeout", "40"]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_launch_env("fsdp2"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert (summary["steps"], summary["version"], summary["backend"], summary["world_size"]) == (4, 2, "fsdp2", 2)
    tb = tmp_path / "tensorboard"
    assert [v for _, v in tb_scalars(tb, "policy/version")] == [0.0, 1.0, 1.0, 2.0]
    tokens = [v for _, v in tb_scalars(tb, "train/tokens")]
    assert tokens[0::2] == tokens[1::2]  # a second pass trains the same batch (summed over both ranks)
    ratio = [v for _, v in tb_scalars(tb, "train/max_abs_log_ratio")]
    assert ratio[0] <= 1e-3 and ratio[2] <= 1e-3 and ratio[1] > 1e-3 and ratio[3] > 1e-3
