"""Several inference servers (two real vLLM CPU servers): rollouts are spread over them, every sync reaches both,
and a server that rejects a load fails the sync loudly without leaving the other one ahead."""

import json
import time
import uuid

import pytest
import requests

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.errors import SyncError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import AdapterStore
from asyncgrpo.trainer.recipe import GRPORecipe


def finished_requests(base_url: str) -> float:
    """vLLM's own count of finished requests (GET /metrics, summed over finish reasons); each of a request's `n`
    completions counts as one."""
    lines = requests.get(f"{base_url}/metrics", timeout=5).text.splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total")]
    assert values, "no vllm:request_success_total in /metrics"
    return sum(values)


FINISH_DEADLINE_S = 180.0  # requests still in flight at the end finish within seconds; generous for a loaded machine


def test_rollouts_use_both_servers_and_every_sync_reaches_both(vllm_server, second_vllm_server, tmp_path):
    urls = [vllm_server.base_url, second_vllm_server.base_url]
    before = [finished_requests(u) for u in urls]
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--max_steps", "2", "--per_device_train_batch_size", "64", "--output_dir", str(tmp_path),
        "--lora_adapter_path", str(tmp_path / "adapters"), "--vllm_server_base_url", ",".join(urls)])
    trainer = GRPORecipe(cfg)
    served = []
    try:
        trainer.setup()
        for _ in range(2):
            trainer.train_step()
            trainer.sync(wait=True)
            served.append([InferenceClient(u).adapter_paths().get(trainer.rollout.adapter_name) for u in urls])
        final = str(trainer.rollout.adapter_path)
        # Stop sending and let the requests in flight come back before cleanup unloads this run's adapters: a request
        # that reached a server after the unload would be answered 404 and never counted as finished there.
        producer = trainer.rollout.parts.producer
        producer.stop()
        deadline = time.monotonic() + FINISH_DEADLINE_S
        while any(producer.inflight_per_server().values()):
            assert time.monotonic() < deadline, f"still in flight: {producer.inflight_per_server()}"
            time.sleep(0.5)  # polling the producer's own count, with a deadline
        sent = producer.sent_per_server()
    finally:
        trainer.cleanup()
    assert served[-1] == [final, final]
    assert served[0][0] == served[0][1] and served[0][0] != final  # version 1 on both, then version 2 on both
    # Both servers start with nothing in flight, so the first two requests go one to each (least loaded, ties in
    # turn). Which server answers faster, and so gets more, is up to the machine: a slower one may still hold its
    # first requests when two steps are done, so how much each generated *within* the run is not asserted.
    assert set(sent) == set(urls) and min(sent.values()) >= 1, sent
    # Each server really received what it was sent: vLLM counts every completion it finishes (any finish reason; a
    # request for n completions counts n). Every request was answered before cleanup, but the counter may lag the
    # answer: poll, with a deadline, until each has counted every completion it was sent.
    want = [sent[u] * cfg.num_generations for u in urls]
    deadline = time.monotonic() + FINISH_DEADLINE_S
    while True:
        gained = [finished_requests(u) - b for u, b in zip(urls, before)]
        if all(g >= w for g, w in zip(gained, want)):
            break
        assert time.monotonic() < deadline, f"finished {gained} completions, sent {want}"
        time.sleep(0.5)  # polling the servers' counters with a deadline
    print(json.dumps({"sent_per_server": list(sent.values()), "completions_sent_per_server": want,
                      "completions_finished_per_server": gained}))


def test_a_server_that_rejects_the_load_fails_the_sync_with_its_message(
        world, vllm_server, second_vllm_server, tmp_path, random_adapter):
    accepts_16, refuses_16 = InferenceClient(second_vllm_server.base_url), InferenceClient(vllm_server.base_url)
    publisher = AdapterPublisher([accepts_16, refuses_16], f"two-{uuid.uuid4().hex[:6]}")
    store = AdapterStore(tmp_path)
    publisher.publish(1, store.write(1, *random_adapter(seed=11), base_model=str(world.model_dir)))
    path = store.write(2, *random_adapter(seed=12, rank=16), base_model=str(world.model_dir))
    with pytest.raises(SyncError) as err:
        publisher.publish(2, path)
    message = str(err.value)
    assert vllm_server.base_url in message and ("HTTP 400" in message or "HTTP 500" in message)
    assert "rank" in message.lower()  # the server's own words about the rank limit
    for client in (accepts_16, refuses_16):  # all or nothing: neither server serves version 2
        assert publisher.name(2) not in client.adapter_paths()
        assert client.adapter_paths()[publisher.name(1)] == str(store.path(1))
        assert client.is_paused() is False
    assert publisher.current_name == publisher.name(1)
