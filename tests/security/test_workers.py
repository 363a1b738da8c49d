"""Reward worker processes (`reward_workers: N`) run user code: they must not hold the project's secrets. With every
key the project reads set in the training process, a reward function in a worker finds none of them, neither in
os.environ nor in the environment block its process started with, while an ordinary variable still reaches it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from liveness import returns_within

from asyncgrpo.config import SECRET_ENV_VARS
from asyncgrpo.data import PromptRow
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.reward_pool import RewardPool, TokenizerRef, worker_environment

HERE = str(Path(__file__).parent)
BOUND_S = 60.0  # liveness: a worker starts in ~1-2 s; only a pool that never answers trips it


@pytest.fixture
def secrets(monkeypatch):
    for name in ("ASYNCGRPO_VLLM_API_KEY", "ASYNCGRPO_ROLLOUT_KEY", "VLLM_API_KEY"):
        monkeypatch.setenv(name, f"s3cret-{name.lower()}")
    monkeypatch.setenv("ASYNCGRPO_TEST_VISIBLE", "yes")
    monkeypatch.syspath_prepend(HERE)  # before the workers start: they take the parent's sys.path


def test_the_secret_variables_are_the_ones_the_project_reads():
    assert set(SECRET_ENV_VARS) == {"ASYNCGRPO_VLLM_API_KEY", "ASYNCGRPO_ROLLOUT_KEY", "ASYNCGRPO_AGENT_KEY",
                                    "VLLM_API_KEY"}


def test_a_reward_function_in_a_worker_finds_no_secret(secrets):
    import worker_fns  # on sys.path from the fixture

    refs = ["worker_fns:secrets_seen", "worker_fns:visible_seen", "worker_fns:same_process"]
    row = PromptRow(prompt="07,45>", prompt_ids=[1, 2], columns={})
    # the same functions in this process see all three secrets: the check can see them
    assert worker_fns.secrets_seen([], ["x"]) == [3.0]
    pool = returns_within(lambda: RewardPool(1, RewardScorer(refs), TokenizerRef(".", "worker_fns", "DigitTokenizer"),
                                             timeout_s=BOUND_S), BOUND_S, "starting a reward pool")
    try:
        _, parts = returns_within(lambda: pool.score_group(row, [[4, 5]], ["stop"]), BOUND_S, "score_group")
    finally:
        pool.close()
    assert parts["same_process"] != [float(os.getpid())]  # it ran in the worker
    assert parts["visible_seen"] == [1.0]
    assert parts["secrets_seen"] == [0.0]


def test_the_worker_environment_keeps_everything_else(secrets):
    env = worker_environment()
    assert not set(SECRET_ENV_VARS) & set(env)
    assert env["ASYNCGRPO_TEST_VISIBLE"] == "yes"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(sys.modules["asyncgrpo"].__file__).resolve().parents[1])
