"""The publisher's protocol with each server: pause -> load -> reset -> resume (in `finally`) -> read back, all servers
or none, and `retire` keeping every version a request still uses.

The servers are recording Python fakes (no HTTP): the failures here (a reset that fails after the load, a server
reporting the adapter at another path, the second of three servers refusing) are what a real vLLM server cannot be
made to do on demand. The happy path and a real refusal run against a real server in
tests/integration/test_sync_safety.py and test_servers.py.
"""

from __future__ import annotations

import threading

import pytest
from fakes import FakeVLLM

from asyncgrpo.errors import InferenceServerError, SyncError
from asyncgrpo.rollout.publish import AdapterPublisher, is_version_of, run_prefix, version_name


class Server(FakeVLLM):
    """The fake vLLM of tests/fakes.py at http://a:8000: records every call in order, `fail` maps a call name to the
    exception it raises, `misreport` makes the read-back report this path for every adapter."""

    def __init__(self, url: str = "http://a:8000", **faults):
        super().__init__(url, **faults)


def versions(tmp_path, n: int):
    paths = [tmp_path / f"v{i:06d}" for i in range(1, n + 1)]
    for p in paths:
        p.mkdir()
    return paths


def serving_v1(tmp_path, *servers, **options):
    """An AdapterPublisher ("pol") for `servers` that has published version 1, the servers' calls cleared since;
    returns it with the directories of versions 1 and 2."""
    v1, v2 = versions(tmp_path, 2)
    publisher = AdapterPublisher(list(servers), "pol", adapter_root=tmp_path, **options)
    publisher.publish(1, v1)
    for server in servers:
        server.calls.clear()
    return publisher, v1, v2


def failed_sync(tmp_path, call: str, error: Exception):
    """Version 2's sync on one Server serving version 1, with its `call` ("load", "reset", ...) raising `error`:
    (the server, the publisher, what the SyncError says)."""
    server = Server()
    publisher, _, v2 = serving_v1(tmp_path, server)
    server.fail[call] = error
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    return server, publisher, str(err.value)


def test_the_first_version_is_loaded_without_a_pause_then_read_back(tmp_path):
    (v1,) = versions(tmp_path, 1)
    server = Server()
    publisher = AdapterPublisher([server], "pol", pause_mode="abort", adapter_root=tmp_path)
    publisher.publish(1, v1)
    assert server.calls == [("load", "pol-v1"), ("read",)]
    assert publisher.current_name == "pol-v1" and publisher.loaded == {"pol-v1": v1.resolve()}


def test_a_new_version_is_loaded_between_pause_and_resume_with_the_cache_reset_then_read_back(tmp_path):
    server = Server()
    publisher, _, v2 = serving_v1(tmp_path, server, pause_mode="abort")
    timing = publisher.publish(2, v2)
    assert server.calls == [("pause", "abort"), ("load", "pol-v2"), ("reset",), ("resume",), ("read",)]
    assert publisher.current_name == "pol-v2" and set(publisher.loaded) == {"pol-v1", "pol-v2"}
    assert timing.paused_s > 0 and timing.load_s > 0 and timing.server_s >= timing.paused_s


