"""The publisher's hand-over to server recovery (ServerRecovery) in the middle of a sync: a load whose answer was
lost, and a server that restarts during two syncs in a row.

The server is tests/fakes.py's FakeVLLM on its fake Clock: a connection that breaks after the server acted, or a
restart at a chosen call, is what a real vLLM server cannot be made to do on demand (tests/integration/test_faults.py
kills a real one, with no control over which call it hits). ServerRecovery itself is the real one.
"""

from __future__ import annotations

import logging

import pytest
from fakes import Clock, FakeVLLM

from asyncgrpo.inference.recovery import ServerRecovery
from asyncgrpo.rollout.publish import AdapterPublisher


def publisher_for(server, clock, tmp_path, mode):
    recovery = ServerRecovery(60, clock=clock, sleep=clock.sleep)
    publisher = AdapterPublisher([server], "p", sync_mode=mode, recovery=recovery, adapter_root=tmp_path)
    recovery.restore = publisher.restore
    return publisher


def versions(tmp_path, n):
    paths = [tmp_path / f"v{i:06d}" for i in range(n)]
    for p in paths:
        p.mkdir()
    return paths


@pytest.mark.parametrize("mode", ["versioned", "pause"])
def test_a_load_whose_answer_was_lost_is_read_back_not_loaded_again(tmp_path, caplog, mode):
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock)
    publisher = publisher_for(server, clock, tmp_path, mode)
    v0, v1 = versions(tmp_path, 2)
    publisher.publish(0, v0)
    server.lose_answer_of = "load p-v1"  # the server loaded it; the connection broke before its answer
    server.calls.clear()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.inference.recovery"):
        timing = publisher.publish(1, v1)
    assert [c for c in server.said() if c.startswith("load")] == ["load p-v1"]  # once: no "already loaded"
    assert server.said()[-1] == "read"  # ... and read back at the right path
    assert server.served == {"p-v0": str(v0.resolve()), "p-v1": str(v1.resolve())}
    assert publisher.current_name == "p-v1"
    assert timing.paused_s == 0.0  # the attempt that paused failed; the read-back pauses nothing
    assert "connection reset before the answer" in caplog.text  # the log says why the server was waited for


def test_a_lost_answer_for_a_load_at_another_path_fails_the_sync(tmp_path):
    from asyncgrpo.errors import SyncError

    clock = Clock()
    server = FakeVLLM("http://a", clock=clock)
    publisher = publisher_for(server, clock, tmp_path, "versioned")
    v0, v1 = versions(tmp_path, 2)
    publisher.publish(0, v0)
    server.lose_answer_of = "load p-v1"
    original = server.load_adapter
    server.load_adapter = lambda name, path, inplace=False: original(name, v0 if name == "p-v1" else path)
    with pytest.raises(SyncError, match=f"reports adapter 'p-v1' at {str(v0)!r} after loading {str(v1.resolve())!r}"):
        publisher.publish(1, v1)
    assert publisher.current_name == "p-v0"


@pytest.mark.parametrize("mode", ["versioned", "pause"])
def test_a_server_that_restarts_in_two_syncs_in_a_row_is_waited_for_both_times(tmp_path, mode):
    clock = Clock()
    server = FakeVLLM("http://a", clock=clock)
    publisher = publisher_for(server, clock, tmp_path, mode)
    v0, v1, v2 = versions(tmp_path, 3)
    publisher.publish(0, v0)
    for version, path in ((1, v1), (2, v2)):
        server.restart_on = f"load p-v{version}"
        server.calls.clear()
        start = clock.now
        timing = publisher.publish(version, path)
        assert clock.now >= start + server.restart_s  # waited until it answered again
        previous = f"p-v{version - 1}"
        loads = [c for c in server.said() if c.startswith("load")]
        assert loads == [f"load p-v{version}", f"load {previous}", f"load p-v{version}"]  # current one back first
        assert server.served == {previous: str((v0, v1)[version - 1].resolve()), f"p-v{version}": str(path.resolve())}
        assert timing.load_s > 0  # the load that went through is timed
        assert publisher.current_name == f"p-v{version}"
    assert publisher.recovery.recoveries == 2
