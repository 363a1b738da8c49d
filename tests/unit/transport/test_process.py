"""RolloutProcess's calls (transport/process.py, `_call`) and when the connection is given up, without spawning: the
other end is a `multiprocessing.Pipe()` the test answers by hand, and the peer a ChildPeer whose process is a
stand-in the test sets (alive, or ended with an exit code). A real child killed by a signal: test_wire.py; the whole
child against a real server: tests/integration/test_rollout_process.py."""

from __future__ import annotations

import threading
import traceback
from multiprocessing import Pipe

import pytest
from liveness import returns_within

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError, RolloutProcessError
from asyncgrpo.transport import process
from asyncgrpo.transport.process import ChildPeer, RolloutProcess
from asyncgrpo.transport.wire import pack_exception

BOUND_S = 5.0  # liveness bound: every call here returns within a poll or two when the code is right


class StandInProcess:
    """What ChildPeer reads of its child: a pid, whether it lives, its exit code once it has ended."""

    pid = 4242

    def __init__(self):
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout=None):
        pass

    def end(self, code: int) -> None:
        self.exitcode = code


@pytest.fixture
def proxy(tmp_path, monkeypatch):
    """A RolloutProcess whose ChildPeer is connected to `proxy.theirs` (the child's end of a Pipe), already started."""
    monkeypatch.setattr(process, "POLL_S", 0.02)  # liveness is checked every 20 ms instead of every second
    cfg = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path=str(tmp_path), sync_mode="versioned",
                          vllm_request_timeout=0.1)
    peer = ChildPeer()
    peer.conn, theirs = Pipe()
    peer.process = StandInProcess()
    made = RolloutProcess(cfg, model_path="m", peft_config=None, groups_per_step=1, peer=peer)
    made.theirs = theirs
    yield made
    theirs.close()


def answer_once(conn, reply) -> threading.Thread:
    """In a thread: read one request, then send `reply` (what the child's serve loop would)."""
    def run():
        conn.recv()
        conn.send(reply)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_answer_is_returned(proxy):
    answer_once(proxy.theirs, ("ok", {"queue/depth": 3}))
    assert returns_within(proxy.stats, BOUND_S, "stats") == {"queue/depth": 3}


def test_the_request_is_the_op_and_its_positional_arguments(proxy):
    def serve_one():
        request.append(proxy.theirs.recv())
        proxy.theirs.send(("ok", None))

    request = []
    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    returns_within(lambda: proxy.log({"train/loss": 1.0}, 5), BOUND_S, "log")
    thread.join(BOUND_S)
    assert request == [("log", ({"train/loss": 1.0}, 5))]


def test_an_error_there_is_raised_here_with_its_own_type_and_the_connection_stays_usable(proxy):
    try:
        raise ConfigError("reward_funcs", "cannot import my_rewards", "install it on that host")
    except ConfigError as exc:
        failure = ("error", pack_exception(exc, traceback.format_exc()))
    answer_once(proxy.theirs, failure)
    with pytest.raises(ConfigError, match="cannot import my_rewards") as raised:
        proxy.wait_published()
    assert any("raised in the rollout process" in note for note in raised.value.__notes__)
    answer_once(proxy.theirs, ("ok", {"queue/depth": 0}))  # an error is an answer: the next call goes through
    assert returns_within(proxy.stats, BOUND_S, "the call after an error") == {"queue/depth": 0}


def test_a_peer_that_died_is_named_with_its_exit_code_and_the_fix_and_every_later_call_fails_at_once(proxy):
    proxy.peer.process.end(3)
    proxy.theirs.close()  # a dead child's end of the pipe closes with it
    with pytest.raises(RolloutProcessError) as died:
        returns_within(proxy.stats, BOUND_S, "a call to a dead peer")
    message = str(died.value)
    assert "the rollout process (pid 4242) exited with code 3 while the trainer waited for `stats`" in message
    assert "Fix: its last log lines (prefix [rollout])" in message and "rollout_process: false" in message
    with pytest.raises(RolloutProcessError, match="exited with code 3"):
        proxy.adapter_name  # noqa: B018 - a property: the call is the read
    returns_within(lambda: proxy.close(keep_final=True), BOUND_S, "close after the peer died")


def test_a_peer_that_dies_while_a_call_waits_is_reported_within_a_poll(proxy):
    proxy.peer.process.end(-9)  # alive a moment ago: the request is sent, then the wait sees the end
    with pytest.raises(RolloutProcessError, match=r"was killed by SIGKILL while the trainer waited for `take`"):
        returns_within(lambda: proxy.take(1, 0, timeout_s=600), BOUND_S, "take from a peer that died")


def test_a_call_that_times_out_makes_the_connection_unusable_so_a_late_answer_is_never_taken_for_the_next(
        proxy, monkeypatch):
    monkeypatch.setattr(process, "TAKE_GRACE_S", 0.05)  # take's bound: its own timeout plus this grace
    with pytest.raises(RolloutProcessError, match=r"did not answer `take` within 0 s although it is alive.*Fix: if "
                                                  r"a reward function hangs"):
        returns_within(lambda: proxy.take(1, 0, timeout_s=0.0), BOUND_S, "a take that times out")
    assert proxy.theirs.recv() == ("take", (1, 0, 0.0))
    proxy.theirs.send(("ok", b"late"))  # the answer arrives after the call gave up
    with pytest.raises(RolloutProcessError, match="did not answer `take`"):
        proxy.stats()  # refused without sending: the late answer would otherwise be read as this one's
    assert not proxy.theirs.poll(0.1)
    sent, send = [], proxy.peer.conn.send
    proxy.peer.conn.send = lambda message: (sent.append(message), send(message))
    proxy.peer.process.end(0)  # so that stop() has nothing to wait for
    returns_within(lambda: proxy.close(keep_final=True), BOUND_S, "close on a broken connection")
    assert sent == [] and proxy.peer.conn.closed  # nothing more sent on the broken connection, and it is closed


def test_a_call_interrupted_before_its_answer_leaves_the_connection_unusable(proxy):
    def interrupted():
        raise KeyboardInterrupt  # what a signal's exception does to the waiting main thread

    proxy.peer.alive = interrupted  # checked between polls, while the call waits for its answer
    with pytest.raises(KeyboardInterrupt):
        proxy.stats()
    with pytest.raises(RolloutProcessError, match=r"a call to the rollout process \(pid 4242\) \(`stats`\) was "
                                                  r"interrupted before its answer came"):
        proxy.stats()
