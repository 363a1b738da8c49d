"""evaluate_served, the one held-out evaluation (training's `eval_steps` and the demo's figures): it asks the server
for `n` completions of each prompt under the named model and scores them as training does; mean, std and each
function's mean are over every completion. The server is a stand-in recording its calls."""

import statistics
from types import SimpleNamespace

import pytest

from asyncgrpo.data import PromptRow
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.evaluation import evaluate_served
from asyncgrpo.rollout.scoring import InThreadScoring


class DigitTokenizer:  # decoding is all scoring needs: ids 0-9 are the digits
    def __len__(self):
        return 10

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


class AnsweringServer:
    """`complete` answers every prompt with the given texts (digits), recording (model, n, temperature)."""

    def __init__(self, answers: dict[str, list[str]]):
        self.answers, self.calls = answers, []

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature):
        self.calls.append((model, n, max_tokens, temperature))
        prompt = "".join(str(i) for i in prompt_ids)
        return [SimpleNamespace(token_ids=[int(c) for c in text], finish_reason="stop")
                for text in self.answers[prompt][:n]]


def test_the_held_out_reward_is_scored_as_training_scores_under_the_named_adapter():
    rows = [PromptRow(prompt="07,45>", prompt_ids=[1], columns={"answer": "45"}),
            PromptRow(prompt="12,08>", prompt_ids=[2], columns={"answer": "12"})]
    server = AnsweringServer({"1": ["45", "7"], "2": ["12", "12"]})
    scorer = InThreadScoring(RewardScorer(["asyncgrpo.rewards:math_accuracy"]), DigitTokenizer())
    result = evaluate_served(server, "demo-run-v3", rows, scorer, max_tokens=4, temperature=1.0, n=2)
    assert server.calls == [("demo-run-v3", 2, 4, 1.0)] * 2
    assert (result.reward, result.completions) == (0.75, 4)
    assert result.reward_std == pytest.approx(statistics.stdev([1.0, 0.0, 1.0, 1.0]))
    assert result.metrics() == {"eval/reward": 0.75, "eval/reward_std": result.reward_std,
                                "eval/rewards/math_accuracy/mean": 0.75}


def scorer() -> InThreadScoring:
    return InThreadScoring(RewardScorer(["asyncgrpo.rewards:math_accuracy"]), DigitTokenizer())


def test_by_default_one_greedy_completion_per_prompt_and_one_completion_has_no_spread():
    # the demo's evaluation leaves temperature and n at their defaults: one greedy completion, which vLLM serves
    # (it refuses n > 1 at temperature 0)
    row = PromptRow(prompt="07,45>", prompt_ids=[1], columns={"answer": "45"})
    server = AnsweringServer({"1": ["45", "7"]})
    result = evaluate_served(server, "base", [row], scorer(), max_tokens=4)
    assert server.calls == [("base", 1, 4, 0.0)]
    assert (result.reward, result.reward_std, result.completions) == (1.0, 0.0, 1)  # no stdev of one value


def test_two_completions_are_enough_for_a_spread():
    row = PromptRow(prompt="07,45>", prompt_ids=[1], columns={"answer": "45"})
    result = evaluate_served(AnsweringServer({"1": ["45", "7"]}), "base", [row], scorer(), max_tokens=4,
                             temperature=1.0, n=2)
    assert (result.reward, result.completions) == (0.5, 2)
    assert result.reward_std == pytest.approx(statistics.stdev([1.0, 0.0]))  # 0.7071..., sample std
