"""SIGTERM/SIGINT in `train`: the callback (resume paused servers) runs first, then the process exits with
128 + the signal number. Real signals, sent to this very process; the publisher side is tests/fakes.py's
`FakeVLLM` (a real one is paused and signalled in tests/integration/test_paused_server.py)."""

import os
import signal
import threading
import time

import pytest
from fakes import FakeVLLM

from asyncgrpo.errors import SyncError
from asyncgrpo.cli import main
from asyncgrpo.shutdown import exit_on_signal
from asyncgrpo.rollout.publish import AdapterPublisher


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_runs_the_callback_then_exits_with_128_plus_its_number(signum, code):
    before = signal.getsignal(signum)
    calls = []
    with pytest.raises(SystemExit) as exited:
        with exit_on_signal(lambda: calls.append("halt")):
            os.kill(os.getpid(), signum)
            for _ in range(1000):  # the handler runs at the next bytecode boundary of the main thread
                pass
    assert exited.value.code == code
    assert calls[:1] == ["halt"] and len(calls) <= 2  # by the handler, and maybe also by the watcher thread
    assert signal.getsignal(signum) is before  # handlers restored on the way out


def test_the_callback_also_runs_at_once_on_a_watcher_thread_and_the_wakeup_fd_is_restored():
    # The watcher does not depend on the main thread reaching the interpreter (a collective stuck in C code).
    from_watcher = threading.Event()

    def on_signal():
        if threading.current_thread() is not threading.main_thread():
            from_watcher.set()
        else:  # the main thread "stuck": it gets on only once the watcher has done the work
            from_watcher.wait(10)

    with pytest.raises(SystemExit):
        with exit_on_signal(on_signal):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    assert from_watcher.wait(10)
    assert signal.set_wakeup_fd(-1) == -1  # ours was removed on the way out (nothing else had one)


def test_a_failing_callback_still_exits_with_the_signal_code():
    def broken():
        raise RuntimeError("server gone")

    with pytest.raises(SystemExit) as exited:
        with exit_on_signal(broken):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    assert exited.value.code == 143


def test_halt_resumes_a_server_paused_by_a_sync_stuck_in_a_load(tmp_path):
    loading, release = threading.Event(), threading.Event()

    def stuck(server, name):  # the load holds until the test releases it
        loading.set()
        assert release.wait(30), "the test never released the load"

    server = FakeVLLM(on_load=stuck)
    server.served["run-v0"] = str(tmp_path)
    publisher = AdapterPublisher([server], "run")
    publisher.current_name, publisher.loaded["run-v0"] = "run-v0", tmp_path
    errors = []
    syncing = threading.Thread(target=lambda: _publish(publisher, tmp_path, errors))
    syncing.start()
    assert loading.wait(30)  # the sync has paused the server and is inside the load
    assert server.paused
    assert publisher.halt() == ["http://fake:8000"]  # what the signal handler calls, on another thread
    assert server.paused is False  # resumed while the sync is still stuck
    release.set()
    syncing.join(30)
    with pytest.raises(SyncError, match="SIGTERM/SIGINT"):
        publisher.publish(2, tmp_path)  # halted: no further sync pauses anything
    # halt's resume, then the sync's own `finally`
    assert [call[0] for call in server.calls if call[0] in ("pause", "resume")] == ["pause", "resume", "resume"]
    assert publisher.halt() == []  # a second halt (watcher thread, then handler) resumes nothing again


def _publish(publisher, path, errors):
    try:
        publisher.publish(1, path)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


def test_a_config_error_is_printed_by_rank_0_only_and_exits_2(monkeypatch, capsys):
    argv = ["doctor", "--config", "configs/demo.yaml", "--no_such_key", "1"]
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncgrpo: error: config `no_such_key`: unknown key") and err.count("\n") == 1


def test_a_deferred_sigterm_asks_for_a_stop_and_exits_only_once_the_grace_has_passed():
    asked, halted = threading.Event(), []
    with pytest.raises(SystemExit) as exited:
        with exit_on_signal(lambda: halted.append("halt"), defer=asked.set, grace_s=0.5):
            os.kill(os.getpid(), signal.SIGTERM)
            assert asked.wait(10)  # the loop was asked to stop at a step boundary...
            assert halted == []  # ...and nothing was halted: the step may still publish and save
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a loop that never reaches a boundary: the grace ends it
                time.sleep(0.01)
    assert exited.value.code == 143 and halted[:1] == ["halt"]


def test_further_sigterms_during_the_grace_are_ignored_and_sigint_still_exits_at_once():
    asked, halted = threading.Event(), []
    with pytest.raises(SystemExit) as exited:
        with exit_on_signal(lambda: halted.append("halt"), defer=asked.set, grace_s=600):
            os.kill(os.getpid(), signal.SIGTERM)
            assert asked.wait(10)
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher passing the scheduler's SIGTERM on
            for _ in range(1000):
                pass
            assert halted == []
            os.kill(os.getpid(), signal.SIGINT)  # whoever wants it at once
            for _ in range(1000):
                pass
    assert exited.value.code == 130 and halted[:1] == ["halt"]


def test_a_loop_that_stops_by_itself_within_the_grace_is_not_interrupted_later():
    asked = threading.Event()
    with exit_on_signal(lambda: None, defer=asked.set, grace_s=0.3):
        os.kill(os.getpid(), signal.SIGTERM)
        assert asked.wait(10)
    done = threading.Event()
    threading.Timer(0.6, done.set).start()  # past the grace: a timer left running would interrupt this wait
    assert done.wait(10)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_only_sigterm_is_deferred(signum, code):
    asked = threading.Event()
    with pytest.raises(SystemExit) as exited:
        with exit_on_signal(lambda: None, defer=asked.set, grace_s=600):
            os.kill(os.getpid(), signum)
            for _ in range(1000):
                pass
    assert exited.value.code == code and not asked.is_set()
