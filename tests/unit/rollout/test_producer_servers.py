"""Which server the rollout producer sends each request to: the one that is up with the fewest requests in flight.

The servers are Python fakes (no HTTP) that hold every generation request until the test releases it: a real vLLM
server cannot be made to keep a chosen number of requests in flight; the point here is the producer's choice, not
the transport (tests/integration/test_servers.py spreads a real run over two real servers). Every assertion waits
(with a deadline) until the producer has filled every request slot, so no more can be sent and the state is final.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import PromptRow
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.producer import RolloutProducer
from asyncgrpo.rollout.queue import RolloutQueue

DEADLINE_S = 15.0  # each wait here is milliseconds when the rule holds; a broken rule fails at this deadline


class DigitTokenizer:
    def __len__(self):
        return 10

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


class HeldServer:
    """A fake inference client whose requests answer only when the test releases them, first come first served."""

    def __init__(self, url: str):
        self.base_url = url
        self.requests = 0  # generation requests received
        self.held = 0  # of those, waiting to be released
        self._released = 0
        self._cond = threading.Condition()

    def complete(self, adapter, prompt_ids, *, n, max_tokens, temperature, top_p, seed):
        with self._cond:
            self.requests += 1
            mine = self.requests
            self.held += 1
            self._cond.wait_for(lambda: self._released >= mine)
            self.held -= 1
        return [SimpleNamespace(token_ids=[7 if i == 0 else 3], logprobs=[-0.5], finish_reason="stop", text="",
                                model=adapter) for i in range(n)]

    def release(self, k: int = 10**9) -> None:
        with self._cond:
            self._released += k
            self._cond.notify_all()


class Health:
    """Stands in for ServerRecovery's health state: the servers in `down` are being recovered."""

    def __init__(self):
        self.down: set[str] = set()
        self.listeners: list = []

    def is_up(self, client) -> bool:
        return client.base_url not in self.down

    def epoch(self, client) -> int:
        return 0

    def set_down(self, url: str, down: bool) -> None:
        (self.down.add if down else self.down.discard)(url)
        for listener in self.listeners:  # as ServerRecovery does: the producer re-evaluates where to send
            listener()


MAX_INFLIGHT = 3


@pytest.fixture
def make():
    made = []

    def build(n_servers: int, health: Health | None = None):
        cfg = AsyncGRPOConfig.from_dict({"lora_adapter_path": "/tmp/adapters", "num_generations": 2,
                                         "per_device_train_batch_size": 4, "max_staleness": 8,
                                         "max_inflight_requests": MAX_INFLIGHT})
        servers = [HeldServer(f"http://{'abcd'[i]}:8000") for i in range(n_servers)]
        rows = [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={}) for i in range(40)]
        scorer = RewardScorer(["asyncgrpo.rewards:format_reward"], None, None, {"format_reward": {"pattern": "^7$"}})
        producer = RolloutProducer(clients=servers, tokenizer=DigitTokenizer(), rows=rows, scorer=scorer,
                                   queue=RolloutQueue(cfg.max_staleness), groups_per_step=2, cfg=cfg,
                                   recovery=health or Health())
        made.append((producer, servers))
        producer.start()
        producer.set_policy(0, "pol-v0")
        return producer, servers

    yield build
    for producer, servers in made:
        for s in servers:
            s.release()
        producer.stop()


def sent_once_full(producer, servers, total: int) -> list[int]:
    """Wait until `total` requests have reached the servers and every request slot is taken (so nothing more can
    be sent); returns the requests each server received."""
    deadline = time.monotonic() + DEADLINE_S
    while not (sum(s.requests for s in servers) == total and sum(s.held for s in servers) == MAX_INFLIGHT
               and producer.inflight == MAX_INFLIGHT):
        assert time.monotonic() < deadline, f"sent {[s.requests for s in servers]}, wanted {total} in all"
        time.sleep(0.005)  # polling counters, not waiting for a server
    assert sum(s.requests for s in servers) == total
    return [s.requests for s in servers]


def test_the_next_request_goes_to_the_server_with_the_fewest_in_flight(make):
    producer, (a, b) = make(2)
    # equal load goes round-robin: a, b, then a again
    assert sent_once_full(producer, [a, b], 3) == [2, 1]
    assert producer.inflight_per_server() == {"http://a:8000": 2, "http://b:8000": 1}
    b.release(1)  # b has a free slot: 0 in flight against a's 2
    assert sent_once_full(producer, [a, b], 4) == [2, 2]
    b.release(1)  # again: round-robin would send this one to a, which is still busy with two
    assert sent_once_full(producer, [a, b], 5) == [2, 3]
    b.release(1)
    assert sent_once_full(producer, [a, b], 6) == [2, 4]
    assert producer.inflight_per_server() == {"http://a:8000": 2, "http://b:8000": 1}


def test_a_server_being_recovered_gets_nothing_until_it_is_back(make):
    health = Health()
    health.down.add("http://a:8000")
    producer, (a, b) = make(2, health)
    assert sent_once_full(producer, [a, b], 3) == [0, 3]  # a has the fewest in flight, but it is down
    health.set_down("http://a:8000", False)
    b.release(1)
    assert sent_once_full(producer, [a, b], 4) == [1, 3]  # back: the least loaded again
    health.set_down("http://b:8000", True)
    b.release(2)  # b's slots free up while it is down: a gets them although it has more in flight
    assert sent_once_full(producer, [a, b], 6) == [3, 3]


def test_three_servers_share_the_slots_evenly(make):
    producer, servers = make(3)
    assert sent_once_full(producer, servers, 3) == [1, 1, 1]
    servers[1].release(1)  # round-robin would send the next one to servers[0]
    assert sent_once_full(producer, servers, 4) == [1, 2, 1]