def test_versioned_mode_never_pauses(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    server = Server()
    publisher = AdapterPublisher([server], "pol", sync_mode="versioned", adapter_root=tmp_path)
    publisher.publish(1, v1)
    publisher.publish(2, v2)
    assert server.calls == [("load", "pol-v1"), ("read",), ("load", "pol-v2"), ("read",)]
    assert publisher.current_name == "pol-v2"


def test_a_failed_load_still_resumes_the_server_and_keeps_the_previous_version(tmp_path):
    refusal = InferenceServerError("rank 64 > max_lora_rank", status=400)
    server, publisher, err = failed_sync(tmp_path, "load", refusal)
    assert server.calls == [("pause", "keep"), ("load", "pol-v2"), ("resume",)]
    assert "http://a:8000" in err and "still serves pol-v1" in err
    assert publisher.current_name == "pol-v1" and set(publisher.loaded) == {"pol-v1"}


def test_a_failed_cache_reset_unloads_the_new_version_and_still_resumes(tmp_path):
    server, publisher, _ = failed_sync(tmp_path, "reset", InferenceServerError("reset failed", status=500))
    assert server.calls == [("pause", "keep"), ("load", "pol-v2"), ("reset",), ("unload", "pol-v2"), ("resume",)]
    assert server.served == {"pol-v1": str(publisher.loaded["pol-v1"])} and publisher.current_name == "pol-v1"


def test_an_interrupt_between_pause_and_resume_still_resumes(tmp_path):
    server = Server()
    publisher, _, v2 = serving_v1(tmp_path, server)
    server.fail["load"] = KeyboardInterrupt()  # not an Exception: only `finally` catches it
    with pytest.raises(KeyboardInterrupt):
        publisher.publish(2, v2)
    assert server.calls[-1] == ("resume",)


@pytest.mark.parametrize("mode", ["pause", "versioned"])
def test_a_read_back_at_another_path_fails_the_sync_and_unloads_the_new_version(tmp_path, mode):
    server = Server()
    publisher, v1, v2 = serving_v1(tmp_path, server, sync_mode=mode)
    server.misreport = str(v1.resolve())  # the server says the new name serves the old directory
    server.calls.clear()
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert "'pol-v2'" in str(err.value) and str(v2.resolve()) in str(err.value)
    assert ("unload", "pol-v2") in server.calls and server.calls[-1] != ("pause", "keep")
    assert "pol-v2" not in server.served and publisher.current_name == "pol-v1"


def test_a_read_back_that_does_not_list_the_new_version_fails_the_sync(tmp_path):
    (v1,) = versions(tmp_path, 1)

    class Forgetful(Server):
        def adapter_paths(self):
            self.calls.append(("read",))
            return {}

    server = Forgetful()
    with pytest.raises(SyncError, match="at None"):
        AdapterPublisher([server], "pol", adapter_root=tmp_path).publish(1, v1)
    assert server.calls[-1] == ("unload", "pol-v1")


def test_a_sync_is_all_servers_or_none(tmp_path):
    v1, v2 = versions(tmp_path, 2)
    servers = [Server("http://a:8000"), Server("http://b:8000"), Server("http://c:8000")]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    for s in servers:
        s.calls.clear()
    servers[1].fail["load"] = InferenceServerError("no room", status=400)
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert "http://b:8000" in str(err.value)
    assert ("unload", "pol-v2") in servers[0].calls and "pol-v2" not in servers[0].served  # taken back off
    assert servers[0].calls[-1] == ("unload", "pol-v2")
    assert servers[1].calls == [("pause", "keep"), ("load", "pol-v2"), ("resume",)]
    # synced at the same time as the failing one: it got the new version, resumed, then had it taken back off
    assert servers[2].calls[-2:] == [("read",), ("unload", "pol-v2")] and "pol-v2" not in servers[2].served
    assert publisher.current_name == "pol-v1" and set(publisher.loaded) == {"pol-v1"}
    servers[1].fail.clear()
    publisher.publish(3, v2)  # the next sync goes through on all three
    assert all(s.served.get("pol-v3") == str(v2.resolve()) for s in servers)


def test_retire_keeps_the_current_version_and_every_version_a_request_still_uses(tmp_path):
    paths = versions(tmp_path, 4)
    servers = [Server("http://a:8000"), Server("http://b:8000")]
    publisher = AdapterPublisher(servers, "pol", sync_mode="versioned", adapter_root=tmp_path)
    for i, p in enumerate(paths, start=1):
        publisher.publish(i, p)
    for s in servers:
        s.calls.clear()
    publisher.retire(in_use={"pol-v2"})
    for s in servers:
        assert sorted(s.calls) == [("unload", "pol-v1"), ("unload", "pol-v3")]
        assert set(s.served) == {"pol-v2", "pol-v4"}
    assert set(publisher.loaded) == {"pol-v2", "pol-v4"}
    publisher.retire(in_use=set())  # the last request on v2 finished
    assert set(publisher.loaded) == {"pol-v4"} and all(set(s.served) == {"pol-v4"} for s in servers)


def test_retire_stops_on_a_server_error_other_than_not_found(tmp_path):
    server = Server()
    publisher, _, v2 = serving_v1(tmp_path, server, sync_mode="versioned")
    publisher.publish(2, v2)
    server.fail["unload"] = InferenceServerError("internal error", status=500)
    with pytest.raises(InferenceServerError):
        publisher.retire(in_use=set())
    assert "pol-v1" in publisher.loaded  # still tracked: a later retire tries again


class ThreadClock:  # not fakes.Clock: one shared time would mix the concurrent syncs' costs, in no fixed order
    """A fake `time.perf_counter` that only the fake servers' calls move, one time per thread (the servers are synced
    concurrently): a sync thread starts at the publishing thread's time and moves by its own server's calls; the
    publishing thread, once it has joined them, reads the latest of all (a concurrent sync lasts as long as its
    slowest server). Timings become exact."""

    def __init__(self):
        self.main = threading.current_thread()
        self.now = {self.main: 100.0}
        self.lock = threading.Lock()

    def __call__(self):
        me = threading.current_thread()
        with self.lock:
            if me is self.main:
                self.now[me] = max(self.now.values())
            return self.now.setdefault(me, self.now[self.main])

    def advance(self, seconds: float) -> None:
        me = threading.current_thread()
        with self.lock:
            self.now[me] = self.now.get(me, self.now[self.main]) + seconds


def test_timings_are_the_slowest_server_s_and_the_sync_lasts_as_long_as_that_server(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncgrpo.rollout import publish

    clock = ThreadClock()
    monkeypatch.setattr(publish, "time", SimpleNamespace(perf_counter=clock))
    fast = {"pause": 0.25, "load": 2.0, "reset": 0.5, "resume": 0.125}
    slow = {**fast, "load": 3.0}

    class Timed(Server):
        def __init__(self, url, cost):
            super().__init__(url)
            self.cost = cost

        def _call(self, *call):
            clock.advance(self.cost.get(call[0], 0.0))
            super()._call(*call)

    v1, v2 = versions(tmp_path, 2)
    servers = [Timed("http://a:8000", fast), Timed("http://b:8000", slow)]
    publisher = AdapterPublisher(servers, "pol", adapter_root=tmp_path)
    first = publisher.publish(1, v1)  # loaded without a pause, both at once: as long as the slower load
    assert (first.load_s, first.paused_s, first.server_s, first.server_sum_s) == (3.0, 0.0, 3.0, 5.0)
    second = publisher.publish(2, v2)  # per server: pause, then paused for load + reset + resume
    assert (second.load_s, second.paused_s, second.server_s) == (3.0, 3.625, 3.875)
    assert second.server_sum_s == 2.875 + 3.875  # one after another, it would have taken this long


def test_a_read_back_failure_names_the_directory_that_was_loaded(tmp_path):
    server = Server()
    publisher, v1, v2 = serving_v1(tmp_path, server, sync_mode="versioned")
    server.misreport = str(v1.resolve())
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert (f"server http://a:8000 reports adapter 'pol-v2' at {str(v1.resolve())!r} after loading "
            f"{str(v2.resolve())!r}; the new version was not applied") in str(err.value)


def test_a_corrupt_first_version_says_no_adapter_is_served(tmp_path):
    from asyncgrpo.store import MANIFEST_NAME

    (v1,) = versions(tmp_path, 1)
    (v1 / "adapter_model.safetensors").write_bytes(b"12345")
    (v1 / MANIFEST_NAME).write_text('{"adapter_model.safetensors": {"size": 4, "sha256": "0"}}')
    server = Server()
    with pytest.raises(SyncError) as err:
        AdapterPublisher([server], "pol", adapter_root=tmp_path).publish(1, v1)
    assert str(err.value).endswith("No server was asked to load it; the servers still serve no adapter.")
    assert server.calls == []


def test_a_sync_after_a_halt_is_not_started_and_says_why(tmp_path):
    server = Server()
    publisher, _, v2 = serving_v1(tmp_path, server)
    publisher.halt()
    server.calls.clear()
    with pytest.raises(SyncError) as err:
        publisher.publish(2, v2)
    assert "failed: the process is stopping (SIGTERM/SIGINT): this sync was not started\n" in str(err.value)
    assert server.calls == []  # not even paused


def test_a_pause_that_fails_is_undone_at_once_and_not_left_for_halt(tmp_path):
    timeout = InferenceServerError("pause timed out", status=None)  # it may have paused anyway
    server, publisher, _ = failed_sync(tmp_path, "pause", timeout)
    assert server.calls == [("pause", "keep"), ("resume",)]
    assert publisher.halt() == []  # nothing is recorded as paused any more


def test_a_halt_after_syncs_that_ended_waits_for_no_pause_call(tmp_path, monkeypatch):
    # halt() waits for pause calls still on their way, at most HALT_WAIT_S; once every sync has ended (one paused
    # and resumed the server, one whose pause failed) none is on its way, so it returns at once, even with a long wait.
    from asyncgrpo.rollout import publish as publish_module

    monkeypatch.setattr(publish_module, "HALT_WAIT_S", 600.0)
    _, publisher, _ = failed_sync(tmp_path, "pause", InferenceServerError("pause timed out", status=None))
    halting = threading.Thread(target=publisher.halt, name="test-halt", daemon=True)
    halting.start()
    halting.join(15.0)  # a liveness bound: a pause counted as still on its way makes halt() wait its 600 s
    assert not halting.is_alive(), "halt() waited for a pause call that had returned"


def test_a_resume_that_fails_says_the_server_may_still_be_paused_and_how_to_resume_it(tmp_path):
    *_, err = failed_sync(tmp_path, "resume", InferenceServerError("HTTP 500", status=500))
    assert ("HTTP 500\n  The server http://a:8000 may still be paused: resume it by hand with "
            "`curl -X POST http://a:8000/resume` (POST /resume)") in err


def test_a_halt_during_a_load_resumes_the_server_and_the_sync_still_finishes(tmp_path):
    v1, v2 = versions(tmp_path, 2)

    class HaltedWhileLoading(Server):
        def load_adapter(self, name, path, inplace=False):
            super().load_adapter(name, path, inplace)
            if name == "pol-v2":
                assert publisher.halt() == ["http://a:8000"]  # SIGTERM arrives while the load runs

    server = HaltedWhileLoading()
    publisher = AdapterPublisher([server], "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    server.calls.clear()
    publisher.publish(2, v2)
    assert server.calls == [("pause", "keep"), ("load", "pol-v2"), ("resume",), ("reset",), ("resume",), ("read",)]
    assert publisher.current_name == "pol-v2"


def test_a_failure_says_what_the_server_serves_now(tmp_path):
    from asyncgrpo.errors import ServerUnreachableError

    (v1,) = versions(tmp_path, 1)
    refusing = Server(fail={"load": InferenceServerError("rank too large", status=400)})
    with pytest.raises(SyncError) as err:
        AdapterPublisher([refusing], "pol", adapter_root=tmp_path).publish(1, v1)
    assert str(err.value).endswith("\n  The server is not paused and still serves no adapter.")
    dead = Server(fail={"load": ServerUnreachableError("cannot reach http://a:8000")})
    with pytest.raises(SyncError) as err:
        AdapterPublisher([dead], "pol", adapter_root=tmp_path).publish(1, v1)
    assert str(err.value).endswith(
        "\n  The server did not answer (it is down or restarting); nothing is being served by it now.")


def test_a_halt_while_a_load_hangs_resumes_the_server_and_the_sync_fails_without_the_new_version(tmp_path):
    # What tests/integration/test_paused_server.py does to a real trainer (its proxy holds the load until the server
    # is resumed, then refuses it): halt() comes from another thread, while the sync is stuck inside the load.
    v1, v2 = versions(tmp_path, 2)
    inside, resumed = threading.Event(), threading.Event()

    class HangingLoad(Server):
        def load_adapter(self, name, path, inplace=False):
            if name == "pol-v2":
                inside.set()
                assert resumed.wait(30), "halt() did not resume the server"
                raise InferenceServerError("held until the server was resumed, not loaded", status=500)
            super().load_adapter(name, path, inplace)

        def resume(self):
            super().resume()
            resumed.set()

    server = HangingLoad()
    publisher = AdapterPublisher([server], "pol", adapter_root=tmp_path)
    publisher.publish(1, v1)
    errors = []

    def sync():
        try:
            publisher.publish(2, v2)
        except SyncError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=sync, name="test-sync", daemon=True)
    thread.start()
    assert inside.wait(30)
    assert publisher.halt() == ["http://a:8000"]
    thread.join(30)  # a liveness bound: the refused load ends the sync
    assert not thread.is_alive()
    assert "publishing" in errors[0] and "held until the server was resumed, not loaded" in errors[0]
    assert server.calls[-1] == ("resume",) and "pol-v2" not in server.served
    assert publisher.current_name == "pol-v1"


def test_a_runs_adapter_names_are_lora_name_run_id_and_version_and_only_those_are_its_versions():
    prefix = run_prefix("demo", "1a2b3c4d")
    assert (prefix, version_name(prefix, 7), AdapterPublisher([], prefix).name(7)) == (
        "demo-1a2b3c4d", "demo-1a2b3c4d-v7", "demo-1a2b3c4d-v7")
    assert is_version_of("demo-1a2b3c4d-v12", prefix)
    # another run, another lora_name sharing the start, a name that is not a version: not this run's to unload
    assert not any(is_version_of(n, prefix) for n in ["demo-99999999-v1", "demo-1a2b3c4d", "demo-1a2b3c4d-vx",
                                                      "x-demo-1a2b3c4d-v1", "demo-1a2b3c4d-v1-extra"])
