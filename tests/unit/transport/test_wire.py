"""What crosses the pipe to the rollout process (transport/wire.py, transport/process.py): a batch comes back exactly as
it was queued (ids, fp32 logprobs, rewards, advantages, masks, versions, finish reasons, reward parts), exceptions come
back with their own type and message or fall back to RolloutProcessError carrying both, and a child that dies makes
the next call raise naming the rollout process and its signal instead of waiting."""

from __future__ import annotations

import multiprocessing
import pickle
import errno
import signal
import struct
import time
import traceback

import numpy as np
import pytest

from asyncgrpo.errors import ConfigError, InferenceServerError, RewardFunctionError, RolloutProcessError
from asyncgrpo.transport.process import RolloutProcess
from asyncgrpo.transport import wire
from asyncgrpo.contracts import Group
from asyncgrpo.transport.wire import decode_groups, encode_groups, pack_exception, rebuild_exception


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
    third = Group(prompt="2*3=", prompt_ids=[7, 8], completion_ids=[[11, 12], [13]],
                  behaviour_logprobs=[_fp32([-0.5, -2.0]), _fp32([-0.125])], rewards=[0.25, -1.0],
                  reward_parts={"accuracy": [0.0, 1.0], "length": [None, -0.5]}, advantages=[0.5, -0.5], version=5,
                  adapter="policy-ab12cd34-v5", finish_reasons=["stop", "stop"], index=18, masked=[True, False],
                  loss_mask=[[0, 1], [1]], versions=[[5, 4], [5]])  # an episode: a tool token, a turn at v4
    # the second: empty finish_reasons and masked, no reward parts, defaults; the third: reward parts and masks
    # after a group that had some (each group reads its own slice, not the first group's)
    return [first, second, third]


def test_a_batch_round_trips_exactly_through_the_binary_form():
    groups = _groups()
    blob = encode_groups(groups)
    assert isinstance(blob, bytes)
    assert decode_groups(blob) == groups  # dataclass equality: every field, every value, None parts and empty lists


def test_episode_groups_read_their_masks_and_versions_at_their_own_offsets():
    # three completions in the first episode group and a second one after it: each row of loss_mask and versions
    # starts where the one before ended, whichever completion or group it belongs to
    first = Group(prompt="a", prompt_ids=[1], completion_ids=[[1, 2], [3], [4, 5, 6]],
                  behaviour_logprobs=[[-1.0, -2.0], [-3.0], [-4.0, -5.0, -6.0]], rewards=[1.0, 0.0, 0.5],
                  reward_parts={}, advantages=[0.5, -0.5, 0.0], version=7, adapter="p-v7",
                  loss_mask=[[1, 0], [1], [1, 0, 1]], versions=[[10, 11], [12], [13, 14, 15]])
    second = Group(prompt="b", prompt_ids=[2], completion_ids=[[7, 8]], behaviour_logprobs=[[-0.5, -0.25]],
                   rewards=[0.0], reward_parts={}, advantages=[0.0], version=8, adapter="p-v8",
                   loss_mask=[[0, 1]], versions=[[16, 17]])
    back = decode_groups(encode_groups([first, second]))
    assert [g.loss_mask for g in back] == [[[1, 0], [1], [1, 0, 1]], [[0, 1]]]
    assert [g.versions for g in back] == [[[10, 11], [12], [13, 14, 15]], [[16, 17]]]
    assert back == [first, second]


def test_decoded_values_have_the_python_types_the_group_declares():
    back = decode_groups(encode_groups(_groups()))
    # (equality alone would accept 3.0 for 3 and 0.0 for False)
    assert all(type(t) is int for g in back for t in g.prompt_ids)
    assert all(type(m) is bool for g in back for m in g.masked) and back[0].masked == [False, True, False]
    assert all(type(v) is int for g in back for v in (g.version, g.index))


def test_integer_rewards_advantages_and_parts_come_back_as_floats():
    """An integer reward (e.g. a `reward_fallback: 0` in YAML) is stored as float64 like every other reward."""
    group = Group(prompt="p", prompt_ids=[1], completion_ids=[[2], [3]], behaviour_logprobs=[[-1.0], [-2.0]],
                  rewards=[1, 0], reward_parts={"accuracy": [1, 0]}, advantages=[1, -1], version=2, adapter="a")
    (back,) = decode_groups(encode_groups([group]))
    assert back == group
    assert [type(v) for v in back.rewards + back.advantages] == [float] * 4
    assert [type(v) for v in back.reward_parts["accuracy"]] == [float, float]


