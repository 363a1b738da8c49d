"""A sync reaches every server at once, and still all servers or none: concurrency through recording fakes.

The fakes block inside their calls on a barrier or an event, which a sequential publisher would never get past (each
barrier times out, and the test fails instead of hanging); a real server cannot be held inside a load on demand. The
happy path on two real servers is tests/integration/test_servers.py.
"""

from __future__ import annotations

import threading

import pytest
from fakes import FakeVLLM

from asyncgrpo.errors import InferenceServerError, SyncError
from asyncgrpo.rollout.publish import AdapterPublisher

WAIT_S = 10.0  # the longest any fake waits for the others; a sequential publisher fails after this, never hangs


def versions(tmp_path, n: int):
    paths = [tmp_path / f"v{i:06d}" for i in range(1, n + 1)]
    for p in paths:
        p.mkdir()
    return paths


def meet(barrier: threading.Barrier):
    """An `on_load` that returns only once every server is inside its load (BrokenBarrierError after WAIT_S)."""
    return lambda server, name: barrier.wait(WAIT_S)


@pytest.mark.parametrize("mode", ["pause", "versioned"])
def test_every_server_is_inside_its_load_at_the_same_time(tmp_path, mode):
    v1, v2 = versions(tmp_path, 2)
    barrier = threading.Barrier(3)
    servers = [FakeVLLM(f"http://{h}:8000", on_load=meet(barrier)) for h in "abc"]
    publisher = AdapterPublisher(servers, "pol", sync_mode=mode, adapter_root=tmp_path)
    publisher.publish(1, v1)  # the first version: loaded without a pause
    publisher.publish(2, v2)  # sequentially, the first server's load would wait for the others and time out
    assert all(s.served == {"pol-v1": str(v1.resolve()), "pol-v2": str(v2.resolve())} for s in servers)
    expected = ([("pause", "keep"), ("load", "pol-v2"), ("reset",), ("resume",), ("read",)] if mode == "pause"
                else [("load", "pol-v2"), ("read",)])
    assert all(s.calls[-len(expected):] == expected for s in servers)  # each server's protocol is unchanged
    assert publisher.current_name == "pol-v2" and not any(s.paused for s in servers)


