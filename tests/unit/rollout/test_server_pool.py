"""Which server gets the next generation request (rollout/server_pool.py): the picker alone, without threads or HTTP, and
the producer's counting of requests in flight per server against stub servers (tests/fakes.py; a real vLLM
server cannot be made to fail a chosen request on demand)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from fakes import generation

from asyncgrpo.errors import InferenceServerError
from asyncgrpo.rollout.server_pool import ServerPicker

DEADLINE_S = 30.0


def servers(n: int) -> list:
    return [SimpleNamespace(base_url=f"http://{'abcd'[i]}:8000") for i in range(n)]


def everyone_up(client) -> bool:
    return True


def picks(picker: ServerPicker, k: int, is_up=everyone_up) -> list[str]:
    return [picker.pick(is_up).base_url[7] for _ in range(k)]


def test_equally_loaded_servers_take_turns():
    picker = ServerPicker(servers(3))
    assert picks(picker, 6) == list("abcabc")
    assert picker.inflight == [2, 2, 2] and picker.sent == [2, 2, 2]
    for c in picker.clients:  # all answered: equal again, and the turn goes on from where it was
        picker.done(c)
    assert picks(picker, 3) == list("abc")


def test_the_server_with_the_fewest_in_flight_gets_the_next_request():
    a, b, c = (picker := ServerPicker(servers(3))).clients
    picks(picker, 6)  # 2 each
    picker.done(b)
    picker.done(b)
    picker.done(c)  # in flight: a 2, b 0, c 1; round robin would now send to a
    assert picks(picker, 3) == list("bcb")  # b, the idlest; then b and c tie at 1 and take turns from c
    assert picker.inflight == [2, 2, 2]


def test_among_equally_idle_servers_the_turn_goes_forward_from_the_last_one_chosen():
    a, b, c = (picker := ServerPicker(servers(3))).clients
    assert picks(picker, 3) == list("abc")  # the turn is back at a
    picker.done(b)
    picker.done(c)  # in flight: a 1, b 0, c 0; b and c tie
    assert picks(picker, 2) == list("bc")  # b comes after a in the turn, then c


def test_a_server_that_is_down_is_skipped_however_idle_it_is():
    a, b = (picker := ServerPicker(servers(2))).clients

    def b_down(client):
        return client is not b

    assert picks(picker, 3, b_down) == list("aaa")
    assert picker.inflight == [3, 0]
    assert picks(picker, 1) == ["b"]  # back up: the least loaded
    # Every server went down just now (the producer only sends while one is up): the least loaded of all.
    assert picks(picker, 1, lambda client: False) == ["b"]


def test_counts_return_to_zero_when_every_request_has_come_back():
    picker = ServerPicker(servers(2))
    sent = [picker.pick(everyone_up) for _ in range(5)]
    for client in sent:
        picker.done(client)
    assert picker.inflight_per_server() == {"http://a:8000": 0, "http://b:8000": 0}
    assert picker.sent_per_server() == {"http://a:8000": 3, "http://b:8000": 2}
    with pytest.raises(AssertionError, match="no request in flight"):
        picker.done(sent[0])


def simulate(latency: dict[str, int], slots: int, ticks: int, pick) -> dict:
    """A deterministic discrete-time run: every request to server s takes `latency[s]` ticks; at each tick the
    answers due come back and then every free slot is filled through `pick(inflight) -> server`. Returns what each
    server was sent in all and in the second half of the run, and the most it ever held at once."""
    inflight = {s: [] for s in latency}  # server -> the ticks its requests are due
    sent = dict.fromkeys(latency, 0)
    late = dict.fromkeys(latency, 0)
    most = dict.fromkeys(latency, 0)
    for now in range(ticks):
        for s in latency:
            for due in [t for t in inflight[s] if t <= now]:
                inflight[s].remove(due)
                pick.done(s)
        while sum(len(v) for v in inflight.values()) < slots:
            s = pick.pick()
            inflight[s].append(now + latency[s])
            sent[s] += 1
            late[s] += now >= ticks // 2
            most[s] = max(most[s], len(inflight[s]))
    return {"sent": sent, "late": late, "most": most}


class LeastLoaded:
    def __init__(self, names):
        self.clients = {n: SimpleNamespace(base_url=n) for n in names}
        self.picker = ServerPicker(list(self.clients.values()))

    def pick(self):
        return self.picker.pick(everyone_up).base_url

    def done(self, name):
        self.picker.done(self.clients[name])


class RoundRobin:
    def __init__(self, names):
        self.names, self.k = list(names), 0

    def pick(self):
        self.k += 1
        return self.names[(self.k - 1) % len(self.names)]

    def done(self, name):
        pass


def test_a_slow_server_gets_fewer_requests_and_is_never_starved_while_it_answers():
    latency = {"fast": 1, "slow": 4}
    run = simulate(latency, slots=8, ticks=200, pick=LeastLoaded(latency))
    fast, slow = run["sent"]["fast"], run["sent"]["slow"]
    assert fast > 3 * slow  # 4x the speed with the same number of slots in use: ~4x the requests
    assert run["late"]["slow"] >= 200 // 2 // 4  # still served in the second half: a new request per answer
    assert run["most"]["slow"] <= 8 // 2 + 1  # never more than its share of the slots (+1, a tie's turn)
    # Round robin sends both the same number, so the slow server piles up nearly every slot.
    rr = simulate(latency, slots=8, ticks=200, pick=RoundRobin(latency))
    assert abs(rr["sent"]["fast"] - rr["sent"]["slow"]) <= 1 and rr["most"]["slow"] >= 6
    assert fast + slow > rr["sent"]["fast"] + rr["sent"]["slow"]  # so least loaded answers more in the same time


# ---- the producer's counting, against stub servers ---------------------------------------------------------------

def test_the_producers_counts_return_to_zero_after_answers(rollout_on_stub):
    rollout = rollout_on_stub(servers=2, groups_per_step=4, per_device_train_batch_size=8, max_inflight_requests=4)
    groups = rollout.run(timeout_s=DEADLINE_S)
    assert sorted(g.index for g in groups) == [0, 1, 2, 3]
    rollout.producer.stop()  # max_staleness 0: nothing more is sent before a new version
    urls = [s.url for s in rollout.servers]
    assert rollout.producer.inflight_per_server() == dict.fromkeys(urls, 0)
    assert rollout.producer.sent_per_server() == dict.fromkeys(urls, 2)  # equally fast: shared evenly
    assert [len(rollout.generation_bodies(s)) for s in rollout.servers] == [2, 2]


def test_the_producers_counts_return_to_zero_after_errors(rollout_on_stub):
    @generation
    def refuse(body):  # an HTTP error the producer does not retry: it fails the run
        body
        return 400, "application/json", json.dumps({"error": "refused on purpose"})

    rollout = rollout_on_stub(refuse, servers=2, groups_per_step=4, per_device_train_batch_size=8,
                              max_inflight_requests=4)
    with pytest.raises(InferenceServerError, match="refused on purpose"):
        rollout.run(timeout_s=DEADLINE_S)
    urls = [s.url for s in rollout.servers]
    producer = rollout.producer
    # Every request sent comes back (the failure stopped further sends). Polled: a request's end is counted under
    # the schedule's lock and then the producer's, and neither is the queue's (waiting on that one only timed out).
    deadline = time.monotonic() + DEADLINE_S
    while producer.inflight or any(producer.inflight_per_server().values()):
        assert time.monotonic() < deadline, (producer.inflight, producer.inflight_per_server())
        time.sleep(0.005)
    assert producer.inflight_per_server() == dict.fromkeys(urls, 0)
    assert sum(producer.sent_per_server().values()) >= 1
