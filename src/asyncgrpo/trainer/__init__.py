"""What every training rank runs: the recipe (recipe.py), batching, loss, logprobs, the policy, the LoRA gather,
checkpoints and the learning-rate schedule. Nothing here is imported by the rollout side."""
