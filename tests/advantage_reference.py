"""TRL's group-relative advantages written with torch, as the reference the production rule is checked against.

The producer computes advantages in plain Python (`asyncgrpo.contracts.centred_advantages`, `scored_advantages`, and
`scale_by_batch_std` for `scale_rewards: batch`); tests/unit/rollout/test_queue.py checks it against this."""

import torch

SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, scale: bool | str = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages. rewards: (G, N) for G groups of N completions -> (G, N).

    `scale` (TRL's `scale_rewards`): `group` (or True) divides by each group's reward std (GRPO), `batch` by the std
    of all rewards in `rewards` (PPO-Lite), `none` (or False) only subtracts the group mean (Dr. GRPO). Stds are
    torch's unbiased ones, plus `eps`."""
    mode = {True: "group", False: "none"}[scale] if isinstance(scale, bool) else scale
    assert mode in SCALE_REWARDS, f"unknown scale_rewards {scale!r}"
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (G, N)
    if mode == "none":
        return centred
    std = rewards.std(dim=1, keepdim=True) if mode == "group" else rewards.std()  # (G, 1) or a scalar
    return centred / (std + eps)
