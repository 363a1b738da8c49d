"""Learning-rate schedules (`lr_scheduler_type`, `warmup_ratio`/`warmup_steps`), with transformers' formulas.

The schedule is a torch `LambdaLR` over the innermost torch optimizer, stepped by the trainer exactly once per
optimizer step on every backend; docs/trainer-internals.md says why it does not go through `accelerate.prepare`.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from asyncgrpo.config import TrainingSettings


def lr_factor(step: int, *, kind: str, warmup: int, total: int) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based), as transformers defines
    `constant`, `constant_with_warmup`, `linear` and `cosine` (half a cosine, `num_cycles` 0.5)."""
    if kind == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise AssertionError(f"unknown lr_scheduler_type {kind!r}")


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (and DeepSpeed's ZeRO optimizer): the one whose param groups
    hold the learning rate that is used."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    assert isinstance(optimizer, torch.optim.Optimizer), f"no torch optimizer inside {type(optimizer).__name__}"
    return optimizer


def build_lr_scheduler(optimizer, training: TrainingSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule over `training.max_steps` optimizer steps (sets the learning rate of step 0 at once)."""
    factor = partial(lr_factor, kind=training.lr_scheduler_type, warmup=training.num_warmup_steps,
                     total=training.max_steps)
    return torch.optim.lr_scheduler.LambdaLR(torch_optimizer(optimizer), factor)


def restore_lr_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Load a checkpoint's scheduler state and set the learning rate of the step it resumes at (loading the
    optimizer restores its groups' saved lr on some backends only)."""
    scheduler.load_state_dict(state)
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
