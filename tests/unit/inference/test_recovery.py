"""ServerRecovery and the publisher's sync through a server that restarts, with fake servers and a fake clock
(tests/fakes.py's `FakeVLLM` and `Clock`).

A real server killed and restarted mid-run is tested in tests/integration/test_faults.py; here the timing (backoff,
deadline) and the ordering (current adapter back before the new version) are pinned without waiting.
"""

from __future__ import annotations

import socket
import threading

import pytest
from fakes import Clock, FakeVLLM

from asyncgrpo.errors import InferenceServerError, ServerUnreachableError, SyncError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference.recovery import ServerGoneError, ServerRecovery, backoff_delays
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.rollout.publish import AdapterPublisher


def test_backoff_doubles_from_half_a_second_caps_at_five_and_sums_to_the_timeout():
    assert backoff_delays(10) == [0.5, 1.0, 2.0, 4.0, 2.5]
    assert backoff_delays(30) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 2.5]
    assert sum(backoff_delays(240)) == pytest.approx(240)


def test_a_server_that_comes_back_is_restored_before_it_is_marked_up():
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock, back_at=3.0)
    order = []
    recovery = ServerRecovery(60, clock=clock, sleep=clock.sleep)
    recovery.restore = lambda c: order.append(("restore", recovery.is_up(c)))
    recovery.listeners.append(lambda: order.append(("change", recovery.is_up(server))))
    recovery.recover(server, recovery.epoch(server))
    assert server.health_polls == [0.0, 0.5, 1.5, 3.5]  # polled with backoff until it answered
    assert order == [("change", False), ("restore", False), ("change", True)]  # restored while still down
    assert recovery.is_up(server) and recovery.epoch(server) == 1 and recovery.recoveries == 1


def test_a_recovery_someone_else_finished_is_not_repeated():
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock, back_at=0.0)
    recovery = ServerRecovery(60, clock=clock, sleep=clock.sleep)
    seen = recovery.epoch(server)
    recovery.recover(server, seen)
    polls = len(server.health_polls)
    recovery.recover(server, seen)  # a second request that failed before the first recovery: nothing to do
    assert len(server.health_polls) == polls and recovery.recoveries == 1


def test_a_server_that_never_returns_fails_once_with_its_name_and_the_fix():
    clock = Clock()
    server = FakeVLLM("http://node-7:8000", clock=clock, back_at=None)
    recovery = ServerRecovery(10, clock=clock, sleep=clock.sleep)
    with pytest.raises(ServerGoneError) as err:
        recovery.recover(server, 0)
    assert str(err.value) == (
        "inference server http://node-7:8000 stopped answering and did not come back within 10 s "
        "(vllm_server_timeout). Fix: restart it on the same address with the same flags (launch/vllm/serve.sh), "
        "then start the run again from its last checkpoint in output_dir; or raise vllm_server_timeout if the node "
        "needs longer to restart")
    assert sum(clock.sleeps) == pytest.approx(10)  # bounded by the timeout, not more
    polls = len(server.health_polls)
    with pytest.raises(ServerGoneError):
        recovery.recover(server, 0)  # every later caller gets the same error at once
    assert len(server.health_polls) == polls and not recovery.is_up(server)


def test_a_failed_re_registration_says_the_server_came_back():
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock, back_at=0.0)

    def restore(client):
        raise InferenceServerError("load_adapter: HTTP 404 no such directory")

    recovery = ServerRecovery(10, restore=restore, clock=clock, sleep=clock.sleep)
    with pytest.raises(InferenceServerError, match="http://a came back but the current adapter could not be "
                                                   "re-registered on it: load_adapter: HTTP 404"):
        recovery.recover(server, 0)


def _publisher(servers, clock, timeout=60, mode="versioned"):
    recovery = ServerRecovery(timeout, clock=clock, sleep=clock.sleep)
    publisher = AdapterPublisher(servers, "p", sync_mode=mode, recovery=recovery)
    recovery.restore = publisher.restore
    return publisher


