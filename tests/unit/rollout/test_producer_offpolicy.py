"""Where the server's logprobs and rewards enter the trainer: absurd logprobs refused by name, `truncated` handed to
reward functions and masked out of the loss, `scale_rewards: batch` applied to the batch the queue hands out.
A stub HTTP server stands in for vLLM: a real one cannot be made to answer a NaN or -inf logprob on demand."""

import json
import math
import time
from types import SimpleNamespace

import pytest
from fakes import generation
import torch

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import BehaviourLogprobError
from asyncgrpo.rollout.producer import BEHAVIOUR_LOGPROB_FLOOR, check_behaviour_logprobs
from asyncgrpo.contracts import Group
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.trainer.batching import collate


def completion(logprobs, finish_reason="stop"):
    return SimpleNamespace(token_ids=[7] * len(logprobs), logprobs=logprobs, finish_reason=finish_reason)


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf, -9999.0])
def test_absurd_behaviour_logprobs_are_refused_naming_server_request_and_token(bad):
    with pytest.raises(BehaviourLogprobError) as err:
        check_behaviour_logprobs([completion([-0.1]), completion([-0.2, bad])], server="http://10.0.0.5:8000",
                                 prompt_index=42, adapter="policy-ab12-v3")
    message = str(err.value)
    for part in ("http://10.0.0.5:8000", "token 1", "completion 1", "prompt 42", "'policy-ab12-v3'", "Fix:"):
        assert part in message, part


def test_the_refusal_says_which_value_token_id_and_floor_and_how_to_serve_instead():
    with pytest.raises(BehaviourLogprobError) as err:
        check_behaviour_logprobs([completion([-0.1, -9999.0])], server="http://s:1", prompt_index=3, adapter="p-v1")
    assert str(err.value) == (
        "http://s:1 returned logprob -9999.0 for token 1 (id 7) of completion 0 of the request for prompt 3 (adapter "
        "'p-v1'): no sampled token can have it (the floor is -1000.0). Fix: serve in float32 or bfloat16 rather than "
        "float16 (overflow), with `--logprobs-mode processed_logprobs`, and check the adapter loaded correctly")


def test_unlikely_but_possible_logprobs_pass():
    check_behaviour_logprobs([completion([-100.0, BEHAVIOUR_LOGPROB_FLOOR, 0.0])], server="s", prompt_index=0,
                             adapter="a")


def test_a_logprob_exactly_at_the_floor_is_not_the_token_named():
    # the completion is refused for its NaN; the token before it, at the floor itself, is a possible value
    with pytest.raises(BehaviourLogprobError, match=r"returned logprob nan for token 1 \(id 7\)"):
        check_behaviour_logprobs([completion([BEHAVIOUR_LOGPROB_FLOOR, math.nan])], server="s", prompt_index=0,
                                 adapter="a")


def test_the_check_finds_the_bad_token_wherever_it_is_and_passes_sums_that_overflow():
    # The check sums each completion's logprobs first (NaN or an infinity anywhere makes the sum one) and only then
    # walks the tokens: a finite list whose sum overflows must still pass, a bad value anywhere must still be named.
    check_behaviour_logprobs([completion([1e308, 1e308, -1.0])], server="s", prompt_index=0, adapter="a")
    for bad in ([-math.inf, math.inf], [-0.5] * 300 + [math.nan], [-1001.0] + [-0.1] * 5):
        with pytest.raises(BehaviourLogprobError, match="for token 0 |for token 300 "):
            check_behaviour_logprobs([completion(bad)], server="s", prompt_index=0, adapter="a")


def run_producer(rollout_on_stub, choices, **cfg_values):
    @generation
    def route(body):
        return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})

    seen = {}

    def reward(prompts, completions, truncated, **columns):  # TRL signature, with the new `truncated` column
        seen["truncated"] = truncated
        return [0.0 if t else 1.0 for t in truncated]

    rollout = rollout_on_stub(route, rows=[PromptRow(prompt="p", prompt_ids=[1], columns={})], reward=reward,
                              groups_per_step=1, **cfg_values)
    try:
        return rollout.run(), seen
    finally:
        rollout_on_stub.stop(rollout.producer)


def choice(i, logprobs, finish_reason):
    return {"index": i, "text": "7", "token_ids": [7] * len(logprobs), "logprobs": {"token_logprobs": logprobs},
            "finish_reason": finish_reason}


