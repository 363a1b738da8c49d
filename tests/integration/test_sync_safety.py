"""A failed sync never leaves the server paused, and the previous adapter keeps serving (real vLLM server)."""

import uuid

import pytest

from asyncgrpo.errors import SyncError
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import WEIGHTS_NAME, AdapterStore

PROBE = [3 + b for b in b"07+45=52"]


@pytest.fixture()
def published(world, client, tmp_path, random_adapter):
    """A store with version 1 written and served under a fresh name; returns (store, publisher, scores of v1)."""
    store = AdapterStore(tmp_path / "adapters")
    tensors, config = random_adapter(seed=1)
    publisher = AdapterPublisher([client], f"safety-{uuid.uuid4().hex[:6]}")
    publisher.publish(1, store.write(1, tensors, config, base_model=str(world.model_dir)))
    assert publisher.current_name == publisher.name(1)
    return store, publisher, client.score(publisher.current_name, PROBE)


def test_a_corrupt_adapter_fails_the_sync_and_the_previous_version_keeps_serving(world, client, published,
                                                                             random_adapter):
    store, publisher, v1_scores = published
    tensors, config = random_adapter(seed=2)
    path = store.write(2, tensors, config, base_model=str(world.model_dir))
    weights = path / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated on disk
    with pytest.raises(SyncError) as err:
        publisher.publish(2, path)
    assert str(path) in str(err.value) and f"still serve {publisher.name(1)}" in str(err.value)
    assert f"adapter file {weights} has " in str(err.value)  # caught by its recorded size, before the server
    assert client.is_paused() is False
    assert publisher.current_name == publisher.name(1)
    served = client.adapter_paths()
    assert served[publisher.name(1)] == str(store.path(1)) and publisher.name(2) not in served
    assert client.score(publisher.current_name, PROBE) == v1_scores


def test_an_exception_between_pause_and_resume_leaves_the_server_resumed_on_the_previous_version(
        world, client, published, monkeypatch, random_adapter):
    store, publisher, v1_scores = published
    tensors, config = random_adapter(seed=3)
    path = store.write(2, tensors, config, base_model=str(world.model_dir))
    calls = []

    def fail_once(*args, **kwargs):  # injected: the load has happened, the server is paused
        calls.append(client.is_paused())
        if len(calls) == 1:
            raise RuntimeError("injected failure after the load")

    monkeypatch.setattr(client, "reset_prefix_cache", fail_once)
    with pytest.raises(SyncError, match="injected failure after the load"):
        publisher.publish(2, path)
    assert calls[0] is True  # the failure really happened while paused
    assert client.is_paused() is False
    assert publisher.current_name == publisher.name(1)
    served = client.adapter_paths()
    assert served[publisher.name(1)] == str(store.path(1)) and publisher.name(2) not in served
    assert client.score(publisher.current_name, PROBE) == v1_scores
    monkeypatch.undo()
    publisher.publish(2, path)  # and the next sync goes through
    assert client.adapter_paths()[publisher.current_name] == str(path)
    assert client.score(publisher.current_name, PROBE) != v1_scores
    publisher.retire(in_use=set())
    assert publisher.name(1) not in client.adapter_paths()  # versions nothing uses are unloaded
