"""The rollout producer when a server dies under a request. A stub HTTP server stands in for vLLM: a real one cannot
be made to drop exactly the first generation request on demand (the integration test kills a real server, but
whether a request is in flight at that moment is timing)."""

import json

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import PromptRow
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.producer import RolloutProducer
from asyncgrpo.rollout.queue import RolloutQueue


class DigitTokenizer:
    """Ids 0-9 are the digits."""

    def __len__(self):
        return 10

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


@pytest.mark.parametrize("drops", [1, 2])
def test_a_group_lost_with_its_server_is_generated_again_before_new_prompts(stubs, drops):
    prompts_sent = []

    def route(stub, handler):
        if handler.path == "/health":
            return 200, "text/plain", ""
        body = json.loads(stub.requests[-1]["body"])
        prompts_sent.append(body["prompt"])
        if len(prompts_sent) <= drops:
            return None  # the server dies under the first request(s): no answer at all
        choices = [{"index": i, "text": "7", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]},
                    "finish_reason": "stop"} for i in range(body["n"])]
        return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})

    server = stubs(route)
    cfg = AsyncGRPOConfig.from_dict({"lora_adapter_path": "/tmp/adapters", "num_generations": 2,
                                     "per_device_train_batch_size": 4, "max_staleness": 0,
                                     "max_inflight_requests": 1, "vllm_server_timeout": 30})
    rows = [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={}) for i in range(8)]
    queue = RolloutQueue(cfg.max_staleness)
    client = InferenceClient(server.url, timeout_s=10, connect_retries=0)  # no client-side retry: lost at once
    scorer = RewardScorer(["asyncgrpo.rewards:format_reward"], None, None, {"format_reward": {"pattern": "^7$"}})
    producer = RolloutProducer(clients=[client], tokenizer=DigitTokenizer(), rows=rows, scorer=scorer, queue=queue,
                               groups_per_step=2, cfg=cfg)
    producer.start()
    try:
        producer.set_policy(0, "demo-v0")
        groups = queue.take(2, trainer_version=0, timeout_s=30)
    finally:
        producer.stop()
    assert (producer.lost_groups, producer.resent_groups) == (drops, drops)
    assert all(p == prompts_sent[0] for p in prompts_sent[:drops + 1])  # the lost prompt went out again, before the next one
    assert sorted(g.index for g in groups) == [0, 1]  # so the batch holds the first two prompts: none skipped
    assert all(g.rewards == [1.0, 1.0] for g in groups)