def test_the_blob_is_a_length_a_pickled_header_and_the_arrays_in_their_documented_dtypes():
    groups = _groups()
    blob = encode_groups(groups)
    (size,) = struct.unpack_from("<I", blob, 0)
    header = pickle.loads(blob[4:4 + size])
    assert header["format"] == 1
    assert header["arrays"] == [
        ("prompt_ids", "<i4", 10), ("prompt_lens", "<i4", 3),
        ("completion_ids", "<i4", 9), ("completion_lens", "<i4", 6),
        ("logprobs", "<f4", 9), ("logprob_lens", "<i4", 6),
        ("n_completions", "<i4", 3), ("rewards", "<f8", 6), ("advantages", "<f8", 6), ("masked", "|u1", 5),
        ("version", "<i8", 3), ("index", "<i8", 3), ("loss_mask", "|u1", 3), ("token_versions", "<i8", 3),
        ("part_values", "<f8", 10), ("part_present", "|u1", 10)]
    assert len(blob) == 4 + size + sum(np.dtype(dtype).itemsize * count for _, dtype, count in header["arrays"])


def test_a_blob_of_another_format_is_refused_naming_its_format(monkeypatch):
    monkeypatch.setattr(wire, "_FORMAT", 2)
    blob = encode_groups(_groups())
    monkeypatch.setattr(wire, "_FORMAT", 1)
    with pytest.raises(AssertionError, match="^2$"):
        decode_groups(blob)


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


class _Outer:
    class NestedError(Exception):  # qualname "_Outer.NestedError": found by walking the dotted name
        pass


def test_an_exception_class_nested_in_a_class_is_rebuilt_as_itself():
    nested = _through_the_pipe(_Outer.NestedError("inner"))
    assert type(nested) is _Outer.NestedError and str(nested) == "inner"


def test_an_os_error_is_rebuilt_as_its_subclass_with_errno_and_strerror():
    missing = _through_the_pipe(OSError(errno.ENOENT, "No such file or directory"))
    assert type(missing) is FileNotFoundError  # OSError's constructor arguments pick the subclass and set errno
    assert (missing.errno, missing.strerror) == (errno.ENOENT, "No such file or directory")
    assert str(missing) == "[Errno 2] No such file or directory"


def test_the_childs_traceback_is_one_note_without_its_trailing_newline():
    payload = pack_exception(ValueError("bad value"), "Traceback (most recent call last):\n  File \"x.py\"\n"
                                                      "ValueError: bad value\n\n")
    rebuilt = rebuild_exception(payload)
    assert type(rebuilt) is ValueError and rebuilt.args == ("bad value",)
    assert rebuilt.__notes__ == ["--- raised in the rollout process ---\nTraceback (most recent call last):\n"
                                 "  File \"x.py\"\nValueError: bad value"]


def test_an_exception_whose_args_do_not_pickle_still_travels_as_its_message():
    exc = ValueError(lambda: None)  # the args are left out of the payload, so that the payload itself pickles
    fallback = _through_the_pipe(exc)
    assert type(fallback) is RolloutProcessError
    assert f"builtins.ValueError: {exc}" in str(fallback) and "_through_the_pipe" in str(fallback)


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
    proxy.peer.conn, child_end = ctx.Pipe()
    proxy.peer.process = ctx.Process(target=time.sleep, args=(600,))
    proxy.peer.process.start()
    child_end.close()
    proxy.peer.process.kill()
    with pytest.raises(RolloutProcessError) as failure:
        proxy.take(8, version=0, timeout_s=600)
    assert "the rollout process" in str(failure.value) and "killed by SIGKILL" in str(failure.value)
    assert "`take`" in str(failure.value) and "Fix:" in str(failure.value)
    with pytest.raises(RolloutProcessError, match="killed by SIGKILL"):
        proxy.stats()  # and every later call, without touching the pipe again
    proxy.close(keep_final=False)  # safe on a dead child
    assert proxy.peer.process.exitcode == -signal.SIGKILL
