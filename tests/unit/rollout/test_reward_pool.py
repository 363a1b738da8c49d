"""RewardPool (`reward_workers: N`) with real spawned worker processes: the same rewards as scoring in the thread,
for text and chat rows, and clear errors (never a hang) when a reward function raises, hangs or kills its worker.

One pool per module (spawning a worker costs ~1-2 s): the failure tests run on its single worker, so the test after
a hang or a crash is served by the replacement. The reward functions live in reward_fns.py beside this file,
loaded by reference as a user's would be."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from liveness import returns_within

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import PromptRow, response_template_for
from asyncgrpo.errors import RewardFunctionError
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout import reward_pool
from asyncgrpo.rollout.build import make_group_scorer
from asyncgrpo.rollout.reward_pool import DECODING, WORKER_NICE, RewardPool, TokenizerRef
from asyncgrpo.rollout.scoring import InThreadScoring

HERE = str(Path(__file__).parent)
REFS = ["reward_fns:fingerprint", "reward_fns:misbehave", "reward_fns:torch_imported",
        "asyncgrpo.rewards:math_accuracy", "reward_fns:logs_step"]
WEIGHTS = [1.0, 1.0, 0.0, 1.0, 0.0]  # torch_imported differs between the test process and a worker: weight 0
TIMEOUT_S = 2.0  # reward_timeout of the pool: short, so that the hang test is quick
# A liveness bound on every call to a pool, far above its reward_timeout: a broken deadline in RewardPool._call, or a
# worker that is never seen as ready (each call would then wait WORKER_START_TIMEOUT_S, 120 s), fails the test here
# instead of hanging it. It also covers a replacement worker's start (~1-2 s) on its first use.
BOUND_S = 10 * TIMEOUT_S


@pytest.fixture(scope="module")
def reward_path():
    sys.path.insert(0, HERE)  # before the workers spawn: they get the parent's sys.path
    yield
    sys.path.remove(HERE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, reward_path):
    from transformers import AutoTokenizer  # heavy: transformers, only for the tests that score with a pool

    from asyncgrpo.toy.tokenizer import build_tokenizer  # heavy: transformers, as above

    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)  # as the trainer loads it (local_model_dir)


@pytest.fixture(scope="module")
def template(tokenizer):
    found = response_template_for(tokenizer, "qwen2")  # the tokenizer has a ChatML template; parse it as Qwen2's
    assert found is not None
    return found


@pytest.fixture(scope="module")
def pool(tokenizer, template):
    made = RewardPool(1, RewardScorer(REFS, WEIGHTS), TokenizerRef.of(tokenizer), template, timeout_s=TIMEOUT_S)
    yield made
    made.close()


def text_row(behave="ok"):
    return PromptRow(prompt="07,45>", prompt_ids=[1, 2], columns={"answer": "45", "behave": behave})


def chat_row(tokenizer, behave="ok"):
    messages = [{"role": "user", "content": "07,45>"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return PromptRow(prompt=messages, prompt_ids=[1, 2], columns={"answer": "45", "behave": behave},
                     rendered=rendered)


def same_scores(pooled, in_thread) -> bool:
    """Equal totals and parts, but for torch_imported (which tells the two processes apart)."""
    drop = lambda scores: (scores[0], {k: v for k, v in scores[1].items() if k != "torch_imported"})  # noqa: E731
    return drop(pooled) == drop(in_thread)


def ids(tokenizer, *texts):
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def score(pool, row, completion_ids, reasons, bound_s: float = BOUND_S):
    """`pool.score_group(...)` within the liveness bound: its value, or its error raised here."""
    return returns_within(lambda: pool.score_group(row, completion_ids, reasons), bound_s,
                          f"score_group on {row.prompt!r} with {len(completion_ids)} completions")


def test_pool_gives_the_in_thread_rewards_for_a_text_row(pool, tokenizer, template):
    in_thread = InThreadScoring(RewardScorer(REFS, WEIGHTS), tokenizer, template)
    four, five = ids(tokenizer, "4", "5")
    completion_ids = ids(tokenizer, "45", "07") + [four + [300] + five]  # 300: a padded vocab row: "4\ufffd5"
    reasons = ["stop", "stop", "length"]
    expected = in_thread.score_group(text_row(), completion_ids, reasons)
    assert same_scores(score(pool, text_row(), completion_ids, reasons), expected)
    rewards, parts = expected
    assert parts["math_accuracy"] == [1.0, 0.0, 0.0]
    assert parts["torch_imported"] == [1.0] * 3  # this test process has torch...
    # ...a spawned worker has not (a forked one would): checked here too, where the pool is made
    assert score(pool, text_row(), completion_ids, reasons)[1]["torch_imported"] == [0.0] * 3


def test_workers_do_not_import_torch(pool, tokenizer):
    _, parts = score(pool, text_row(), ids(tokenizer, "45"), ["stop"])
    assert parts["torch_imported"] == [0.0]  # ...the worker does not: it starts in ~1 s, not ~4


def test_workers_run_at_a_lower_cpu_priority_than_the_training_process(pool):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, w.process.pid) for w in pool._workers] == [min(mine + WORKER_NICE, 19)]


def test_pool_gives_the_in_thread_rewards_for_a_chat_row_with_parsed_messages(pool, tokenizer, template):
    in_thread = InThreadScoring(RewardScorer(REFS, WEIGHTS), tokenizer, template)
    completion_ids = ids(tokenizer, "<think>x</think>45<|im_end|>", "07")  # the second turn is not closed
    row = chat_row(tokenizer)
    expected = in_thread.score_group(row, completion_ids, ["stop", "length"])
    assert same_scores(score(pool, row, completion_ids, ["stop", "length"]), expected)
    # the fingerprints cover `parsed`: check that it was really parsed (content without the reasoning)
    assert expected[1]["math_accuracy"] == [1.0, 0.0]


def test_a_raising_function_gives_the_in_thread_error_text(pool, tokenizer, template):
    in_thread = InThreadScoring(RewardScorer(REFS, WEIGHTS), tokenizer, template)
    with pytest.raises(RewardFunctionError) as here:
        in_thread.score_group(text_row("raise"), ids(tokenizer, "45"), ["stop"])
    with pytest.raises(RewardFunctionError) as there:
        score(pool, text_row("raise"), ids(tokenizer, "45"), ["stop"])
    assert str(there.value) == str(here.value)
    assert "reward_fns:misbehave raised ValueError: misbehaving on purpose" in str(there.value)
    assert "'07,45>'" in str(there.value) and "reward_fallback" in str(there.value)
    assert "misbehave" in str(there.value.__cause__)  # the worker's traceback, chained
    assert pool.replaced == 0  # the worker survives a raising function


def test_a_hanging_function_is_stopped_at_reward_timeout_and_its_worker_replaced(pool, tokenizer):
    replaced = pool.replaced
    with pytest.raises(RewardFunctionError) as error:
        score(pool, text_row("hang"), ids(tokenizer, "45"), ["stop"])
    message = str(error.value)
    assert "reward function reward_fns:misbehave did not finish within reward_timeout=2 s" in message
    assert "'07,45>'" in message and "`reward_timeout`" in message
    assert pool.replaced == replaced + 1
    rewards, _ = score(pool, text_row(), ids(tokenizer, "45"), ["stop"])  # served by the new worker
    assert len(rewards) == 1


def test_a_worker_that_dies_gives_its_exit_code_the_function_and_the_prompt(pool, tokenizer):
    replaced = pool.replaced
    with pytest.raises(RewardFunctionError) as error:
        score(pool, text_row("crash"), ids(tokenizer, "45"), ["stop"])
    message = str(error.value)
    assert "the reward worker process died with exit code 3 while running reward function reward_fns:misbehave" \
        in message
    assert "'07,45>'" in message
    assert pool.replaced == replaced + 1
    _, parts = score(pool, text_row(), ids(tokenizer, "45"), ["stop"])
    assert parts["misbehave"] == [0.5]


def test_a_worker_killed_by_a_signal_names_the_signal(pool, tokenizer):
    with pytest.raises(RewardFunctionError, match=r"died with exit code -11 \(killed by SIGSEGV\) while running "
                                                  r"reward function reward_fns:misbehave"):
        score(pool, text_row("segfault"), ids(tokenizer, "45"), ["stop"])
    _, parts = score(pool, text_row(), ids(tokenizer, "45"), ["stop"])
    assert parts["misbehave"] == [0.5]


def test_reward_fallback_is_honoured_and_counted_through_the_pool(tokenizer, reward_path):
    fallback_pool = RewardPool(1, RewardScorer(["reward_fns:misbehave"], fallback=-1.0), TokenizerRef.of(tokenizer),
                               timeout_s=TIMEOUT_S * 5)
    try:
        rewards, parts = score(fallback_pool, text_row("raise"), ids(tokenizer, "45", "07"), ["stop", "stop"])
        assert rewards == [-1.0, -1.0] and parts == {"misbehave": [-1.0, -1.0]}
        score(fallback_pool, text_row("raise"), ids(tokenizer, "45"), ["stop"])
        assert fallback_pool.fallbacks == 3  # what reward/fallbacks_total logs
    finally:
        fallback_pool.close()
    assert not any(w.process.is_alive() for w in fallback_pool._workers)  # close() stopped them


def test_a_reward_module_the_worker_cannot_import_fails_the_pool_at_start(tokenizer, monkeypatch):
    scorer = RewardScorer(["asyncgrpo.rewards:format_reward"])
    scorer.refs = ["no_such_module_xyz:reward"]  # passed the parent's check, not importable in the worker
    with pytest.raises(RewardFunctionError, match="could not load the reward functions.*no_such_module_xyz"):
        RewardPool(1, scorer, TokenizerRef.of(tokenizer))


def test_reward_workers_picks_the_scorer_and_hands_it_the_rewards_config(tokenizer, template):
    ref, kwargs = "asyncgrpo.rewards:format_reward", {"format_reward": {"pattern": "^7$"}}
    values = {"model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters", "reward_funcs": [ref],
              "reward_weights": [2.5],
              "reward_fallback": -3.0, "reward_kwargs": kwargs}
    in_thread = make_group_scorer(AsyncGRPOConfig.from_dict(values), tokenizer, template)
    assert isinstance(in_thread, InThreadScoring)
    assert in_thread.tokenizer is tokenizer and in_thread.response_template is template
    scorer = in_thread.scorer
    assert (scorer.refs, scorer.weights, scorer.fallback, scorer.kwargs) == (
        [ref], [2.5], -3.0, kwargs)
    pooled = make_group_scorer(AsyncGRPOConfig.from_dict({**values, "reward_workers": 2, "reward_timeout": 7.0}),
                               tokenizer, template)
    try:
        assert isinstance(pooled, RewardPool) and pooled.workers == 2 and pooled.timeout_s == 7.0
        assert [w.process.name for w in pooled._workers] == ["reward-worker-0", "reward-worker-1"]
        assert pooled.spec == type(pooled.spec)([ref], [2.5], -3.0, kwargs, TokenizerRef.of(tokenizer), template)
    finally:
        pooled.close()


def test_a_pool_built_without_a_timeout_allows_the_configs_default_reward_timeout():
    # read off the signature: a pool spawns its workers when built, and this is all that would tell
    default = inspect.signature(RewardPool).parameters["timeout_s"].default
    config_default = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}["reward_timeout"]
    assert default == config_default == 60.0


def test_a_pool_of_no_workers_is_refused(tokenizer):
    with pytest.raises(AssertionError):  # (make_group_scorer builds none for reward_workers: 0) it would never score
        RewardPool(0, RewardScorer(["asyncgrpo.rewards:format_reward"]), TokenizerRef.of(tokenizer))


# ---- failures of the worker itself, with a tokenizer that misbehaves on purpose (reward_fns.MisbehavingTokenizer:
# a real tokenizer cannot be made to hang, exit or break its pipe on demand) --------------------------------------
@pytest.fixture(scope="module")
def decoding_pool(tmp_path_factory, reward_path):
    directory = tmp_path_factory.mktemp("misbehaving-tokenizer")
    tokenizer = TokenizerRef(str(directory), "reward_fns", "MisbehavingTokenizer")
    made = RewardPool(1, RewardScorer(["reward_fns:misbehave"]), tokenizer, timeout_s=TIMEOUT_S)
    yield made, directory
    made.close()


def test_a_hang_while_decoding_is_named_as_the_decoding_stage_not_as_a_reward_function(decoding_pool):
    pool, _ = decoding_pool
    with pytest.raises(RewardFunctionError) as error:
        score(pool, text_row(), [[1]], ["stop"])  # MisbehavingTokenizer: id 1 hangs in decode
    assert str(error.value).startswith(f"{DECODING} did not finish within reward_timeout=2 s\n  on prompt '07,45>'")
    assert pool.replaced == 1  # this pool's first replacement


def test_a_worker_that_exits_while_decoding_names_the_decoding_stage(decoding_pool):
    pool, _ = decoding_pool
    with pytest.raises(RewardFunctionError, match=re.escape(f"died with exit code 3 while running {DECODING}\n")):
        score(pool, text_row(), [[2]], ["stop"])  # id 2: os._exit(3) in decode


def test_a_worker_whose_pipe_breaks_while_it_lives_on_is_killed_and_replaced(decoding_pool, monkeypatch):
    pool, _ = decoding_pool
    monkeypatch.setattr(reward_pool, "WORKER_STOP_TIMEOUT_S", 0.5)  # the wait for an exit that will not come
    broken, replaced = pool._workers[0], pool.replaced
    with pytest.raises(RewardFunctionError) as error:
        score(pool, text_row(), [[3]], ["stop"])  # id 3: closes its pipe, then hangs
    assert f"the reward worker process died with exit code None while running {DECODING}" in str(error.value)
    assert broken.process.exitcode == -signal.SIGKILL and pool.replaced == replaced + 1  # killed, not left behind
    assert score(pool, text_row(), [[5]], ["stop"]) == ([0.5], {"misbehave": [0.5]})  # the new worker


def test_close_kills_a_worker_that_is_still_scoring(decoding_pool, monkeypatch):
    pool, directory = decoding_pool
    monkeypatch.setattr(reward_pool, "WORKER_STOP_TIMEOUT_S", 0.5)  # close()'s wait before it kills
    marker = directory / "hanging"
    marker.unlink(missing_ok=True)
    pool.timeout_s = 600.0  # the call itself would wait far longer than close()
    busy = pool._workers[0]
    outcomes: list = []

    def call():  # in a thread of its own, bounded by the join below: the test closes the pool while it waits
        try:
            outcomes.append(pool.score_group(text_row(), [[1]], ["stop"]))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcomes.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while not marker.exists():  # the worker is inside the hanging decode
        assert time.monotonic() < deadline, "the worker never started decoding"
        time.sleep(0.05)
    assert returns_within(pool.close, 30.0, "close() with a worker still scoring") is None
    assert busy.process.exitcode == -signal.SIGKILL
    caller.join(30)
    assert not caller.is_alive() and isinstance(outcomes[0], RewardFunctionError)  # the call ended too
    replaced = pool.replaced
    with pytest.raises(RewardFunctionError, match=re.escape("the reward pool was closed (the run is stopping)")):
        score(pool, text_row(), [[5]], ["stop"])
    assert pool.replaced == replaced  # a closed pool starts no worker in place of the killed one
    pool.close()  # a second close is a no-op


def test_close_kills_a_worker_whose_pipe_is_in_use_but_closes_the_pipe_only_once_its_user_lets_go(tokenizer,
                                                                                                  monkeypatch):
    """Closing a pipe another thread waits on raised EBADF in that thread (seen: close() during a call), or closed the
    descriptor number twice. Holding the worker's `io` lock stands for a call waiting on its pipe."""
    monkeypatch.setattr(reward_pool, "WORKER_STOP_TIMEOUT_S", 0.5)
    made = RewardPool(1, RewardScorer(["reward_fns:misbehave"]), TokenizerRef.of(tokenizer), timeout_s=TIMEOUT_S)
    worker = made._workers[0]
    worker.io.acquire()
    closing = threading.Thread(target=made.close, name="test-close", daemon=True)
    try:
        closing.start()
        deadline = time.monotonic() + BOUND_S
        while worker.process.exitcode is None:  # not asked to exit (its pipe is in use): killed after the short wait
            assert time.monotonic() < deadline, "close() did not kill a worker whose pipe was in use"
            time.sleep(0.05)
        assert worker.process.exitcode == -signal.SIGKILL
        assert not worker.conn.closed and closing.is_alive()  # the pipe waits for its user
    finally:
        worker.io.release()
    closing.join(BOUND_S)
    assert not closing.is_alive() and worker.conn.closed


