"""In-thread scoring (`reward_workers: 0`) with `reward_timeout`: a reward function that hangs stops the call within
the deadline with an error naming it (not 720 s later as a batch that never fills); a function that returns, or
raises, is unchanged by the deadline; and make_group_scorer hands the config's reward_timeout to it."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest
from fakes import DigitTokenizer, cfg
from liveness import returns_within

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import RewardFunctionError
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.build import make_group_scorer
from asyncgrpo.rollout.scoring import DECODING, InThreadScoring

DEADLINE_S = 0.3
BOUND_S = 5.0  # liveness: far above the deadline; only a deadline that never comes trips it


@pytest.fixture
def rewards(monkeypatch):
    """A reward module `scoring_fns` (loaded by reference, as a user's): `count_digits`, `stuck` (blocks on `release`
    until the test ends) and `broken` (raises)."""
    module = types.ModuleType("scoring_fns")
    module.release = threading.Event()
    module.count_digits = lambda prompts, completions, **_: [float(len(c)) for c in completions]

    def stuck(prompts, completions, **_):
        module.release.wait()
        return [0.0] * len(completions)

    def broken(prompts, completions, **_):
        raise ValueError("broken on purpose")

    module.stuck, module.broken = stuck, broken
    monkeypatch.setitem(sys.modules, "scoring_fns", module)
    yield module
    module.release.set()  # the left-behind scoring thread ends with the test


ROW = PromptRow(prompt="07,45>", prompt_ids=[1, 2], columns={})


def test_a_hung_reward_function_is_named_within_reward_timeout(rewards):
    scoring = InThreadScoring(RewardScorer(["scoring_fns:count_digits", "scoring_fns:stuck"]), DigitTokenizer(),
                              timeout_s=DEADLINE_S)
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError) as error:
        returns_within(lambda: scoring.score_group(ROW, [[4, 5], [1]], ["stop", "stop"]), BOUND_S, "score_group")
    took = time.monotonic() - t0
    assert DEADLINE_S <= took < BOUND_S
    message = str(error.value)
    assert message.startswith("reward function scoring_fns:stuck did not finish within reward_timeout=0.3 s")
    assert "'07,45>' (2 completions)" in message and "reward_workers: 2" in message
    # the caller is free again; the hung call's thread is a daemon, left running until released
    stuck = [t for t in threading.enumerate() if t.name == "reward-scoring"]
    assert stuck and all(t.daemon for t in stuck)


def test_rewards_and_errors_are_the_same_with_and_without_the_deadline(rewards):
    refs = ["scoring_fns:count_digits"]
    direct = InThreadScoring(RewardScorer(refs), DigitTokenizer())
    timed = InThreadScoring(RewardScorer(refs), DigitTokenizer(), timeout_s=BOUND_S)
    assert timed.score_group(ROW, [[4, 5], [1]], ["stop", "stop"]) == \
        direct.score_group(ROW, [[4, 5], [1]], ["stop", "stop"]) == ([2.0, 1.0], {"count_digits": [2.0, 1.0]})
    raising = InThreadScoring(RewardScorer(["scoring_fns:broken"]), DigitTokenizer(), timeout_s=BOUND_S)
    with pytest.raises(RewardFunctionError, match="scoring_fns:broken raised ValueError: broken on purpose"):
        raising.score_group(ROW, [[1]], ["stop"])


def test_a_call_stuck_decoding_names_that_stage_and_leaves_a_daemon_thread_whoever_called(rewards):
    """The deadline passes before any reward function runs (the tokenizer hangs). The caller is not a daemon thread
    (as an evaluation's pool threads are not): the scoring thread left behind must be one all the same, or the
    process could never exit."""
    release = threading.Event()

    class HungTokenizer(DigitTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            release.wait(BOUND_S)
            return super().decode(ids, skip_special_tokens)

    scoring = InThreadScoring(RewardScorer(["scoring_fns:count_digits"]), HungTokenizer(), timeout_s=DEADLINE_S)
    errors = []

    def call():
        try:
            scoring.score_group(ROW, [[4, 5]], ["stop"])
        except RewardFunctionError as exc:
            errors.append(str(exc))

    caller = threading.Thread(target=call, name="test-caller", daemon=False)
    try:
        caller.start()
        caller.join(BOUND_S)  # a liveness bound: the deadline is DEADLINE_S
        assert not caller.is_alive() and len(errors) == 1
        assert errors[0].startswith(f"{DECODING} did not finish within reward_timeout=0.3 s")
        left = [t for t in threading.enumerate() if t.name == "reward-scoring"]
        assert left and all(t.daemon for t in left)
    finally:
        release.set()


def test_finished_calls_leave_no_stage_behind(rewards):
    scoring = InThreadScoring(RewardScorer(["scoring_fns:count_digits"]), DigitTokenizer(), timeout_s=BOUND_S)
    for ids in ([[4, 5]], [[1], [2, 3]]):
        scoring.score_group(ROW, ids, ["stop"] * len(ids))
    raising = InThreadScoring(RewardScorer(["scoring_fns:broken"]), DigitTokenizer(), timeout_s=BOUND_S)
    with pytest.raises(RewardFunctionError):
        raising.score_group(ROW, [[1]], ["stop"])
    assert scoring._running == {} and raising._running == {}  # the stage of each finished call is forgotten


def test_make_group_scorer_applies_reward_timeout_in_thread(rewards):
    scoring = make_group_scorer(cfg(reward_funcs=["scoring_fns:count_digits"], reward_timeout=7.5), DigitTokenizer(),
                                None)
    assert isinstance(scoring, InThreadScoring) and scoring.timeout_s == 7.5


def test_episodes_are_scored_on_their_messages_with_the_rows_columns_the_last_answer_and_the_environments(rewards):
    seen = []

    def record(prompts, completions, trainer_state, log_metric, log_extra, **columns):  # TRL's, apart from columns
        seen.append({"prompts": prompts, "completions": completions, **columns})
        states.append(trainer_state)
        return [float(len(c)) for c in completions]

    states = []
    rewards.record = record
    scoring = InThreadScoring(RewardScorer(["scoring_fns:record"]), DigitTokenizer(), timeout_s=BOUND_S)
    row = PromptRow(prompt=[{"role": "user", "content": "07,45>"}], prompt_ids=[1], columns={"start": 3},
                    rendered="<rendered>")
    answer, call, result = ({"role": "assistant", "content": "7"}, {"role": "assistant", "tool_calls": []},
                            {"role": "tool", "name": "lookup", "content": "[2]"})
    messages = [[call, result, answer, result], [result]]  # the second episode never answered
    prompts = [row.prompt, [{"role": "user", "content": "07,45> (start 3)"}]]
    envs = [object(), object()]
    assert scoring.score_episodes(row, prompts, messages, [[4, 5], [6]], ["stop", "length"], envs) == \
        ([4.0, 1.0], {"record": [4.0, 1.0]})
    assert seen[0] == {"prompts": prompts, "completions": messages, "start": [3, 3], "environments": envs,
                       "completion_ids": [[4, 5], [6]], "truncated": [False, True], "parsed": [answer, None]}
    scoring.score_episodes(row, prompts, messages, [[4, 5], [6]], ["stop", "stop"], None)
    assert "environments" not in seen[1]  # no environment_factory: no such column
    assert states == [scoring.scorer.state] * 2


def test_a_hung_reward_function_on_episodes_is_named_with_the_prompt_within_reward_timeout(rewards):
    scoring = InThreadScoring(RewardScorer(["scoring_fns:stuck"]), DigitTokenizer(), timeout_s=DEADLINE_S)
    with pytest.raises(RewardFunctionError) as error:
        returns_within(lambda: scoring.score_episodes(ROW, ["p"] * 3, [[]] * 3, [[1]] * 3, ["stop"] * 3, None),
                       BOUND_S, "score_episodes")
    assert "reward function scoring_fns:stuck did not finish within reward_timeout=0.3 s" in str(error.value)
    assert "'07,45>' (3 completions)" in str(error.value)
    assert str(error.value).endswith(
        "\n  It runs in the training process (reward_workers: 0), where a thread cannot be stopped: it is left running."
        " Fix: find where the function hangs or make it faster, raise `reward_timeout`, or set `reward_workers: 2` "
        "(worker processes: a hung one is killed and replaced)")
