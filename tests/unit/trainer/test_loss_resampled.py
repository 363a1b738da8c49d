"""The loss of a partially re-sampled completion (`inflight_weight_updates`: its first tokens sampled by version 0,
the rest by version 1 after it moved) against a reference worked out by hand. Each token's ratio must be taken
against the behaviour logprob of the version that actually sampled it, at its own position: a loss that used one
behaviour logprob per completion, or shifted them by a token, gives other numbers here.

The case: prompt [5, 6]; completion A = [7, 8, 9], advantage +1, tokens 7 and 8 sampled by version 0 with behaviour
logprobs -1.0 and -0.5, token 9 by version 1 with -2.0; completion B = [3, 4], advantage -1, both by version 1, -0.7
and -1.2. The trainer's logprobs of the same tokens: A -0.9, -0.6, -1.5; B -0.8, -1.0. The default loss (`dapo`,
epsilon 0.2 / epsilon_high 0.28, delta 3), so per token -A x min(r, 1.28) for A > 0 and -A x clamp(r, 0.8, 3) for
A < 0, summed and divided by the 5 tokens:

  A: r = e^0.1 = 1.105171, e^-0.1 = 0.904837, e^0.5 = 1.648721 -> clipped to 1.28 (no gradient)
  B: r = e^-0.1 = 0.904837, e^0.2 = 1.221403
  loss = (-1.105171 - 0.904837 - 1.28 + 0.904837 + 1.221403) / 5 = -0.2327536
  d loss / d logprob = -A r / 5 where unclipped: A (-0.2210342, -0.1809675, 0), B (0.1809675, 0.2442806)

With the off-policy correction (`token_truncate`, cap 3) on the batch's first pass (the proximal policy is the
trainer itself, so the clipped ratio is 1), each token is weighted by min(e^(trainer - behaviour), 3) instead:
  loss = (-1.105171 - 0.904837 - 1.648721 + 0.904837 + 1.221403) / 5 = -0.3064978
"""

import math

import pytest
import torch

from asyncgrpo.contracts import Group
from asyncgrpo.trainer.batching import collate
from asyncgrpo.trainer.loss import LossSpec, grpo_loss

TRAINER = {0: [-0.9, -0.6, -1.5], 1: [-0.8, -1.0]}  # the trainer's logprob of each completion token, per completion


def resampled_group() -> Group:
    return Group(prompt="", prompt_ids=[5, 6], completion_ids=[[7, 8, 9], [3, 4]],
                 behaviour_logprobs=[[-1.0, -0.5, -2.0], [-0.7, -1.2]], rewards=[1.0, 0.0], reward_parts={},
                 advantages=[1.0, -1.0], version=0, adapter="pol-v0", finish_reasons=["stop", "stop"],
                 versions=[[0, 0, 1], [1, 1]])


def trainer_logprobs(batch) -> torch.Tensor:
    """The trainer's logprobs laid out as the model's would be: (B, T-1), token t+1 scored at position t."""
    logprobs = torch.zeros_like(batch["behaviour"])
    for row, values in TRAINER.items():
        logprobs[row, 1:1 + len(values)] = torch.tensor(values)  # prompt of 2: the first completion token at 1
    return logprobs.requires_grad_()


def test_a_completion_sampled_by_two_versions_is_corrected_token_by_token_as_worked_out_by_hand():
    batch = collate([resampled_group()], pad_id=0)
    logprobs = trainer_logprobs(batch)
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28, delta=3.0)
    terms = grpo_loss(logprobs, batch["behaviour"], batch["advantages"], batch["mask"], spec, normaliser=5.0)
    assert terms.loss.item() == pytest.approx(-0.2327536, abs=1e-6)
    terms.loss.backward()
    grad = logprobs.grad
    assert grad[0, 1:4].tolist() == pytest.approx([-0.2210342, -0.1809675, 0.0], abs=1e-6)
    assert grad[1, 1:3].tolist() == pytest.approx([0.1809675, 0.2442806], abs=1e-6)
    assert terms.clipped_tokens.item() == 1  # token 9: its version-1 behaviour makes its ratio 1.65
    # The largest |trainer - behaviour| is token 9's, against version 1's logprob (-1.5 - -2.0)
    assert terms.max_abs_log_ratio.item() == pytest.approx(0.5, abs=1e-6)


def test_the_off_policy_correction_weights_each_token_by_its_own_versions_behaviour_logprob():
    batch = collate([resampled_group()], pad_id=0)
    logprobs = trainer_logprobs(batch)
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.28, delta=3.0, is_mode="token_truncate", is_cap=3.0)
    terms = grpo_loss(logprobs, batch["behaviour"], batch["advantages"], batch["mask"], spec, normaliser=5.0,
                      proximal_logprobs=logprobs.detach())
    assert terms.loss.item() == pytest.approx(-0.3064978, abs=1e-6)
    assert terms.is_ratio_max.item() == pytest.approx(math.exp(0.5), abs=1e-6)  # token 9's weight, uncapped
