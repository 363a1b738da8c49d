"""What the producer sends for each prompt, and what it puts in a group from the answer. The real `InferenceClient`
talks to an in-process stub HTTP server that records each request body: a real vLLM server does not show what it was
sent, nor answer a chosen finish reason (`abort`, `length`) on demand (tests/integration/test_training.py and
test_policy_equivalence.py run the same path against a real server)."""

import threading
import time

import pytest
from fakes import generation

from asyncgrpo.data import PromptRow

DEADLINE_S = 15.0


def test_each_request_states_every_sampling_field_the_adapter_and_the_prompt(rollout_on_stub):
    rollout = rollout_on_stub(temperature=0.7, max_completion_length=5, num_generations=2)
    groups = rollout.run(version=3, adapter="demo-v3")
    bodies = sorted(rollout.generation_bodies(), key=lambda b: b["prompt"])
    assert len(bodies) == 2
    prompts = sorted(g.prompt_ids for g in groups)
    for body, prompt in zip(bodies, prompts):
        assert body == {"model": "demo-v3", "prompt": prompt, "n": 2, "max_tokens": 5, "temperature": 0.7,
                        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                        "frequency_penalty": 0.0, "logprobs": 0, "return_token_ids": True}  # no "seed": not seeded
    assert [(g.version, g.adapter) for g in groups] == [(3, "demo-v3"), (3, "demo-v3")]


def test_seeded_generation_seeds_each_request_by_its_prompts_data_position(rollout_on_stub):
    rollout = rollout_on_stub(seeded_generation=True, seed=5, num_generations=2)
    groups = rollout.run()
    seed_by_prompt = {tuple(b["prompt"]): b["seed"] for b in rollout.generation_bodies()}
    # request_seed(5, index, 2) = 5 * 1_000_003 + 2 * index: data positions 0 and 1
    assert {g.index: seed_by_prompt[tuple(g.prompt_ids)] for g in groups} == {0: 5_000_015, 1: 5_000_017}


def test_a_group_carries_finish_reasons_reward_parts_and_the_token_count(rollout_on_stub):
    seen = []

    def reward(prompts, completions, completion_ids, truncated, answer, **rest):
        seen.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                     "truncated": truncated, "answer": answer, "rest": sorted(rest)})
        return [1.0 if text == answer[0] else 0.0 for text in completions]

    @generation
    def route(body):
        return rollout_on_stub.answer(body, [[4, 2], [7, 7, 7]], ["stop", "length"])

    rows = [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={"answer": "42"}) for i in range(4)]
    rollout = rollout_on_stub(route, rows=rows, reward=reward, groups_per_step=2, num_generations=2)
    groups = rollout.run()
    for g in groups:
        assert g.finish_reasons == ["stop", "length"]
        assert g.reward_parts == {"format_reward": [1.0, 0.0]}
        assert g.rewards == [1.0, 0.0]
        assert g.prompt == f"p{g.prompt_ids[0]}"  # a text prompt: its text
        assert g.masked == []  # mask_truncated_completions off
    assert rollout.producer.generated_tokens == 2 * (2 + 3)  # both groups' tokens, added up
    assert len(seen) == 2
    for call in seen:
        assert call["prompts"][0] == call["prompts"][1] and call["prompts"][0].startswith("p")
        assert len(call["prompts"]) == 2
        assert call["completions"] == ["42", "777"]
        assert call["completion_ids"] == [[4, 2], [7, 7, 7]]
        assert call["truncated"] == [False, True]
        assert call["answer"] == ["42", "42"]  # each dataset column, once per completion
        assert call["rest"] == ["log_extra", "log_metric", "trainer_state"]  # TRL's; a text prompt: no `parsed`


def test_a_group_aborted_by_a_sync_is_lost_and_its_prompt_sent_again_first(rollout_on_stub):
    prompts_sent = []

    @generation
    def route(body):
        prompts_sent.append(body["prompt"])
        # the first request is aborted by a sync (`/pause?mode=abort`) after one of its completions finished
        reasons = ["stop", "abort"] if len(prompts_sent) == 1 else ["stop", "stop"]
        return rollout_on_stub.answer(body, [[7], [7]], reasons)

    rollout = rollout_on_stub(route)
    groups = rollout.run()
    rollout_on_stub.stop(rollout.producer)
    assert (rollout.producer.lost_groups, rollout.producer.resent_groups) == (1, 1)
    assert prompts_sent[0] == prompts_sent[1]  # the aborted prompt, again, before the next one
    assert sorted(g.index for g in groups) == [0, 1]  # no prompt of the data order skipped
    assert all(g.finish_reasons == ["stop", "stop"] for g in groups)
    assert rollout.producer.generated_tokens == 4  # the aborted answer's tokens are not counted


def test_batch_scaling_leaves_groups_centred_only_until_the_queue_scales_the_whole_batch(rollout_on_stub):
    @generation
    def seven_and_three(body):  # completion 0 is "7" (reward 1), completion 1 is "3" (reward 0)
        return rollout_on_stub.answer(body, [[7], [3]])

    rollout = rollout_on_stub(seven_and_three, scale_rewards="batch")
    groups = rollout.run()
    # each group: rewards (1, 0), centred (0.5, -0.5); divided once, by the std of (1, 0, 1, 0) = sqrt(1/3), + eps
    std = (1 / 3) ** 0.5
    assert [g.advantages for g in groups] == [pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])] * 2


@pytest.mark.parametrize("late", ["answer", "error"])
def test_an_answer_or_error_that_arrives_after_stop_is_dropped_unscored_and_unreported(rollout_on_stub, take_within, late):
    arrived, release = threading.Event(), threading.Event()
    scored = []

    @generation
    def route(body):
        arrived.set()
        assert release.wait(DEADLINE_S)
        if late == "error":  # a run that ended normally: a request failing afterwards is not the run's error
            return 500, "application/json", '{"error": "engine dead"}'
        return rollout_on_stub.answer(body, [[7], [7]])

    rollout = rollout_on_stub(route, reward=lambda prompts, completions, **c: scored.append(1) or [1.0, 1.0])
    rollout.producer.start()
    rollout.producer.set_policy(0, "demo-v0")
    assert arrived.wait(DEADLINE_S)
    rollout_on_stub.stop(rollout.producer)  # returns with the request still held by the server
    release.set()
    deadline = time.monotonic() + DEADLINE_S
    while rollout.producer.inflight:  # the request's thread ends once its answer is handled
        assert time.monotonic() < deadline, "the held request never finished"
        time.sleep(0.005)
    assert (scored, len(rollout.queue), rollout.producer.generated_tokens) == ([], 0, 0)
    assert rollout.producer.error is None
    with pytest.raises(TimeoutError):  # nothing handed to the trainer either
        take_within(rollout.queue, 1, timeout_s=0.01)