def test_a_server_answering_minus_9999_stops_the_run_with_its_url(rollout_on_stub):
    with pytest.raises(BehaviourLogprobError,
                       match=r"http://127\.0\.0\.1:\d+ returned logprob -9999\.0 .* of completion 1 of the request for "
                             r"prompt 0 \(adapter 'demo-v0'\)"):
        run_producer(rollout_on_stub, [choice(0, [-0.5], "stop"), choice(1, [-9999.0], "stop")])


def test_truncated_completions_reach_the_reward_functions_and_leave_the_loss(rollout_on_stub):
    choices = [choice(0, [-0.5, -0.5], "length"), choice(1, [-0.5], "stop")]
    [group], seen = run_producer(rollout_on_stub, choices, mask_truncated_completions=True)
    assert seen["truncated"] == [True, False] and group.rewards == [0.0, 1.0]
    assert group.masked == [True, False]
    batch = collate([group], pad_id=0)
    assert batch["mask"].sum(dim=1).tolist() == [0.0, 1.0]  # the truncated row trains on nothing
    assert batch["input_ids"][0].tolist() == [1, 7, 7]  # but is still there (the same shapes on every rank)
    [kept], _ = run_producer(rollout_on_stub, choices)  # the default: scored as truncated, still trained on
    assert kept.masked == [] and collate([kept], pad_id=0)["mask"].sum(dim=1).tolist() == [2.0, 1.0]


def test_batch_scaling_divides_by_the_std_of_the_whole_batch():
    # Rewards [1, 0] and [1, 1], centred by the producer: [0.5, -0.5] and [0, 0]. std([1, 0, 1, 1]) = 0.5.
    def g(rewards, advantages, index):
        return Group(prompt="p", prompt_ids=[1], completion_ids=[[2], [3]], behaviour_logprobs=[[-1.0], [-1.0]],
                     rewards=rewards, reward_parts={}, advantages=advantages, version=0, adapter="a", index=index)

    q = RolloutQueue(max_staleness=0, scale_rewards="batch")
    q.put(g([1.0, 0.0], [0.5, -0.5], 0))
    q.put(g([1.0, 1.0], [0.0, 0.0], 1))
    first, second = q.take(2, trainer_version=0, timeout_s=1)
    assert first.advantages == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001]) and second.advantages == [0.0, 0.0]
    assert torch.tensor(first.advantages).abs().max().item() == pytest.approx(0.99980, abs=1e-5)


def test_dynamic_sampling_drops_zero_std_groups_at_the_queue_and_counts_them():
    def g(rewards, index):
        return Group(prompt="p", prompt_ids=[1], completion_ids=[[2], [3]], behaviour_logprobs=[[-1.0], [-1.0]],
                     rewards=rewards, reward_parts={}, advantages=[0.0, 0.0], version=0, adapter="a", index=index)

    q = RolloutQueue(max_staleness=0, dynamic_sampling=True)
    for i, rewards in enumerate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]):
        q.put(g(rewards, i))
    assert (len(q), q.dropped_zero_std) == (1, 2)
    plain = RolloutQueue(max_staleness=0)
    plain.put(g([1.0, 1.0], 0))
    assert (len(plain), plain.dropped_zero_std) == (1, 0)


def test_the_producer_refills_what_dynamic_sampling_dropped(rollout_on_stub):
    # The first answer has one truncated completion of two (rewards 0 and 1); every answer after it has none
    # (rewards 1 and 1: zero std, dropped). One group per batch, one request in flight, max_staleness 1 (batch 1 may
    # be generated from version 0): batch 1's group never comes, but each dropped request is replaced and counted.
    answers = []

    @generation
    def route(body):
        first = not answers
        answers.append(1)
        choices = [choice(0, [-0.5], "length" if first else "stop"), choice(1, [-0.5], "stop")]
        return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})

    rows = [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={}) for i in range(50)]
    rollout = rollout_on_stub(route, rows=rows, groups_per_step=1, max_staleness=1, dynamic_sampling=True,
                              reward=lambda prompts, completions, truncated, **c: [0.0 if t else 1.0 for t in truncated])
    producer, queue = rollout.producer, rollout.queue
    producer.start()
    try:
        producer.set_policy(0, "demo-v0")
        [kept] = queue.take(1, trainer_version=0, timeout_s=15)
        assert kept.rewards == [0.0, 1.0] and kept.index == 0
        deadline = time.monotonic() + 30
        while queue.dropped_zero_std < 3:  # the next batch's slot keeps being refilled after each drop
            assert time.monotonic() < deadline, "the producer did not replace the dropped groups"
            with queue.cond:
                queue.cond.wait(timeout=0.1)
    finally:
        rollout_on_stub.stop(producer)
    assert len(answers) >= 4 and len(queue) == 0
