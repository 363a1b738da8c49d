"""The client's HTTP sessions: one per thread while it runs, handed to the next thread when it ends (the producer
makes a thread per request; each used to open a connection of its own and keep it open for the client's lifetime),
and answers parsed to exactly the values sent. The in-process stub server of conftest.py stands in for vLLM: the
tests count sessions and sockets on the client's side, which a real server does not change."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest

from asyncgrpo.inference.client import InferenceClient

LOGPROBS = [-0.1, -1e-9, -123.456789012345, -0.30000000000000004]


def completions_route(logprobs=LOGPROBS, barrier: threading.Barrier | None = None):
    def route(stub, handler):
        if barrier is not None:
            barrier.wait(timeout=10)
        body = json.loads(handler.body)
        choices = [{"index": i, "text": "", "token_ids": list(range(len(logprobs))),
                    "logprobs": {"token_logprobs": logprobs}, "finish_reason": "length"} for i in range(body["n"])]
        return 200, "application/json", json.dumps({"model": body["model"], "choices": choices})
    return route


def in_thread(fn, *args, **kwargs):
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs)
    thread.start()
    return thread


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_threads_that_end_hand_their_session_on_so_sockets_do_not_pile_up(stubs):
    client = InferenceClient(stubs(completions_route()).url)
    in_thread(client.complete, "m", [1], n=1, max_tokens=4).join()
    before = open_fds()
    for _ in range(40):  # one thread per request, as the producer does
        in_thread(client.complete, "m", [1], n=1, max_tokens=4).join()
    assert len(client._sessions) == 1
    assert open_fds() <= before + 1  # before the hand-over: one more socket per request
    client.close()


def test_threads_running_at_once_each_get_a_session_and_later_threads_reuse_them(stubs):
    barrier = threading.Barrier(3)  # the server answers once all three requests are in: they overlap
    client = InferenceClient(stubs(completions_route(barrier=barrier)).url)
    threads = [in_thread(client.complete, "m", [1], n=1, max_tokens=4) for _ in range(3)]
    for t in threads:
        t.join()
    assert len(client._sessions) == 3
    assert len({id(s) for s in client._sessions}) == 3
    barrier.reset()
    threads = [in_thread(client.complete, "m", [1], n=1, max_tokens=4) for _ in range(3)]
    for t in threads:
        t.join()
    assert len(client._sessions) == 3  # the three that the first threads left
    client.close()
    assert client._sessions == [] and len(client._idle) == 0


def test_a_closed_client_makes_new_sessions_rather_than_reusing_closed_ones(stubs):
    client = InferenceClient(stubs(completions_route()).url)
    in_thread(client.complete, "m", [1], n=1, max_tokens=4).join()
    first = client._sessions[0]
    client.close()
    in_thread(client.complete, "m", [1], n=1, max_tokens=4).join()
    assert len(client._sessions) == 1 and client._sessions[0] is not first
    client.close()


def test_completion_logprobs_arrive_exactly_and_a_nan_one_still_parses(stubs):
    client = InferenceClient(stubs(completions_route()).url)
    (got,) = client.complete("m", [1], n=1, max_tokens=4)
    assert got.logprobs == LOGPROBS and got.token_ids == [0, 1, 2, 3]
    assert all(type(t) is int for t in got.token_ids) and all(type(lp) is float for lp in got.logprobs)
    nan_client = InferenceClient(stubs(completions_route([-0.5, math.nan])).url)  # json writes NaN, not JSON
    (got,) = nan_client.complete("m", [1], n=1, max_tokens=2)
    assert got.logprobs[0] == -0.5 and math.isnan(got.logprobs[1])
    client.close()
    nan_client.close()