def test_one_failure_among_three_concurrent_servers_takes_the_version_off_the_other_two(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    barrier = threading.Barrier(3)
    refusal = InferenceServerError("rank 64 > max_lora_rank", status=400)

    def meet_then_refuse(server, name):  # all three are inside their load before b refuses
        barrier.wait(WAIT_S)
        if server.base_url == "http://b:8000" and name == "pol-v2":
            raise refusal

    servers = [FakeVLLM(f"http://{h}:8000", on_load=meet_then_refuse) for h in "abc"]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert "to http://b:8000 failed" in str(err.value) and "rank 64" in str(err.value)
    assert err.value.__cause__ is refusal
    for s in servers:  # every server serves only the previous version, and none is left paused
        assert s.served == {"pol-v1": str(v1.resolve())}
        assert not s.paused and s.calls.count(("pause", "keep")) == s.calls.count(("resume",)) == 1
    for s in (servers[0], servers[2]):
        assert s.calls[-1] == ("unload", "pol-v2")  # after its own sync had finished (resumed, read back)
    assert ("unload", "pol-v2") not in servers[1].calls  # the failed load left nothing to unload there
    assert publisher.current_name == "pol-v1" and set(publisher.loaded) == {"pol-v1"} and not publisher._paused
    publisher.publish(3, v2)  # the next sync goes through on all three
    assert all(s.served.get("pol-v3") == str(v2.resolve()) for s in servers)


def test_two_failures_are_both_named(tmp_path):
    (v1,) = versions(tmp_path, 1)
    servers = [FakeVLLM("http://a:8000"),
               FakeVLLM("http://b:8000", fail={"load": InferenceServerError("no room at b", status=400)}),
               FakeVLLM("http://c:8000", fail={"load": InferenceServerError("no room at c", status=400)})]
    with pytest.raises(SyncError) as err:
        AdapterPublisher(servers, "pol", adapter_root=tmp_path).publish(1, v1)
    message = str(err.value)
    assert "to http://b:8000 failed: no room at b" in message and "http://c:8000 failed too: no room at c" in message
    assert servers[0].served == {} and servers[0].calls[-1] == ("unload", "pol-v1")


def test_a_read_back_failure_on_one_server_fails_the_sync_on_all(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    servers = [FakeVLLM("http://a:8000"), FakeVLLM("http://b:8000"), FakeVLLM("http://c:8000")]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    servers[2].misreport = str(v1.resolve())  # c says the new name serves the old directory
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert "server http://c:8000 reports adapter 'pol-v2'" in str(err.value)
    for s in servers:
        assert "pol-v2" not in s.served and s.calls[-1] == ("unload", "pol-v2") and not s.paused
    assert publisher.current_name == "pol-v1"


def test_an_interrupt_in_one_server_s_sync_propagates_after_the_others_drop_the_version(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    servers = [FakeVLLM("http://a:8000"), FakeVLLM("http://b:8000")]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    servers[1].fail["load"] = KeyboardInterrupt()  # not an Exception: it is raised as it is, not wrapped
    with pytest.raises(KeyboardInterrupt):
        publisher.publish(2, v2)
    assert servers[0].calls[-1] == ("unload", "pol-v2") and servers[1].calls[-1] == ("resume",)
    assert not any(s.paused for s in servers) and publisher.current_name == "pol-v1"


def test_halt_during_a_concurrent_sync_resumes_every_paused_server(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    release = threading.Event()
    servers = [FakeVLLM(f"http://{h}:8000", on_load=lambda s, n: n == "pol-v1" or release.wait(WAIT_S))
               for h in "ab"]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    errors = []

    def sync():
        try:
            publisher.publish(2, v2)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    syncing = threading.Thread(target=sync)
    syncing.start()
    for s in servers:  # both paused at once, each stuck inside its load
        assert s.paused_event.wait(WAIT_S)
    assert sorted(publisher.halt()) == ["http://a:8000", "http://b:8000"]  # what the signal handler calls
    assert not any(s.paused for s in servers)  # resumed while both syncs are still stuck
    release.set()
    syncing.join(WAIT_S)
    assert not syncing.is_alive() and not any(s.paused for s in servers) and not publisher._paused
    with pytest.raises(SyncError, match="SIGTERM/SIGINT"):
        publisher.publish(3, v2)  # halted: no further sync pauses anything
    assert all(s.calls.count(("pause", "keep")) == 1 for s in servers)
    assert publisher.halt() == []


def test_servers_are_paused_at_the_same_time(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    barrier = threading.Barrier(2)

    class MeetingInPause(FakeVLLM):
        def pause(self, mode="keep"):
            super().pause(mode)
            barrier.wait(WAIT_S)  # `wait` mode can hold a pause for as long as the requests it waits for

    servers = [MeetingInPause("http://a:8000"), MeetingInPause("http://b:8000")]
    publisher = AdapterPublisher(servers, "pol", pause_mode="wait", adapter_root=tmp_path)
    publisher.publish(1, v1)
    publisher.publish(2, v2)  # one pause at a time, the first would wait for the second and time out
    assert all(s.served.get("pol-v2") == str(v2.resolve()) and not s.paused for s in servers)


def test_a_halt_while_a_pause_is_on_its_way_resumes_after_the_pause_has_landed(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    land = threading.Event()

    class SlowPause(FakeVLLM):
        def __init__(self, url):
            super().__init__(url)
            self.entered = threading.Event()

        def pause(self, mode="keep"):
            self.entered.set()
            assert land.wait(WAIT_S)
            super().pause(mode)  # recorded when it lands

    servers = [SlowPause("http://a:8000"), SlowPause("http://b:8000")]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)  # the first version: no pause
    for s in servers:
        s.calls.clear()
    syncing = threading.Thread(target=publisher.publish, args=(2, v2), daemon=True)
    syncing.start()
    assert all(s.entered.wait(WAIT_S) for s in servers)  # both pause calls are on their way
    resumed = []
    halting = threading.Thread(target=lambda: resumed.extend(publisher.halt()), daemon=True)
    halting.start()
    assert publisher._halted.wait(WAIT_S)  # halt() has begun: now it waits for the pauses on their way
    land.set()
    halting.join(WAIT_S)
    syncing.join(WAIT_S)
    assert not halting.is_alive() and not syncing.is_alive()
    # Nothing was resumed before its pause landed (a resume that overtakes the pause leaves the server paused once
    # the process has exited); halt() or the sync itself, whichever came first, resumed each after it.
    for s in servers:
        assert s.calls[0] == ("pause", "keep") and ("resume",) in s.calls and not s.paused
    assert set(resumed) <= {"http://a:8000", "http://b:8000"} and not publisher._paused
