"""sync_mode: versioned against the real server: no pause, in-flight requests finish on their version."""

import threading
import time
import uuid

import requests

from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import AdapterStore

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
    # The sync must land while the long request is generating. On a fast host the request can finish first: then
    # the next version is tried with a new request, up to three times (the race is the host's, not the rule's).
    old = 1
    for _ in range(3):
        new = old + 1
        ready = store.write(new, *random_adapter(seed=6 + new), base_model=str(world.model_dir))  # before the request
        result = {}
        long_request = threading.Thread(target=lambda name=publisher.name(old): result.update(c=client.complete(
            name, PROMPT, n=8, max_tokens=240, extra={"ignore_eos": True})))
        long_request.start()
        deadline = time.monotonic() + 60
        while running_requests(vllm_server.base_url) < 1 and long_request.is_alive():  # until it is generating
            assert time.monotonic() < deadline, "the long request never started"
        publisher.publish(new, ready)
        overlapped = running_requests(vllm_server.base_url) >= 1  # the sync happened while it was generating
        long_request.join(timeout=300)
        if overlapped:
            break
        old = new  # it finished first: try again from the version now live
    assert overlapped, "in three tries the long request never outlasted the sync"

    assert calls == []  # no pause, no resume
    in_flight = result["c"]
    assert [c.model for c in in_flight] == [publisher.name(old)] * 8 and all(len(c.token_ids) == 240 for c in in_flight)
    first = in_flight[0]
    under_old = client.score(publisher.name(old), PROMPT + first.token_ids)[len(PROMPT):]
    under_new = client.score(publisher.name(new), PROMPT + first.token_ids)[len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(under_old, first.logprobs)) < 1e-3  # every token came from the old version
    assert max(abs(a - b) for a, b in zip(under_new, first.logprobs)) > 1e-2
    assert client.complete(publisher.current_name, PROMPT, n=1, max_tokens=3)[0].model == publisher.name(new)
    publisher.retire(in_use=set())
    loaded = client.adapter_paths()
    assert all(publisher.name(v) not in loaded for v in range(1, new)) and publisher.name(new) in loaded
