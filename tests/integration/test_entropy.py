"""The trainer's per-token entropy on a real run against the vLLM server: logged every step with its quantiles, in
range, and `top_entropy_quantile` leaves the lower-entropy share of the tokens out of the loss."""

import math

from asyncgrpo.trainer.recipe import GRPORecipe
from integration.runs import in_process_config


def test_entropy_is_logged_with_its_quantiles_and_top_entropy_quantile_masks_the_rest(vllm_server, tmp_path):
    cfg = in_process_config(vllm_server.base_url, tmp_path,
                            "--max_steps", "2", "--per_device_train_batch_size", "64", "--top_entropy_quantile", "0.25")
    trainer = GRPORecipe(cfg)
    try:
        trainer.setup()
        steps = []
        for _ in range(2):
            steps.append(trainer.train_step().values)
            trainer.sync()
        vocab = trainer.acc.unwrap_model(trainer.model).get_output_embeddings().weight.shape[0]
    finally:
        trainer.cleanup()
    for v in steps:
        # A sampled policy at temperature 1 has some entropy, below a uniform one over the vocabulary.
        assert 0.0 < v["train/entropy_p10"] <= v["train/entropy_p50"] <= v["train/entropy_p90"] < math.log(vocab)
        assert 0.0 < v["train/entropy"] < math.log(vocab)
        # The top quarter of each micro-batch's tokens by entropy keep their loss: about 3/4 are left out (ties
        # and several micro-batches move it a little).
        assert 0.6 < v["train/masked_fraction"] < 0.8, v["train/masked_fraction"]
