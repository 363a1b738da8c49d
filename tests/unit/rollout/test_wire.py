"""What crosses the pipe to the rollout process (rollout/wire.py, rollout/process.py): a batch comes back exactly as
it was queued (ids, fp32 logprobs, rewards, advantages, masks, versions, finish reasons, reward parts), exceptions come
back with their own type and message or fall back to RolloutProcessError carrying both, and a child that dies makes
the next call raise naming the rollout process and its signal instead of waiting."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import time

import numpy as np
import pytest

from asyncgrpo.errors import ConfigError, InferenceServerError, RewardFunctionError, RolloutProcessError
from asyncgrpo.rollout.process import RolloutProcess
from asyncgrpo.rollout.queue import Group
from asyncgrpo.rollout.wire import decode_groups, encode_groups, pack_exception, rebuild_exception


def _fp32(values):
    return [float(np.float32(v)) for v in values]


def _groups() -> list[Group]:
    rng = np.random.default_rng(0)
    first = Group(prompt="23+19=", prompt_ids=[3, 53, 54, 46, 52, 60, 64],
                  completion_ids=[[55, 1], [150_000, 7, 9], []],
                  behaviour_logprobs=[_fp32([-0.25, -1e-7]), _fp32(rng.normal(size=3) - 3), []],
                  rewards=[1.0, 0.1 + 0.2, -3.5],
                  reward_parts={"accuracy": [1.0, None, 0.0], "format": [0.5, 0.25, None]},
                  advantages=[0.7071067811865476, -1 / 3, 1e-300], version=4, adapter="policy-ab12cd34-v4",
                  finish_reasons=["stop", "length", "abort"], index=17, masked=[False, True, False])
    second = Group(prompt="héllo ∑", prompt_ids=[2**31 - 1], completion_ids=[[0]],
                   behaviour_logprobs=[_fp32([-88.5])], rewards=[0.0], reward_parts={}, advantages=[0.0], version=0,
                   adapter="policy-ab12cd34-v0")
    return [first, second]  # the second: empty finish_reasons and masked, no reward parts, defaults


def test_a_batch_round_trips_exactly_through_the_binary_form():
    groups = _groups()
    blob = encode_groups(groups)
    assert isinstance(blob, bytes)
    assert decode_groups(blob) == groups  # dataclass equality: every field, every value, None parts and empty lists


def test_logprobs_travel_as_fp32_and_the_blob_is_smaller_than_pickled_groups():
    rng = np.random.default_rng(1)
    big = [Group(prompt="p", prompt_ids=list(range(20)), completion_ids=rng.integers(0, 150_000, (8, 256)).tolist(),
                 behaviour_logprobs=[(rng.normal(size=256) - 2).tolist() for _ in range(8)], rewards=[1.0] * 8,
                 reward_parts={}, advantages=[0.5] * 8, version=1, adapter="a") for _ in range(8)]
    back = decode_groups(encode_groups(big))
    assert back[3].behaviour_logprobs[5] == _fp32(big[3].behaviour_logprobs[5])  # rounded to fp32, nothing more
    assert back[3].behaviour_logprobs[5] != big[3].behaviour_logprobs[5]  # (fp64 inputs: the rounding is visible)
    tokens = 8 * 8 * 256
    # 4 bytes of id + 4 of logprob per token, plus a few per completion and the header
    assert 8 * tokens < len(encode_groups(big)) < 8 * tokens + 4096
    assert len(encode_groups(big)) < 0.7 * len(pickle.dumps(big))


def test_an_empty_batch_round_trips():
    assert decode_groups(encode_groups([])) == []


def _through_the_pipe(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001
        import traceback

        payload = pack_exception(raised, traceback.format_exc())
    return rebuild_exception(pickle.loads(pickle.dumps(payload)))


def test_project_exceptions_are_rebuilt_with_their_type_message_and_attributes():
    config = _through_the_pipe(ConfigError("max_inflight", "is 0", "set it to at least 1"))
    assert type(config) is ConfigError and config.field == "max_inflight"
    assert str(config) == "config `max_inflight`: is 0. Fix: set it to at least 1"
    server = _through_the_pipe(InferenceServerError("POST /v1/completions answered 500", status=500, body="boom"))
    assert type(server) is InferenceServerError and (server.status, server.body) == (500, "boom")
    reward = _through_the_pipe(RewardFunctionError("reward function `mine` raised ValueError: bad"))
    assert type(reward) is RewardFunctionError and str(reward) == "reward function `mine` raised ValueError: bad"
    assert any("raised in the rollout process" in note and "_through_the_pipe" in note for note in reward.__notes__)


def test_builtin_exceptions_are_rebuilt_too():
    timeout = _through_the_pipe(TimeoutError("no rollout batch after 160 s (3/8 groups queued)"))
    assert type(timeout) is TimeoutError and str(timeout) == "no rollout batch after 160 s (3/8 groups queued)"
    missing = _through_the_pipe(KeyError("completion"))
    assert type(missing) is KeyError and missing.args == ("completion",)


def test_an_exception_that_cannot_be_rebuilt_falls_back_with_its_type_message_and_traceback():
    class LocalError(Exception):  # defined in a function: cannot be imported by name in the trainer
        pass

    fallback = _through_the_pipe(LocalError("the reward server said no"))
    assert type(fallback) is RolloutProcessError
    text = str(fallback)
    assert "LocalError: the reward server said no" in text and "the rollout process raised" in text
    assert "its traceback in the rollout process" in text and "_through_the_pipe" in text


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(a)
        self.b = b

    def __str__(self):
        return f"{self.args[0]} and {self.b}"


def test_an_exception_whose_attributes_do_not_pickle_falls_back_with_its_message():
    exc = _NeedsTwo("first", b=lambda: None)  # the lambda does not pickle: the rebuilt one could not say "and <fn>"
    fallback = _through_the_pipe(exc)
    assert type(fallback) is RolloutProcessError and str(exc) in str(fallback)


def test_a_dead_rollout_process_is_reported_with_its_signal_not_waited_for():
    """A real child killed with SIGKILL (what the out-of-memory killer does): the call raises within a poll."""
    ctx = multiprocessing.get_context("spawn")
    cfg = type("Cfg", (), {"output_dir": "/tmp", "vllm_request_timeout": 1.0, "sync_mode": "versioned"})()
    proxy = RolloutProcess(cfg, model_path="m", peft_config=None, groups_per_step=1)
    proxy._conn, child_end = ctx.Pipe()
    proxy.process = ctx.Process(target=time.sleep, args=(600,))
    proxy.process.start()
    child_end.close()
    proxy.process.kill()
    with pytest.raises(RolloutProcessError) as failure:
        proxy.take(8, version=0, timeout_s=600)
    assert "the rollout process" in str(failure.value) and "killed by SIGKILL" in str(failure.value)
    assert "`take`" in str(failure.value) and "Fix:" in str(failure.value)
    with pytest.raises(RolloutProcessError, match="killed by SIGKILL"):
        proxy.stats()  # and every later call, without touching the pipe again
    proxy.close(keep_final=False)  # safe on a dead child
    assert proxy.process.exitcode == -signal.SIGKILL
