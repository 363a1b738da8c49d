"""One way to build a rollout producer for the unit tests: a real `RolloutProducer`, real `InferenceClient`, real queue
and scorer, against the in-process HTTP stub of tests/fakes.py. The stub stands in for vLLM only where a test
needs an answer a real server cannot give on demand (a dropped request, a request held, a chosen logprob, finish
reason or token id); each test module says which. `rollout_on_stub(route, **config)` builds one; every producer built
is stopped at teardown, through `stop_within`."""

from __future__ import annotations

import json

import pytest
from fakes import DigitTokenizer, ParkingCondition, answer, cfg, sevens
from liveness import returns_within

from asyncgrpo.data import PromptRow
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.build import build_producer
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.scoring import InThreadScoring


BOUND_S = 15.0  # liveness bounds of stop() and take() below


def stop_within(producer, bound_s: float = BOUND_S) -> None:
    """`producer.stop()`, failing the test if it has not returned within `bound_s`. A liveness bound, not a speed
    check: with no answer being scored stop() only joins a thread that returns at once, while a count of answers being
    scored that never gets back to 0 makes it wait its whole STOP_PROCESSING_S (30 s), longer than this bound. Without
    the bound such a mistake only slows each test down by 30 s (mutation testing saw it as a timeout, not a failure)."""
    returns_within(producer.stop, bound_s, "stop() with no answer being scored")


def take_within(q: RolloutQueue, n: int, timeout_s: float, bound_s: float = BOUND_S, trainer_version: int = 0):
    """`q.take(...)`, failing the test if it has not returned (or raised) within `bound_s`: a liveness bound for the
    tests of take's own timeout, whose mistakes (a deadline that never comes, a wait that is never woken) would
    otherwise hang the test instead of failing it."""
    return returns_within(lambda: q.take(n, trainer_version=trainer_version, timeout_s=timeout_s), bound_s,
                          f"take(timeout_s={timeout_s})")


@pytest.fixture(name="take_within")
def take_within_fixture():
    return take_within


@pytest.fixture(name="stop_within")
def stop_within_fixture():
    return stop_within


class StubRollout:
    """A producer (not started) on stub servers (one unless `servers`), with its queue, clients and config. Config
    defaults: 2 completions per prompt, 2 groups per step, max_staleness 0, one request in flight; rows p0..p7 with
    prompt ids [i]; the reward is 1 for the completion "7"."""

    def __init__(self, stubs, route, *, rows=None, tokenizer=None, reward=None, recovery=None,
                 response_template=None, groups_per_step: int = 2, park: bool = False, client_timeout_s: float = 10,
                 servers: int = 1, end_token_ids: frozenset[int] = frozenset(), **cfg_values):
        values = {"num_generations": 2,
                  "per_device_train_batch_size": 2 * groups_per_step, "max_staleness": 0,
                  "max_inflight_requests": 1, "vllm_server_timeout": 30, **cfg_values}
        self.cfg = cfg(**values)
        self.servers = [stubs(route) for _ in range(servers)]  # each answering through `route`
        self.clients = [InferenceClient(s.url, timeout_s=client_timeout_s, connect_retries=0)  # no retry: lost at once
                        for s in self.servers]
        self.server, self.client = self.servers[0], self.clients[0]
        self.queue = RolloutQueue(self.cfg.max_staleness, scale_rewards=self.cfg.scale_rewards,
                                  dynamic_sampling=self.cfg.dynamic_sampling)
        self.scorer = RewardScorer(["asyncgrpo.rewards:format_reward"], None, None,
                                   {"format_reward": {"pattern": "^7$"}})
        if reward is not None:  # a function of the test's own, reported under the name format_reward
            self.scorer.functions = [reward]
        self.rows = rows if rows is not None else [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={})
                                                   for i in range(8)]
        scoring = InThreadScoring(self.scorer, tokenizer or DigitTokenizer(), response_template)
        self.producer = build_producer(self.cfg, clients=self.clients, rows=self.rows, scorer=scoring,
                                       queue=self.queue, groups_per_step=groups_per_step, recovery=recovery,
                                       end_token_ids=end_token_ids)
        if park:
            self.producer.admission.cond = ParkingCondition()

    def generation_bodies(self, server=None) -> list[dict]:
        """The JSON bodies of the generation requests `server` (default: the first) received, in arrival order."""
        return [json.loads(r["body"]) for r in (server or self.server).requests if r["path"] == "/v1/completions"]

    def run(self, version: int = 0, adapter: str = "demo-v0", groups: int | None = None, timeout_s: float = 15):
        """Start, serve `adapter` as `version`, and take one batch (`groups` groups, default one step's)."""
        self.producer.start()
        self.producer.set_policy(version, adapter)
        return self.queue.take(groups or self.producer.groups_per_step, trainer_version=version, timeout_s=timeout_s)


@pytest.fixture
def rollout_on_stub(stubs):
    made: list[StubRollout] = []

    def make(route=sevens, **kw) -> StubRollout:
        made.append(StubRollout(stubs, route, **kw))
        return made[-1]

    make.answer = answer
    make.stop = stop_within
    yield make
    for rollout in made:
        stop_within(rollout.producer)