def test_a_worker_that_never_gets_ready_fails_the_pool_at_its_start_timeout(reward_path):
    never = TokenizerRef("never-ready", "reward_fns", "MisbehavingTokenizer")  # its from_pretrained never returns
    with pytest.raises(RewardFunctionError) as error:
        returns_within(lambda: RewardPool(1, RewardScorer(["reward_fns:misbehave"]), never, start_timeout_s=1.0),
                       30.0, "RewardPool(start_timeout_s=1) with a worker that never gets ready")
    assert str(error.value).startswith("a reward worker process did not start within 1 s (exit code -9). Fix:")


def test_a_worker_stuck_in_a_function_exits_when_its_parent_is_sigkilled():
    # The parent starts a child that watches it (as each worker does) and then hangs, as in a reward function that
    # never returns; the parent is then SIGKILLed, which closes the pipe a hung worker never reads.
    child_code = ("import os, sys, threading; from asyncgrpo.rollout.reward_pool import exit_with_parent; "
                  "exit_with_parent(int(sys.argv[1]), poll_s=0.05); print(os.getpid(), flush=True); "
                  "threading.Event().wait()")
    parent_code = ("import os, subprocess, sys, time; "
                   f"subprocess.Popen([sys.executable, '-c', {child_code!r}, str(os.getpid())]); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert psutil.Process(child).ppid() == parent.pid
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _running(child):
            assert time.monotonic() < deadline, "the orphaned worker kept running"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_workers_functions_get_the_trainer_state_of_the_last_publish_and_what_they_log_comes_back(pool, tokenizer):
    pool.take_logged()  # what earlier tests' scoring logged
    pool.at_step(6, 3)
    try:
        _, parts = score(pool, text_row(), ids(tokenizer, "45", "7"), ["stop", "stop"])
    finally:
        pool.at_step(0, 0)  # the other tests compare with an in-thread scorer at step 0
    assert parts["logs_step"] == [3.0, 3.0]  # policy_version
    assert pool.take_logged() == ({"seen_step": [6.0]}, {"length": [2, 1]})
    assert pool.take_logged() == ({}, {})