@pytest.mark.parametrize("mode", ["versioned", "pause"])
def test_a_sync_waits_for_a_restarted_server_and_gives_it_the_current_version_first(mode, tmp_path):
    clock = Clock()
    a, b = FakeVLLM("http://a", clock=clock), FakeVLLM("http://b", clock=clock)
    publisher = _publisher([a, b], clock, mode=mode)
    v0, v1 = tmp_path / "v0", tmp_path / "v1"
    publisher.publish(0, v0)
    b.crash(back_at=7.0)
    b.calls.clear()
    publisher.publish(1, v1)
    assert a.served == {"p-v0": str(v0), "p-v1": str(v1)}
    assert b.served == {"p-v0": str(v0), "p-v1": str(v1)}  # the restarted server got v0 back, then v1
    loads = [c for c in b.said() if c.startswith("load")]
    assert loads == ["load p-v0", "load p-v1"]
    assert clock.now >= 7.0 and publisher.current_name == "p-v1"
    publisher.retire(in_use=set())
    assert a.served == b.served == {"p-v1": str(v1)}


def test_a_sync_to_a_server_that_never_returns_is_all_or_nothing(tmp_path):
    clock = Clock()
    a, b = FakeVLLM("http://a", clock=clock), FakeVLLM("http://b", clock=clock)
    publisher = _publisher([a, b], clock, timeout=5)
    publisher.publish(0, tmp_path / "v0")
    b.crash(back_at=None)
    with pytest.raises(SyncError, match="publishing .*v1 to http://b failed: inference server http://b stopped "
                                        "answering and did not come back within 5 s"):
        publisher.publish(1, tmp_path / "v1")
    assert a.served == {"p-v0": str(tmp_path / "v0")}  # v1 taken off the server that got it
    assert publisher.current_name == "p-v0"


def test_retire_skips_a_version_a_restarted_server_never_had(tmp_path):
    clock = Clock()
    a = FakeVLLM("http://a", clock=clock)
    publisher = _publisher([a], clock)
    publisher.publish(0, tmp_path / "v0")
    publisher.publish(1, tmp_path / "v1")
    a.crash(back_at=0.0)  # restarted at once: it knows neither version
    a.served = {"p-v1": str(tmp_path / "v1")}  # and got the current one back
    publisher.retire(in_use=set())
    assert a.served == {"p-v1": str(tmp_path / "v1")} and list(publisher.loaded) == ["p-v1"]


def test_restore_loads_nothing_when_the_current_version_is_still_served(tmp_path):
    clock = Clock()
    a = FakeVLLM("http://a", clock=clock)
    publisher = _publisher([a], clock)
    publisher.publish(0, tmp_path / "v0")
    a.calls.clear()
    publisher.restore(a)  # a network fault, not a restart: the adapter is still there
    assert a.said() == ["read"]


def test_the_client_tells_an_unreachable_server_from_an_http_error():
    port = find_free_port()  # nothing listens here
    with InferenceClient(f"http://127.0.0.1:{port}", connect_retries=0) as client:
        with pytest.raises(ServerUnreachableError, match=f"cannot reach http://127.0.0.1:{port}/v1/models"):
            client.models()


def test_concurrent_failures_on_one_server_recover_it_once():
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock, back_at=0.0)
    restored = []
    recovery = ServerRecovery(10, restore=restored.append, clock=clock, sleep=clock.sleep)
    seen = recovery.epoch(server)
    threads = [threading.Thread(target=recovery.recover, args=(server, seen)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert restored == [server] and recovery.recoveries == 1



def test_a_server_that_dies_while_answering_counts_as_unreachable():
    """The answer's body is cut short (the process was killed mid-response): a fault to recover from, not a bug."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_half():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"data\"")
        conn.close()

    thread = threading.Thread(target=answer_half)
    thread.start()
    port = listener.getsockname()[1]
    with InferenceClient(f"http://127.0.0.1:{port}", connect_retries=0) as client:
        with pytest.raises(ServerUnreachableError, match="IncompleteRead"):
            client.models()
    thread.join()
    listener.close()
