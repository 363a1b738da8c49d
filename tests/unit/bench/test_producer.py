"""`asyncgrpo bench producer`: its load generator answers in vLLM's shape (parsed by the real InferenceClient), its
fixed completions score as the bench says with the built-in math reward, and a short run reports what it counted.
No speed is asserted: the figures depend on the machine."""

import dataclasses
import json

import pytest
import requests

from asyncgrpo.bench import producer as bench
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rewards import math_accuracy
from asyncgrpo.toy.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_fixed_completions_have_the_length_asked_and_alternate_right_and_wrong_answers(tokenizer):
    completions = bench.bench_completions(tokenizer, 256, 8)
    assert [len(c["token_ids"]) for c in completions] == [256] * 8
    assert all(c["token_ids"][-1] == tokenizer.eos_token_id for c in completions)
    assert all(len(c["logprobs"]) == len(c["tokens"]) == 256 for c in completions)
    assert all(-2.0 < lp < 0.0 for c in completions for lp in c["logprobs"])
    row = bench.bench_rows(tokenizer, 1)[0]
    rewards = math_accuracy([row.prompt] * 8, [c["text"] for c in completions], answer=[row.columns["answer"]] * 8)
    assert rewards == [1.0, 0.0] * 4


def test_load_generator_answers_n_choices_in_vllms_shape_cut_at_max_tokens(tokenizer):
    completions = bench.bench_completions(tokenizer, 32, 3)
    with bench.LoadGenerator(completions) as gen:
        client = InferenceClient(gen.url)
        got = client.complete("bench-v0", [5, 6, 7], n=4, max_tokens=32)
        assert [c.token_ids for c in got] == [completions[i % 3]["token_ids"] for i in range(4)]
        assert [c.logprobs for c in got] == [completions[i % 3]["logprobs"] for i in range(4)]
        assert [c.finish_reason for c in got] == ["stop"] * 4
        assert [c.model for c in got] == ["bench-v0"] * 4
        cut = client.complete("bench-v0", [5], n=2, max_tokens=10)
        assert [c.token_ids for c in cut] == [completions[i]["token_ids"][:10] for i in range(2)]
        assert [c.finish_reason for c in cut] == ["length"] * 2
        raw = requests.post(f"{gen.url}/v1/completions", json={"model": "m", "prompt": [9, 8], "n": 1,
                                                               "max_tokens": 4}).json()
        choice = raw["choices"][0]
        assert choice["prompt_token_ids"] == [9, 8]
        assert choice["logprobs"]["tokens"] == completions[0]["tokens"][:4]
        assert choice["logprobs"]["top_logprobs"] == [{t: lp} for t, lp in zip(completions[0]["tokens"][:4],
                                                                                completions[0]["logprobs"][:4])]
        assert choice["logprobs"]["text_offset"][0] == 0
        assert raw["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
        stats = requests.get(f"{gen.url}/stats").json()
        assert stats == {"requests": 3, "tokens": 4 * 32 + 2 * 10 + 4}
        client.close()
    assert gen.process.poll() is not None  # stopped on leaving the block


def test_a_short_run_reports_tokens_per_second_as_tokens_counted_over_the_window():
    result = bench.run(duration_s=0.3, warmup_s=0.2, workers=(0,))
    assert json.loads(json.dumps(result)) == result  # plain JSON
    (run,) = result["runs"]
    assert run["workers"] == 0
    assert run["tokens_ingested"] > 0
    assert run["tokens_ingested"] == run["groups_ingested"] * 8 * 256  # every group: 8 completions of 256 tokens
    assert run["tokens_per_s"] == pytest.approx(run["tokens_ingested"] / run["duration_s"], rel=1e-4)
    assert run["tokens_per_producer_cpu_s"] == pytest.approx(run["tokens_ingested"] / run["cpu_s"]["producer_process"],
                                                            rel=1e-2)  # cpu_s is rounded to ms
    assert run["duration_s"] >= 0.3
    assert set(run["stages_cpu_s"]) >= {"http_json", "decode", "reward", "queue_put", "other"}
    assert run["batches_taken"] >= 1  # the consumer took batches, so the schedule kept sending
    assert result["settings"] | {"duration_s": 0.3} == result["settings"]
    assert (result["settings"]["num_generations"], result["settings"]["completion_length"],
            result["settings"]["max_inflight"]) == (8, 256, 32)
    known = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert result["reward_workers_supported"] == ("reward_workers" in known)
