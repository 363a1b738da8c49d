"""The rollout side's interface as the trainer uses it: versions published in order on one background thread, a failed
publish raised by the next call, `take` handing the trainer's version to the queue, `close` waiting for the publish in
progress and unloading every version but the kept final one, `halt` reaching the publisher; and what it reports
(`stats`, `log`, each sync's timings). Generation goes to the in-process HTTP stub (conftest.py) with a real producer,
queue and scorer; the adapter servers are tests/fakes.py's FakeVLLM (a load held or failing on demand, which a real
vLLM server cannot be made to do). The whole side against a real server runs in every integration test that trains.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes import FakeVLLM, answer, generation
from liveness import returns_within

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import SyncError
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout import side as side_module
from asyncgrpo.rollout.build import RolloutParts
from asyncgrpo.rollout.episodes import EpisodeStats
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.rollout.scoring import InThreadScoring
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.store import CONFIG_NAME, AdapterStore
from asyncgrpo.trackers import Trackers

DEADLINE_S = 15.0  # every wait here is milliseconds when the code is right


def adapter_server() -> FakeVLLM:
    """tests/fakes.py's FakeVLLM at http://adapters:8000 whose `gates` maps an adapter name to an event its load waits
    for (`fail={"load NAME": exc}` makes one load raise)."""
    gates: dict[str, threading.Event] = {}

    def wait_at_gate(server, name):
        if name in gates:
            assert gates[name].wait(DEADLINE_S), f"the load of {name} was never let through"

    server = FakeVLLM("http://adapters:8000", on_load=wait_at_gate)
    server.gates = gates
    return server


class Recorder:
    """A tracker (accelerate's GeneralTracker calls) that records each scalar as (tag, value, step)."""

    name = "recorder"

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def log(self, values, step=None):
        self.scalars.extend((tag, value, step) for tag, value in values.items())

    def finish(self):
        pass


def recording(side) -> Recorder:
    """Give `side` one recording tracker and return it."""
    recorder = Recorder()
    side.trackers = Trackers([recorder])
    return recorder


class Lora:
    def to_dict(self):
        return {"peft_type": "LORA", "r": 1}


def tensors(version: int) -> dict[str, torch.Tensor]:
    return {"base_model.model.layer.lora_A.weight": torch.full((1, 2), float(version))}


@pytest.fixture
def side_on_stub(rollout_on_stub, tmp_path):
    """A RolloutSide whose producer, queue and scorer generate against the stub (conftest), whose publisher talks to
    FakeVLLM fakes (`adapter_server`), and whose store writes under tmp_path."""
    made: list[RolloutSide] = []

    def make(route=None, *, sync_mode: str = "versioned", **cfg) -> tuple[RolloutSide, FakeVLLM]:
        rollout = rollout_on_stub(route, **cfg) if route is not None else rollout_on_stub(**cfg)
        side = RolloutSide(rollout.cfg, tokenizer=None, model_path=str(tmp_path), peft_config=Lora(),
                           groups_per_step=rollout.producer.groups_per_step)
        server = adapter_server()
        publisher = AdapterPublisher([server], f"demo-{side.run_id}", sync_mode, adapter_root=tmp_path / "adapters")
        side.parts = RolloutParts(clients=rollout.clients, store=AdapterStore(tmp_path / "adapters" / side.run_id),
                                  recovery=None, publisher=publisher, queue=rollout.queue, scorer=rollout.producer.scorer,
                                  producer=rollout.producer, prompts_skipped_too_long=0, eval_rows=[])
        side.recorder = recording(side)
        side.parts.producer.start()
        made.append(side)
        return side, server

    yield make
    for side in made:
        for gate in side.parts.publisher.clients[0].gates.values():
            gate.set()
        side.close(keep_final=False)


def loads(server: FakeVLLM) -> list[str]:
    return calls_of(server, "load")


def unloads(server: FakeVLLM) -> list[str]:
    return calls_of(server, "unload")


def calls_of(server: FakeVLLM, kind: str) -> list[str]:
    """The adapter names of `server`'s calls of `kind` ("load", "unload"), in order."""
    return [call[1] for call in server.calls if call[0] == kind]


def test_versions_go_live_in_order_on_the_background_thread_and_new_requests_use_the_latest(side_on_stub):
    side, server = side_on_stub()
    prefix = side.parts.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    assert (side.version, side.adapter_name) == (0, f"{prefix}-v0")
    server.gates[f"{prefix}-v1"] = gate = threading.Event()
    side.publish(1, tensors(1), step=1)  # returns while the servers have not got version 1
    assert (side.version, side.adapter_name) == (0, f"{prefix}-v0")
    gate.set()
    side.publish(2, tensors(2), step=2)  # waits for version 1 first
    side.wait_published()
    assert loads(server) == [f"{prefix}-v0", f"{prefix}-v1", f"{prefix}-v2"]
    assert (side.version, side.adapter_name, side.adapter_path) == (2, f"{prefix}-v2", side.parts.store.path(2))
    assert (side.parts.producer.admission.version, side.parts.producer.admission.adapter) == (2, f"{prefix}-v2")
    assert [step for tag, _, step in side.recorder.scalars if tag == "sync/write_s"] == [0, 1, 2]


def test_a_failed_background_publish_is_raised_by_the_next_call_and_nothing_later_is_loaded(side_on_stub):
    side, server = side_on_stub()
    prefix = side.parts.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    server.fail[f"load {prefix}-v1"] = RuntimeError("load refused")
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
    while len(side.parts.queue) < 2:  # batch 1, generated by version 0 too
        assert time.monotonic() < deadline, "the producer did not queue the next batch"
        time.sleep(0.005)  # polling a counter, not waiting for a server
    assert side.stats()["queue/dropped_stale_total"] == 0
    with pytest.raises(TimeoutError):
        side.take(2, version=2, timeout_s=0.2)  # a trainer at version 2 takes nothing from version 0
    assert side.stats()["queue/dropped_stale_total"] >= 2


@generation
def held(body):
    """A route that holds every generation request until `held.release` is set."""
    assert held.release.wait(DEADLINE_S)
    return answer(body, [[7]] * body["n"])


def publish_v0_and_wait_for_a_request_on_it(side, prefix: str) -> None:
    """Publish version 0 and poll (with a deadline) until a generation request on it is in flight."""
    side.publish(0, tensors(0), step=0, wait=True)
    deadline = time.monotonic() + DEADLINE_S
    while side.parts.producer.adapters_in_use() != {f"{prefix}-v0"}:
        assert time.monotonic() < deadline, "no request was sent"
        time.sleep(0.005)


@pytest.mark.parametrize("keep_final", [True, False])
def test_close_unloads_every_version_this_run_loaded_but_the_kept_final_one(side_on_stub, keep_final):
    held.release = threading.Event()
    side, server = side_on_stub(held)
    prefix = side.parts.publisher.prefix
    try:
        publish_v0_and_wait_for_a_request_on_it(side, prefix)
        side.publish(1, tensors(1), step=1, wait=True)  # version 0 stays loaded: a request still uses it
        assert set(side.parts.publisher.loaded) == {f"{prefix}-v0", f"{prefix}-v1"}
        side.close(keep_final=keep_final)
    finally:
        held.release.set()
    assert unloads(server) == ([f"{prefix}-v0"] if keep_final else [f"{prefix}-v0", f"{prefix}-v1"])
    assert list(server.served) == ([f"{prefix}-v1"] if keep_final else [])


def joining_the_publish_thread(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in ThreadPoolExecutor.shutdown, joining a worker (its stack, read as a debugger
    would: there is no other way to see that a call is waiting rather than slow)."""
    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] in ("_wait_for_tstate_lock", "join") and "shutdown" in names


def test_close_waits_for_the_publish_in_progress_so_the_version_it_loads_is_unloaded_too(side_on_stub):
    side, server = side_on_stub()
    prefix = side.parts.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    server.gates[f"{prefix}-v1"] = gate = threading.Event()
    side.publish(1, tensors(1), step=1)  # on the publish thread, its load held at the gate
    closer = threading.Thread(target=side.close, kwargs={"keep_final": False}, name="test-close", daemon=True)
    closer.start()
    deadline = time.monotonic() + DEADLINE_S
    while closer.is_alive() and not joining_the_publish_thread(closer):  # waiting for the publish, or returned
        assert time.monotonic() < deadline, "close neither returned nor waited for the publish thread"
        time.sleep(0.005)  # polling a thread's state, not waiting for a server
    gate.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive(), "close did not return once the publish in progress was done"
    assert loads(server) == [f"{prefix}-v0", f"{prefix}-v1"]
    assert set(unloads(server)) == {f"{prefix}-v0", f"{prefix}-v1"}
    assert server.served == {}  # no version of this run is left holding a server's adapter slot


def test_close_lets_the_publish_in_progress_finish_before_it_unloads(side_on_stub):
    """The same without reading a thread's stack: the held load is let through when close joins the publish thread,
    so a close that joins it finds the version loaded and unloads it, and one that does not join leaves the load held
    until after it returned, and the version loaded for good."""
    side, server = side_on_stub()
    prefix = side.parts.publisher.prefix
    side.publish(0, tensors(0), step=0, wait=True)
    server.gates[f"{prefix}-v1"] = gate = threading.Event()
    side.publish(1, tensors(1), step=1)  # on the publish thread, its load held at the gate
    (worker,) = side._publish_thread._threads  # the executor's one thread, which runs every publish
    worker.join = lambda timeout=None: (gate.set(), threading.Thread.join(worker, timeout))[-1]
    returns_within(lambda: side.close(keep_final=False), DEADLINE_S, "close with a publish in progress")
    gate.set()  # (for a close that did not wait: the load goes through now, after it)
    threading.Thread.join(worker, DEADLINE_S)
    assert not worker.is_alive()
    assert loads(server) == [f"{prefix}-v0", f"{prefix}-v1"]
    assert server.served == {}  # v1 was unloaded too: no version of this run holds a server's adapter slot


def test_halt_reaches_the_publisher_so_no_later_sync_pauses_a_server(side_on_stub):
    side, server = side_on_stub(sync_mode="pause")
    side.publish(0, tensors(0), step=0, wait=True)  # the first version loads without a pause
    side.halt()
    with pytest.raises(SyncError, match="SIGTERM/SIGINT"):
        side.publish(1, tensors(1), step=1, wait=True)
    assert [call for call in server.calls if call[0] in ("pause", "resume")] == []
    assert side.adapter_name == f"{side.parts.publisher.prefix}-v0"


def test_a_side_that_never_started_halts_and_closes_without_error(rollout_on_stub, tmp_path):
    cfg = rollout_on_stub().cfg
    side = RolloutSide(cfg, tokenizer=None, model_path=str(tmp_path), peft_config=Lora(), groups_per_step=2)
    side.halt()
    side.close(keep_final=True)
    assert (side.version, side.adapter_name, side.adapter_path) == (None, None, None)


# ---- what the side reports: its constructor's defaults, stats(), log(), each publish's timings ----------------------
def bare_side(tmp_path, **kwargs) -> RolloutSide:
    """A side that is never started (no server, no producer): its constructor and the parts that only read counters."""
    cfg = AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "output_dir": str(tmp_path / "out"),
                                     "lora_adapter_path": str(tmp_path / "a")})
    return RolloutSide(cfg, tokenizer=None, model_path=str(tmp_path), peft_config=Lora(), groups_per_step=3, **kwargs)


def clock(monkeypatch, monotonic: float = 0.0, perf_counter: list[float] | None = None) -> None:
    """side.py reads time through its module's `time`: replace that name alone (every other module keeps the real
    clock). `monotonic` is a fixed reading; `perf_counter` the readings in the order they are taken."""
    ticks = iter(perf_counter or [])
    monkeypatch.setattr(side_module, "time", SimpleNamespace(monotonic=lambda: monotonic,
                                                             perf_counter=lambda: next(ticks)))


def test_a_side_built_without_resume_arguments_starts_a_fresh_run_and_logs_under_output_dir(tmp_path):
    side = bare_side(tmp_path)
    assert (side.start_step, side.data_position, side.previous_run_id) == (0, 0, None)
    assert side.groups_per_step == 3
    assert side.tensorboard_dir == tmp_path / "out" / "tensorboard"  # the run summary names it


class Counted:
    """A producer's, queue's or scorer's counters, set by the test; len() is the queue's depth."""

    def __init__(self, depth: int = 0, **counters):
        self.__dict__.update(counters)
        self.depth = depth

    def __len__(self):
        return self.depth


def side_with_counters(tmp_path, started_at: float) -> RolloutSide:
    side = bare_side(tmp_path)
    side.parts = SimpleNamespace(  # the parts stats() reads
        producer=Counted(started_at=started_at, generated_tokens=600, lost_groups=2, resent_groups=3, inflight=4,
                         episodes=None),  # no tools: no episode counters
        queue=Counted(depth=5, dropped_stale=6, dropped_zero_std=7),
        scorer=Counted(fallbacks=8, take_logged=lambda: ({}, {})))  # no reward function logged anything
    return side


def test_stats_reports_each_counter_under_its_tensorboard_name_and_tokens_per_second_since_the_producer_started(
        tmp_path, monkeypatch):
    side = side_with_counters(tmp_path, started_at=100.0)
    clock(monkeypatch, monotonic=104.0)  # 4 s after the producer started
    assert side.stats() == {"rollout/generated_tokens_per_s": 150.0,  # 600 tokens / 4 s
                            "rollout/lost_groups_total": 2, "rollout/resent_groups_total": 3,
                            "reward/fallbacks_total": 8, "queue/dropped_stale_total": 6, "queue/depth": 5,
                            "queue/dropped_zero_std_total": 7, "queue/inflight_requests": 4}


def test_with_adaptive_inflight_a_take_tells_the_producer_whether_the_trainer_waited_and_stats_log_the_cap(
        tmp_path, monkeypatch):
    side = side_with_counters(tmp_path, started_at=100.0)
    side.cfg.adaptive_inflight = True
    told = []
    side.parts.producer.adapt_inflight = lambda trainer_waited: told.append(trainer_waited)
    side.parts.producer.max_inflight = 9
    side.parts.queue.take = lambda n, version, timeout_s: ["g"] * n
    clock(monkeypatch, monotonic=104.0)  # no time passes in take: the trainer did not wait
    assert side.take(2, 0, timeout_s=1) == ["g", "g"] and told == [False]
    readings = iter([104.0, 104.5])
    monkeypatch.setattr("asyncgrpo.rollout.side.time", SimpleNamespace(monotonic=lambda: next(readings)))
    side.take(1, 0, timeout_s=1)
    assert told == [False, True]  # half a second in take: it waited
    clock(monkeypatch, monotonic=104.0)
    assert side.stats()["queue/inflight_limit"] == 9


def test_stats_with_tools_adds_the_episode_counters(tmp_path, monkeypatch):
    side = side_with_counters(tmp_path, started_at=100.0)
    counters = EpisodeStats()
    counters.episodes, counters.turns, counters.tool_calls, counters.tokens = 4, 10, 6, 40  # four episodes so far
    side.parts.producer.episodes = SimpleNamespace(stats=counters)  # its EpisodeRunner, as far as stats reads it
    clock(monkeypatch, monotonic=104.0)
    stats = side.stats()
    assert stats.pop("episodes/tool_threads_hung") >= 0  # the process's gauge, which tool tests move
    assert {k: v for k, v in stats.items() if k.startswith("episodes/")} == {
        "episodes/total": 4, "episodes/turns_mean": 2.5, "episodes/tool_calls_total": 6,
        "episodes/tool_errors_total": 0, "episodes/tool_timeouts_total": 0, "episodes/tool_seconds_total": 0.0,
        "episodes/tokens_mean": 10.0,
        "episodes/truncated_total": 0}
    assert stats["rollout/generated_tokens_per_s"] == 150.0 and stats["queue/depth"] == 5  # and the rest, as without


def test_the_token_rate_over_less_than_a_second_is_not_capped_and_at_time_zero_is_finite(tmp_path, monkeypatch):
    side = side_with_counters(tmp_path, started_at=100.0)
    clock(monkeypatch, monotonic=100.5)
    assert side.stats()["rollout/generated_tokens_per_s"] == 1200.0  # 600 tokens / 0.5 s
    clock(monkeypatch, monotonic=100.0)  # no time has passed: divided by 1e-9 s, not by zero
    assert side.stats()["rollout/generated_tokens_per_s"] == pytest.approx(600 / 1e-9)


def test_what_reward_functions_log_reaches_the_trackers_metrics_as_means_and_extra_columns_as_a_table(
        tmp_path, monkeypatch):
    side = side_with_counters(tmp_path, started_at=100.0)
    side.parts.scorer = InThreadScoring(RewardScorer(["asyncgrpo.toy:larger_reward"]), tokenizer=None)
    side.parts.scorer.scorer.logged.log_metric("solved", 1.0)
    side.parts.scorer.scorer.logged.log_metric("solved", 0.0)
    side.parts.scorer.scorer.logged.log_extra("judge", ["ok", "bad"])
    side.recorder = recording(side)
    tables = []
    monkeypatch.setattr(side.trackers, "log_table", lambda *args: tables.append(args))
    clock(monkeypatch, monotonic=104.0)
    stats = side.stats()
    assert stats["train/solved"] == 0.5 and side.stats().get("train/solved") is None  # the step's mean, once
    side.log(stats, step=4)
    assert ("train/solved", 0.5, 4) in side.recorder.scalars
    assert tables == [("reward_extra", ["step", "judge"], [[4, "ok"], [4, "bad"]], 4)]
    side.log({}, step=5)
    assert len(tables) == 1  # written once
    side.parts.scorer.scorer.logged.log_extra("judge", list(range(100)))
    side.stats()
    side.log({}, step=6)
    assert tables[1][2] == [[6, i] for i in range(side_module.EXTRA_ROWS)]  # the first 64 of a step's rows


def test_log_writes_each_value_under_its_name_at_the_given_step(tmp_path):
    side = bare_side(tmp_path)
    side.recorder = recording(side)
    side.log({"train/loss": 0.25, "rollout/lost_groups_total": 3}, step=7)
    assert side.recorder.scalars == [("train/loss", 0.25, 7), ("rollout/lost_groups_total", 3, 7)]


def test_publish_returns_the_seconds_it_waited_before_handing_over_and_logs_the_syncs_timings_at_its_step(side_on_stub,
                                                                                                 monkeypatch):
    side, _ = side_on_stub()
    timings = []
    publish = side.parts.publisher.publish
    side.parts.publisher.publish = lambda *args: timings.append(publish(*args)) or timings[-1]
    # publish() reads the clock before and after waiting (main thread), then _publish before and after the write
    # (publish thread, which runs after both and before publish returns: wait=True)
    clock(monkeypatch, perf_counter=[10.0, 12.5, 20.0, 20.25])
    assert side.publish(0, tensors(0), step=7, wait=True) == 2.5
    (timing,) = timings
    assert side.recorder.scalars == [("sync/write_s", 0.25, 7), ("sync/server_s", timing.server_s, 7),
                                   ("sync/paused_s", timing.paused_s, 7), ("sync/load_s", timing.load_s, 7)]


def test_the_sync_timings_go_through_the_sides_one_log_method(side_on_stub):
    side, _ = side_on_stub()
    logged = []
    side.log = lambda values, step: logged.append((sorted(values), step))
    side.publish(0, tensors(0), step=4, wait=True)
    assert logged == [(["sync/load_s", "sync/paused_s", "sync/server_s", "sync/write_s"], 4)]
    assert side.recorder.scalars == []  # nothing written past it


def test_a_published_version_names_the_resolved_model_path_as_its_base_model(side_on_stub, tmp_path):
    side, _ = side_on_stub()
    side.publish(0, tensors(0), step=0, wait=True)
    config = json.loads((side.parts.store.path(0) / CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] == str(Path(tmp_path).resolve())


def test_a_version_a_server_still_has_loaded_stays_on_disk_beyond_keep_adapter_versions(side_on_stub):
    held.release = threading.Event()
    side, _ = side_on_stub(held, keep_adapter_versions=1)
    prefix = side.parts.publisher.prefix
    try:
        publish_v0_and_wait_for_a_request_on_it(side, prefix)
        side.publish(1, tensors(1), step=1, wait=True)  # prunes to 1 version, but version 0 is still loaded
        assert set(side.parts.publisher.loaded) == {f"{prefix}-v0", f"{prefix}-v1"}
        assert side.parts.store.versions() == [0, 1]
    finally:
        held.release.set()
