"""The rollout side's interface as the trainer uses it: versions published in order on one background thread, a failed
publish raised by the next call, `take` handing the trainer's version to the queue, `close` unloading every version
but the kept final one, `halt` reaching the publisher.

Generation goes to the in-process HTTP stub (tests/unit/rollout/conftest.py) with a real producer, queue and scorer.
The adapter servers the publisher talks to are recording Python fakes (no HTTP), as in tests/unit/sync: a load held
until the test lets it go, or failing on demand, is what a real vLLM server cannot be made to do. The whole side
against a real server runs in every integration test that trains (tests/integration/test_servers.py and others).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from asyncgrpo.errors import SyncError
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.sync.publish import AdapterPublisher, AdapterStore

DEADLINE_S = 15.0  # every wait here is milliseconds when the code is right


class AdapterServer:
    """Records load/unload/pause calls; `gates` maps an adapter name to an event its load waits for, `fail` to the
    exception its load raises."""

    def __init__(self, url: str = "http://adapters:8000"):
        self.base_url = url
        self.calls: list[tuple[str, str]] = []
        self.served: dict[str, str] = {}
        self.gates: dict[str, threading.Event] = {}
        self.fail: dict[str, Exception] = {}

    def load_adapter(self, name, path, inplace=False):
        if name in self.gates:
            assert self.gates[name].wait(DEADLINE_S), f"the load of {name} was never let through"
        self.calls.append(("load", name))
        if name in self.fail:
            raise self.fail[name]
        self.served[name] = path

    def unload_adapter(self, name):
        self.calls.append(("unload", name))
        self.served.pop(name, None)

    def adapter_paths(self):
        return dict(self.served)

    def pause(self, mode="keep"):
        self.calls.append(("pause", mode))

    def resume(self):
        self.calls.append(("resume", ""))

    def reset_prefix_cache(self):
        self.calls.append(("reset", ""))

    def health(self):
        return True


class Writer:
    """TensorBoard's add_scalar, recorded."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        pass


class Lora:
    def to_dict(self):
        return {"peft_type": "LORA", "r": 1}


def tensors(version: int) -> dict[str, torch.Tensor]:
    return {"base_model.model.layer.lora_A.weight": torch.full((1, 2), float(version))}


@pytest.fixture
def side_on_stub(rollout_on_stub, tmp_path):
    """A RolloutSide whose producer, queue and scorer generate against the stub (conftest), whose publisher talks to
    `AdapterServer` fakes, and whose store writes under tmp_path."""
    made: list[RolloutSide] = []

    def make(route=None, *, sync_mode: str = "versioned", **cfg) -> tuple[RolloutSide, AdapterServer]:
        rollout = rollout_on_stub(route, **cfg) if route is not None else rollout_on_stub(**cfg)
        side = RolloutSide(rollout.cfg, tokenizer=None, model_path=str(tmp_path), peft_config=Lora(),
                           groups_per_step=rollout.producer.groups_per_step)
        server = AdapterServer()
        side.clients, side.queue, side.producer, side.scorer = rollout.clients, rollout.queue, rollout.producer, \
            rollout.scorer
        side.store = AdapterStore(tmp_path / "adapters" / side.run_id)
        side.publisher = AdapterPublisher([server], f"demo-{side.run_id}", sync_mode,
                                          adapter_root=tmp_path / "adapters")
        side.writer = Writer()
        side.producer.start()
        made.append(side)
        return side, server

    yield make
    for side in made:
        for gate in side.publisher.clients[0].gates.values():
            gate.set()
        side.close(keep_final=False)


def loads(server: AdapterServer) -> list[str]:
    return [name for call, name in server.calls if call == "load"]


def test_versions_go_live_in_order_on_the_background_thread_and_new_requests_use_the_latest(side_on_stub):
    side, server = side_on_stub()
    prefix = side.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    assert (side.version, side.adapter_name) == (0, f"{prefix}-v0")
    server.gates[f"{prefix}-v1"] = gate = threading.Event()
    side.publish(1, tensors(1), step=1)  # returns while the servers have not got version 1
    assert (side.version, side.adapter_name) == (0, f"{prefix}-v0")
    gate.set()
    side.publish(2, tensors(2), step=2)  # waits for version 1 first
    side.wait_published()
    assert loads(server) == [f"{prefix}-v0", f"{prefix}-v1", f"{prefix}-v2"]
    assert (side.version, side.adapter_name, side.adapter_path) == (2, f"{prefix}-v2", side.store.path(2))
    assert (side.producer.schedule.version, side.producer.schedule.adapter) == (2, f"{prefix}-v2")
    assert [step for tag, _, step in side.writer.scalars if tag == "sync/write_s"] == [0, 1, 2]


