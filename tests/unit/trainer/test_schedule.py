"""Learning-rate schedules: transformers' formulas worked out by hand, one step per optimizer step, exact resume."""

from functools import partial
from types import SimpleNamespace

import fakes
import pytest
import torch

from asyncgrpo.errors import ConfigError
from asyncgrpo.trainer.schedule import build_lr_scheduler, lr_factor, torch_optimizer

cfg = partial(fakes.cfg, max_steps=10)  # a validated config of 10 steps


@pytest.mark.parametrize("kind, expected", [
    # 10 steps, 2 of warm-up: 0, 1/2, then from step 2 the decay over the remaining 8 steps.
    ("constant_with_warmup", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0]),
    # cosine: 0.5 (1 + cos(pi (s - 2) / 8)); step 4: 0.5 (1 + cos(pi / 4)) = 0.853553, step 6: 0.5.
    ("cosine", [0.0, 0.5, 1.0, 0.961940, 0.853553, 0.691342, 0.5, 0.308658, 0.146447, 0.038060, 0.0]),
])
def test_schedules_follow_transformers_formulas(kind, expected):
    got = [lr_factor(s, kind=kind, warmup=2, total=10) for s in range(11)]
    assert got == pytest.approx(expected, abs=1e-6)


def test_constant_has_no_warmup_and_refuses_one():
    assert [lr_factor(s, kind="constant", warmup=0, total=10) for s in (0, 5, 10)] == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="constant_with_warmup"):
        cfg(lr_scheduler_type="constant", warmup_steps=2)


def test_a_warmup_without_a_scheduler_warms_up_the_default_linear_schedule_as_in_trl():
    config = cfg(warmup_ratio=0.1, max_steps=20)
    assert (config.lr_scheduler_type, config.num_warmup_steps) == ("linear", 2)


def test_warmup_steps_override_warmup_ratio_which_rounds_up():
    assert cfg(lr_scheduler_type="linear", warmup_ratio=0.15).num_warmup_steps == 2  # ceil(1.5)
    assert cfg(lr_scheduler_type="linear", warmup_ratio=0.15, warmup_steps=4).num_warmup_steps == 4
    with pytest.raises(ConfigError, match="warmup_ratio"):
        cfg(lr_scheduler_type="linear", warmup_ratio=1.0)


def test_scheduler_steps_the_torch_optimizer_inside_the_wrappers_once_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    adamw = torch.optim.AdamW([param], lr=0.1)
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=adamw))  # accelerate -> ZeRO -> torch
    assert torch_optimizer(wrapped) is adamw
    scheduler = build_lr_scheduler(wrapped, cfg(lr_scheduler_type="linear", warmup_steps=2))
    lrs = []
    for _ in range(4):
        lrs.append(adamw.param_groups[0]["lr"])
        adamw.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.0875])  # 0.1 x [0, 1/2, 1, 7/8]
