"""beta > 0: the KL to the base model (the same model with the adapter disabled) is computed and trained against."""

from asyncgrpo.trainer.recipe import GRPORecipe
from integration.runs import in_process_config


def test_kl_to_the_adapter_free_model_is_zero_at_the_start_and_positive_once_the_adapter_moved(vllm_server, tmp_path):
    cfg = in_process_config(vllm_server.base_url, tmp_path,
                            "--max_steps", "3", "--per_device_train_batch_size", "64", "--beta", "0.04", "--learning_rate", "1e-2")
    trainer = GRPORecipe(cfg)
    try:
        trainer.setup()
        kls = []
        for _ in range(3):
            kls.append(trainer.train_step().values["train/kl"])
            trainer.sync()
    finally:
        trainer.cleanup()
    assert kls[0] == 0.0  # LoRA B starts at zero: the policy is the reference
    # After an update the policy differs from the reference on every batch (the k3 estimate need not grow
    # monotonically: each step scores a different sampled batch).
    assert all(0.0 < kl < 1.0 for kl in kls[1:])