def test_a_failed_background_publish_is_raised_by_the_next_call_and_nothing_later_is_loaded(side_on_stub):
    side, server = side_on_stub()
    prefix = side.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    server.fail[f"{prefix}-v1"] = RuntimeError("load refused")
    side.publish(1, tensors(1), step=1)  # the failure happens on the publish thread: not raised here
    with pytest.raises(SyncError, match="load refused"):
        side.publish(2, tensors(2), step=2)
    assert loads(server) == [f"{prefix}-v0", f"{prefix}-v1"]  # version 2 was never handed over
    assert (side.version, side.adapter_name) == (0, f"{prefix}-v0")  # version 0 is still the live one


def test_take_drops_what_is_too_stale_for_the_trainers_version(side_on_stub):
    side, _ = side_on_stub(max_staleness=1)  # two groups per step: batches 0 and 1 may come from version 0
    side.publish(0, tensors(0), step=0, wait=True)
    groups = side.take(2, version=0, timeout_s=DEADLINE_S)
    assert [(g.version, g.adapter) for g in groups] == [(0, side.adapter_name)] * 2
    deadline = time.monotonic() + DEADLINE_S
    while len(side.queue) < 2:  # batch 1, generated by version 0 too
        assert time.monotonic() < deadline, "the producer did not queue the next batch"
        time.sleep(0.005)  # polling a counter, not waiting for a server
    assert side.stats()["queue/dropped_stale_total"] == 0
    with pytest.raises(TimeoutError):
        side.take(2, version=2, timeout_s=0.2)  # a trainer at version 2 takes nothing from version 0
    assert side.stats()["queue/dropped_stale_total"] >= 2


def held(stub, handler):
    """A route that holds every generation request until `held.release` is set."""
    if handler.path == "/health":
        return 200, "text/plain", ""
    assert held.release.wait(DEADLINE_S)
    body = json.loads(handler.body)
    return held.answer(body, [[7]] * body["n"])


@pytest.mark.parametrize("keep_final", [True, False])
def test_close_unloads_every_version_this_run_loaded_but_the_kept_final_one(side_on_stub, rollout_on_stub,
                                                                           keep_final):
    held.release, held.answer = threading.Event(), rollout_on_stub.answer
    side, server = side_on_stub(held)
    prefix = side.publisher.prefix
    try:
        side.publish(0, tensors(0), step=0, wait=True)
        deadline = time.monotonic() + DEADLINE_S
        while side.producer.adapters_in_use() != {f"{prefix}-v0"}:  # a request on version 0 is in flight
            assert time.monotonic() < deadline, "no request was sent"
            time.sleep(0.005)
        side.publish(1, tensors(1), step=1, wait=True)  # version 0 stays loaded: a request still uses it
        assert set(side.publisher.loaded) == {f"{prefix}-v0", f"{prefix}-v1"}
        side.close(keep_final=keep_final)
    finally:
        held.release.set()
    unloaded = [name for call, name in server.calls if call == "unload"]
    assert unloaded == ([f"{prefix}-v0"] if keep_final else [f"{prefix}-v0", f"{prefix}-v1"])
    assert list(server.served) == ([f"{prefix}-v1"] if keep_final else [])


def test_halt_reaches_the_publisher_so_no_later_sync_pauses_a_server(side_on_stub):
    side, server = side_on_stub(sync_mode="pause")
    side.publish(0, tensors(0), step=0, wait=True)  # the first version loads without a pause
    side.halt()
    with pytest.raises(SyncError, match="SIGTERM/SIGINT"):
        side.publish(1, tensors(1), step=1, wait=True)
    assert [call for call, _ in server.calls if call in ("pause", "resume")] == []
    assert side.adapter_name == f"{side.publisher.prefix}-v0"


def test_a_side_that_never_started_halts_and_closes_without_error(rollout_on_stub, tmp_path):
    cfg = rollout_on_stub().cfg
    side = RolloutSide(cfg, tokenizer=None, model_path=str(tmp_path), peft_config=Lora(), groups_per_step=2)
    side.halt()
    side.close(keep_final=True)
    assert (side.version, side.adapter_name, side.adapter_path) == (None, None, None)
