"""A completion is truncated when the length limit cut it off, read from its tokens: vLLM reports `length` also for
a completion whose end token was the last one allowed, which is whole. A stub server answers what vLLM answers
(finish_reason `length` with the EOS as the last token id), so that both cases reach the producer side by side."""

import json

from fakes import generation
from transformers import AutoTokenizer

from asyncgrpo.contracts import finish_reason_from_tokens
from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.build import end_token_ids
from asyncgrpo.trainer.batching import collate

EOS = 0


def test_length_with_an_end_token_last_is_a_stop_and_anything_else_keeps_its_reason():
    ends = frozenset({0, 5})
    assert finish_reason_from_tokens("length", [3, 4, 0], ends) == "stop"
    assert finish_reason_from_tokens("length", [3, 5], ends) == "stop"  # any end token (generation config's)
    assert finish_reason_from_tokens("length", [3, 0, 4], ends) == "length"  # an EOS earlier does not count
    assert finish_reason_from_tokens("length", [], ends) == "length"
    assert finish_reason_from_tokens("stop", [3, 4], ends) == "stop"  # a stop condition other than an end token
    assert finish_reason_from_tokens("abort", [0], ends) == "abort"


def test_an_eos_landing_exactly_at_max_tokens_is_not_truncated(rollout_on_stub):
    @generation
    def route(body):
        assert body["max_tokens"] == 3
        choices = [{"index": 0, "text": "77", "token_ids": [7, 7, EOS], "logprobs": {"token_logprobs": [-0.5] * 3},
                    "finish_reason": "length"},  # what vLLM answers: it checks the length before the EOS
                   {"index": 1, "text": "777", "token_ids": [7, 7, 7], "logprobs": {"token_logprobs": [-0.5] * 3},
                    "finish_reason": "length"}]
        return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})

    seen = {}

    def reward(prompts, completions, truncated, **columns):
        seen["truncated"] = truncated
        return [0.0] * len(completions)

    rollout = rollout_on_stub(route, rows=[PromptRow(prompt="p", prompt_ids=[1], columns={})], reward=reward,
                              groups_per_step=1, max_completion_length=3, mask_truncated_completions=True,
                              end_token_ids=frozenset({EOS}))
    try:
        [group] = rollout.run()
    finally:
        rollout_on_stub.stop(rollout.producer)
    assert seen["truncated"] == [False, True]
    assert group.finish_reasons == ["stop", "length"] and group.masked == [False, True]
    assert collate([group], pad_id=0)["mask"].sum(dim=1).tolist() == [3.0, 0.0]  # the whole one is trained on


def test_end_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path):
    from asyncgrpo.toy.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    assert end_token_ids(AutoTokenizer.from_pretrained(tmp_path), str(tmp_path)) == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert end_token_ids(tokenizer, str(tmp_path)) == {tokenizer.eos_token_id, 7, 9}
