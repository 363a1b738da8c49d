"""sync_mode: versioned against the real server: no pause, in-flight requests finish on their version."""

import threading
import time
import uuid

import requests

from asyncgrpo.sync.publish import AdapterPublisher, AdapterStore

PROMPT = [3 + b for b in b"42,24>"]


def running_requests(base_url: str) -> float:
    """vLLM's own gauge of requests being generated now (GET /metrics); n=8 counts as one request."""
    for line in requests.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def test_versioned_sync_never_pauses_and_in_flight_requests_finish_on_their_version(
        world, client, vllm_server, tmp_path, random_adapter, monkeypatch):
    store = AdapterStore(tmp_path)
    publisher = AdapterPublisher([client], f"vers-{uuid.uuid4().hex[:6]}", sync_mode="versioned")
    calls = []
    monkeypatch.setattr(client, "pause", lambda *a, **k: calls.append("pause"))
    monkeypatch.setattr(client, "resume", lambda *a, **k: calls.append("resume"))
    publisher.publish(1, store.write(1, *random_adapter(seed=7), base_model=str(world.model_dir)))
    v2 = store.write(2, *random_adapter(seed=8), base_model=str(world.model_dir))  # ready before the request starts

    result = {}
    long_request = threading.Thread(target=lambda: result.update(c=client.complete(
        publisher.name(1), PROMPT, n=8, max_tokens=240, extra={"ignore_eos": True})))
    long_request.start()
    deadline = time.monotonic() + 60
    while running_requests(vllm_server.base_url) < 1:  # poll until the request is being generated
        assert time.monotonic() < deadline, "the long request never started"
    publisher.publish(2, v2)
    assert running_requests(vllm_server.base_url) >= 1  # the sync happened while it was generating
    long_request.join(timeout=300)

    assert calls == []  # no pause, no resume
    in_flight = result["c"]
    assert [c.model for c in in_flight] == [publisher.name(1)] * 8 and all(len(c.token_ids) == 240 for c in in_flight)
    first = in_flight[0]
    under_v1 = client.score(publisher.name(1), PROMPT + first.token_ids)[len(PROMPT):]
    under_v2 = client.score(publisher.name(2), PROMPT + first.token_ids)[len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(under_v1, first.logprobs)) < 1e-3  # every token came from v1
    assert max(abs(a - b) for a, b in zip(under_v2, first.logprobs)) > 1e-2
    assert client.complete(publisher.current_name, PROMPT, n=1, max_tokens=3)[0].model == publisher.name(2)
    publisher.retire(in_use=set())
    assert publisher.name(1) not in client.adapter_paths() and publisher.name(2) in client.adapter_paths()
