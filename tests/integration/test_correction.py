"""The off-policy correction (vllm_importance_sampling_correction) on stale data from the real server: on-policy the
importance weight proximal / behaviour is 1 and nothing is capped; one version stale it is not, and the step
metrics say so. Staleness is made to occur deterministically: before each step the trainer waits until the
producer has queued the next batch too, so that batch was sampled before the step's weights were published."""

import time

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.trainer.recipe import GRPORecipe

STEPS = 4


def _wait_until_queued(trainer: GRPORecipe, groups: int, deadline_s: float = 300.0) -> None:
    deadline = time.monotonic() + deadline_s
    while len(trainer.rollout.parts.queue) < groups:
        assert time.monotonic() < deadline, f"the producer did not queue {groups} groups within {deadline_s} s"
        time.sleep(0.05)


def test_the_correction_sees_one_version_of_staleness_and_nothing_on_policy(vllm_server, tmp_path, tb_scalars):
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--max_steps", str(STEPS), "--per_device_train_batch_size", "64", "--num_iterations", "1",
        "--weight_sync_steps", "1", "--max_staleness", "1", "--sync_mode", "versioned", "--learning_rate", "1e-2",
        "--vllm_importance_sampling_correction", "true", "--vllm_importance_sampling_mode", "token_truncate",
        "--output_dir", str(tmp_path), "--lora_adapter_path", str(tmp_path / "adapters"),
        "--vllm_server_base_url", vllm_server.base_url])
    trainer = GRPORecipe(cfg)
    groups_per_step = cfg.groups_per_step(world_size=1)
    step = trainer.train_step

    def step_after_the_next_batch_is_queued():
        if trainer.step < STEPS - 1:  # this step's batch and the next one, both sampled at the current version
            _wait_until_queued(trainer, 2 * groups_per_step)
        return step()

    trainer.train_step = step_after_the_next_batch_is_queued
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.cleanup()
    tb = tmp_path / "tensorboard"
    staleness = [v for _, v in tb_scalars(tb, "staleness/max")]
    assert staleness == [0.0] + [1.0] * (STEPS - 1)
    ratio_mean = [v for _, v in tb_scalars(tb, "train/sampling/importance_sampling_ratio/mean")]
    ratio_max = [v for _, v in tb_scalars(tb, "train/sampling/importance_sampling_ratio/max")]
    kl = [v for _, v in tb_scalars(tb, "train/sampling/kl_behaviour")]
    capped = [v for _, v in tb_scalars(tb, "train/sampling/is_capped_fraction")]
    # Step 0 is on-policy (fp32 on both sides): the weight is 1 up to numerical noise and nothing is capped.
    assert abs(ratio_mean[0] - 1.0) < 1e-4 and ratio_max[0] < 1.001 and kl[0] < 1e-6 and capped[0] == 0.0
    # One optimizer step later at learning rate 1e-2 the trainer has moved away from the sampler: the weights are no
    # longer 1 and the KL estimate is far above step 0's noise.
    for s in range(1, STEPS):
        assert ratio_max[s] > 1.01, (s, ratio_max)
        assert kl[s] > 100 * max(kl[0], 1e-9), (s, kl)
