"""num_iterations: each generated batch is taken once and trained on for several optimizer steps (TRL's
num_iterations), against the real server."""

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.trainer import AsyncGRPOTrainer


def test_each_batch_is_taken_once_trained_twice_and_its_reference_computed_once(vllm_server, tmp_path, tb_scalars):
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--max_steps", "4", "--per_device_train_batch_size", "64", "--num_iterations", "2",
        "--weight_sync_steps", "2", "--max_staleness", "0", "--beta", "0.04", "--learning_rate", "1e-2",
        "--output_dir", str(tmp_path), "--lora_adapter_path", str(tmp_path / "adapters"),
        "--vllm_server_base_url", vllm_server.base_url])
    trainer = AsyncGRPOTrainer(cfg)
    forwards = []
    try:
        trainer.setup()
        scored = trainer.policy_logprobs
        trainer.policy_logprobs = lambda batch: forwards.append(trainer.step) or scored(batch)
        trainer.train()
    finally:
        trainer.cleanup()
    groups_per_step = 64 // 8
    assert trainer.queue.batches_taken == 2  # 4 steps, 2 batches
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
