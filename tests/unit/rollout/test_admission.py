"""rollout/admission.py: which version a batch needs, and what the producer sends, for which batch and under which
version, with requests in flight.

The server is tests/fakes.py's `FakeVLLM(hold=True)`, holding every generation request until the test releases it: a
real vLLM server cannot be told to keep exactly these requests in flight, and the point is the producer's accounting
(tests/integration/test_training.py runs the producer against a real server). The schedule's condition says when the
producer thread has parked (its send rule is false), so every assertion is taken once the producer has decided.
"""

from __future__ import annotations

import time

import pytest
from fakes import DigitTokenizer, FakeVLLM, ParkingCondition, cfg

from asyncgrpo.data import PromptRow, PromptStream
from asyncgrpo.errors import ConfigError
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.build import build_producer
from asyncgrpo.rollout.producer import request_seed
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.admission import Admission, version_needed
from asyncgrpo.rollout.scoring import InThreadScoring

DEADLINE_S = 15.0  # every wait here is milliseconds when the rule holds; a broken rule fails at this deadline


# ---- version_needed: when the producer may start generating a batch (the version the trainer will hold at the
# batch's first step, less the staleness allowed) ---------------------------------------------------------------------
def test_synchronous_batches_wait_for_the_version_that_trains_them():
    c = cfg(max_staleness=0)
    assert [version_needed(b, c) for b in range(4)] == [0, 1, 2, 3]


def test_one_step_of_staleness_lets_the_next_batch_start_one_version_early():
    c = cfg(max_staleness=1)
    assert [version_needed(b, c) for b in range(4)] == [-1, 0, 1, 2]


def test_num_iterations_with_one_publish_per_batch_keeps_staleness_in_batches():
    # Batch b is trained at steps 3b..3b+2 and published after them: version b trains it.
    assert [version_needed(b, cfg(num_iterations=3, weight_sync_steps=3, max_staleness=0)) for b in range(4)] == \
        [0, 1, 2, 3]
    assert [version_needed(b, cfg(num_iterations=3, weight_sync_steps=3, max_staleness=1)) for b in range(4)] == \
        [-1, 0, 1, 2]


def test_num_iterations_with_a_publish_every_step_counts_every_step_as_a_version():
    # Batch b first trains at step 3b = version 3b: with max_staleness 1 it starts during the previous batch's
    # last pass only.
    c = cfg(num_iterations=3, weight_sync_steps=1, max_staleness=1)
    assert [version_needed(b, c) for b in range(4)] == [-1, 2, 5, 8]


def test_request_seeds_are_fixed_numbers_below_2_to_the_31():
    """A resumed run must send the same seeds as the run it continues, and vLLM takes a signed 32-bit seed."""
    assert request_seed(3, 5, 8) == 3 * 1_000_003 + 5 * 8
    assert request_seed(3000, 0, 8) == 3_000_009_000 - 2**31  # wraps at 2**31, not 2**32
    assert all(0 <= request_seed(s, i, 16) < 2**31 for s in (0, 7, 10**6) for i in (0, 1, 10**9))


def test_a_publish_every_other_step_rounds_the_version_down():
    # Batch b trains at step b; with a publish every 2 steps the trainer then holds version b // 2, less 1 of staleness.
    c = cfg(weight_sync_steps=2, max_staleness=1)  # (0 with this pair is refused: config.py)
    assert [version_needed(b, c) for b in range(5)] == [-1, -1, 0, 0, 1]


# ---- the producer's sends under its schedule -------------------------------------------------------------------------
class Harness:
    def __init__(self, *, max_staleness: int, max_inflight: int, groups_per_step: int = 2, scale_rewards=True,
                 start_position: int = 0, start_batch: int = 0, **cfg_values):
        config = cfg(num_generations=4, per_device_train_batch_size=4 * groups_per_step, max_staleness=max_staleness,
                     max_inflight_requests=max_inflight, scale_rewards=scale_rewards, **cfg_values)
        self.queue = RolloutQueue(config.max_staleness)
        self.server = FakeVLLM("http://held:8000", hold=True)  # completion 0 is "7" (reward 1), the others "3" (0)
        rows = [PromptRow(prompt=f"p{i}", prompt_ids=[i], columns={}) for i in range(40)]
        scorer = RewardScorer(["asyncgrpo.rewards:format_reward"], None, None, {"format_reward": {"pattern": "^7$"}})
        self.producer = build_producer(config, clients=[self.server], rows=rows,
                                       scorer=InThreadScoring(scorer, DigitTokenizer()), queue=self.queue,
                                       groups_per_step=groups_per_step, start_position=start_position,
                                       start_batch=start_batch)
        self.cond = self.producer.admission.cond = ParkingCondition()
        self.rows = rows

    def settled(self, action=None) -> tuple[int, int, int]:
        """Run `action`, let the producer decide, and return (in flight, queued, requests sent) once it has parked."""
        with self.cond:
            self.cond.parked.clear()
            if action is not None:
                action()
            self.cond.notify_all()
        self.wait_until(self.cond.parked.is_set, "the producer never parked")
        # requests just sent are on their way to the server
        self.wait_until(lambda: self.server.held == self.producer.inflight,
                        "requests in flight never reached the server")
        with self.cond:
            inflight, sent = self.producer.inflight, len(self.server.requests)
        return inflight, len(self.queue), sent

    def release(self, k: int) -> None:
        """Let `k` held requests answer, and wait until they are out of flight. Only where the send rule keeps the
    producer from sending in their place (otherwise in flight would not go down)."""
        target = self.producer.inflight - k
        self.server.release(k)
        self.wait_until(lambda: self.producer.inflight <= target, "released requests never finished")

    def wait_until(self, condition, what: str) -> None:
        """Poll `condition` (a counter or a flag, not a server) until DEADLINE_S; a producer that failed meanwhile
        fails the test at once, with its error, instead of at the deadline."""
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert self.producer.error is None, f"the producer failed: {self.producer.error!r}"
            assert time.monotonic() < deadline, what
            time.sleep(0.005)


@pytest.fixture
def harness(stop_within):
    made = []

    def make(**kw) -> Harness:
        made.append(Harness(**kw))
        made[-1].producer.start()
        return made[-1]

    yield make
    for h in made:
        h.server.release()  # the pool's threads must finish before stop() can join them
        stop_within(h.producer)


def test_nothing_is_sent_before_the_first_policy_is_served(harness):
    h = harness(max_staleness=1, max_inflight=8)
    assert h.settled() == (0, 0, 0)


def test_requests_in_flight_count_toward_the_batch_they_will_fill(harness):
    # max_staleness 0: batch k may only be generated by version k. Two groups per step.
    h = harness(max_staleness=0, max_inflight=8)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (2, 0, 2)  # batch 0's two groups, no more
    h.release(2)
    assert h.settled() == (0, 2, 2)  # queued groups count too: batch 1 still waits for version 1
    assert [g.index for g in h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)] == [0, 1]
    assert h.settled() == (0, 0, 2)  # batch 0 was taken; the next one is batch 1, which needs version 1
    assert h.settled(lambda: h.producer.set_policy(1, "pol-v1")) == (2, 0, 4)
    assert [adapter for adapter, _ in h.server.requests] == ["pol-v0", "pol-v0", "pol-v1", "pol-v1"]
    h.release(2)
    batch = h.queue.take(2, trainer_version=1, timeout_s=DEADLINE_S)
    assert [(g.index, g.version, g.adapter) for g in batch] == [(2, 1, "pol-v1"), (3, 1, "pol-v1")]
    assert h.queue.dropped_stale == 0


def test_one_step_of_staleness_generates_the_next_batch_on_the_previous_version(harness):
    h = harness(max_staleness=1, max_inflight=8)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (4, 0, 4)  # batches 0 and 1 under version 0
    assert h.producer.adapters_in_use() == {"pol-v0"}
    h.release(2)
    assert [g.version for g in h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)] == [0, 0]
    assert h.settled() == (2, 0, 4)  # batch 2 needs version 1
    assert h.settled(lambda: h.producer.set_policy(1, "pol-v1")) == (4, 0, 6)
    # batch 1's requests still run on version 0, batch 2's on version 1: both adapters must stay loaded
    assert h.producer.adapters_in_use() == {"pol-v0", "pol-v1"}
    h.release(2)
    assert h.producer.adapters_in_use() == {"pol-v1"}
    batch = h.queue.take(2, trainer_version=1, timeout_s=DEADLINE_S)
    assert [(g.index, g.version) for g in batch] == [(2, 0), (3, 0)]  # one version stale: allowed, not dropped
    assert h.queue.dropped_stale == 0


def test_with_two_passes_per_batch_a_batch_waits_for_its_first_steps_version(harness):
    # num_iterations 2, a sync every step: batch k is first trained at step 2k, by version 2k. A half-sent batch still
    # counts as that batch (its second request may go under version 0 too), not as a fraction of the next one.
    h = harness(max_staleness=0, max_inflight=8, num_iterations=2, weight_sync_steps=1)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (2, 0, 2)
    assert h.settled(lambda: h.producer.set_policy(1, "pol-v1")) == (2, 0, 2)  # batch 1 needs version 2
    assert h.settled(lambda: h.producer.set_policy(2, "pol-v2")) == (4, 0, 4)


def test_max_inflight_requests_caps_what_is_sent_whatever_the_staleness_allows(harness):
    h = harness(max_staleness=5, max_inflight=3)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (3, 0, 3)


def test_unset_max_inflight_requests_keeps_two_steps_of_groups_in_flight(harness):
    h = harness(max_staleness=5, max_inflight=None, groups_per_step=2)  # one server: 2 x 2 groups, not 2 per server
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (4, 0, 4)


@pytest.mark.parametrize("scale,expected", [
    # rewards (1, 0, 0, 0): mean 0.25, sample std 0.5, advantages (r - mean) / (std + 1e-4)
    (True, [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001]),
    (False, [0.75, -0.25, -0.25, -0.25]),
])
def test_a_group_carries_its_rewards_scaled_advantages_and_behaviour_logprobs(harness, scale, expected):
    h = harness(max_staleness=0, max_inflight=2, groups_per_step=1, scale_rewards=scale)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (1, 0, 1)
    assert h.producer.adapters_in_use() == {"pol-v0"}  # one request is enough to keep an adapter loaded
    h.release(1)
    (group,) = h.queue.take(1, trainer_version=0, timeout_s=DEADLINE_S)
    assert group.rewards == [1.0, 0.0, 0.0, 0.0]
    assert group.advantages == pytest.approx(expected, abs=1e-6)
    assert group.completion_ids == [[7], [3], [3], [3]]
    assert group.behaviour_logprobs == [[-0.25], [-0.5], [-0.75], [-1.0]]
    assert (group.index, group.version, group.adapter) == (0, 0, "pol-v0")
    assert group.prompt_ids == h.server.requests[0][1]
    assert h.producer.generated_tokens == 4


def test_a_resumed_producer_continues_at_the_checkpoints_data_position(harness):
    h = harness(max_staleness=0, max_inflight=2, groups_per_step=2, start_position=13)
    h.settled(lambda: h.producer.set_policy(0, "pol-v0"))
    h.release(2)
    batch = h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
    assert [g.index for g in batch] == [13, 14]
    stream = PromptStream(h.rows, seed=0)
    order = [next(stream).prompt_ids for _ in range(15)]  # the uninterrupted run's data order
    assert [g.prompt_ids for g in batch] == order[13:15]


def test_a_producer_resumed_at_batch_3_waits_for_version_3_before_sending(harness):
    # max_staleness 0: batch 3 is generated by version 3 only; a producer that started at batch 0 would send at once
    h = harness(max_staleness=0, max_inflight=8, start_batch=3)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (0, 0, 0)
    assert h.settled(lambda: h.producer.set_policy(3, "pol-v3")) == (2, 0, 2)  # batch 3's two groups
    assert [adapter for adapter, _ in h.server.requests] == ["pol-v3", "pol-v3"]


def test_a_schedule_built_without_batches_taken_fills_batch_0_first():
    s = Admission(cfg(num_generations=4, per_device_train_batch_size=8, max_staleness=0), groups_per_step=2,
                        max_inflight=8)
    s.set_policy(0, "pol-v0")
    with s.cond:
        assert (s.batches_taken, s.next_batch(), s.may_send()) == (0, 0, True)  # batch 0 is version 0's


def test_the_schedule_alone_resumes_at_its_batch_frees_lost_slots_and_waits_for_a_server():
    up = [True]
    s = Admission(cfg(num_generations=4, per_device_train_batch_size=8, max_staleness=0), groups_per_step=2, max_inflight=8, servers_up=lambda: up[0], batches_taken=3)
    s.set_policy(2, "pol-v2")
    with s.cond:
        assert not s.may_send()  # a run resumed at batch 3 needs version 3 for it
    s.set_policy(3, "pol-v3")
    assert [s.claim(), s.claim()] == [(3, "pol-v3"), (3, "pol-v3")]
    with s.cond:
        assert (s.next_batch(), s.may_send()) == (4, False)  # batch 3 is fully sent; batch 4 needs version 4
    s.lost()  # one of batch 3's requests failed: its slot is free again
    with s.cond:
        assert (s.next_batch(), s.may_send()) == (3, True)
        up[0] = False
        assert not s.may_send()  # every server down: nothing is sent
        up[0] = True
    assert s.claim() == (3, "pol-v3")
    s.removed(2, batch=True)  # batch 3 taken by the trainer
    with s.cond:
        assert (s.batches_taken, s.pending, s.next_batch(), s.may_send()) == (4, 0, 4, False)
    assert s.adapters_in_use() == {"pol-v3"}
    s.finished("pol-v3")
    assert (s.inflight, s.adapters_in_use()) == (2, {"pol-v3"})
    s.stop()
    assert s.claim() is None


# ---- rollout_mode: stream ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,after_take", [("batch", (2, 0, 4)), ("stream", (4, 0, 6))])
def test_stream_refills_as_soon_as_a_batch_is_taken_where_batch_waits_for_the_next_version(harness, mode, after_take):
    # max_staleness 1, two groups per step: both modes start with two batches' worth under version 0. Once batch 0 is
    # taken, batch mode's next group is batch 2's, which needs version 1; stream refills the freed capacity at once,
    # because the trainer's next batch (1) may still take a version-0 group.
    h = harness(max_staleness=1, max_inflight=8, rollout_mode=mode)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (4, 0, 4)
    h.release(2)
    assert h.settled() == (2, 2, 4)  # queued groups count toward the capacity too
    h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
    assert h.settled() == after_take


def test_stream_groups_sent_ahead_of_the_version_are_trained_late_or_dropped_as_too_old(harness):
    # The price of sending ahead: after batch 0 is taken, stream sends two more groups under version 0 (indices 4, 5).
    # With the trainer at version 1 the oldest-first take trains groups 2 and 3 (one version stale: allowed); at
    # version 2 the queue has only 4 and 5 left, two versions stale: dropped, and counted with their tokens.
    h = harness(max_staleness=1, max_inflight=8, rollout_mode="stream")
    h.settled(lambda: h.producer.set_policy(0, "pol-v0"))
    h.release(2)
    h.settled()
    assert [g.index for g in h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)] == [0, 1]
    assert h.settled() == (4, 0, 6)
    h.release(4)
    assert [(g.index, g.version) for g in h.queue.take(2, trainer_version=1, timeout_s=DEADLINE_S)] == \
        [(2, 0), (3, 0)]
    with pytest.raises(TimeoutError):
        h.queue.take(2, trainer_version=2, timeout_s=0.01)
    assert (h.queue.dropped_stale, h.queue.dropped_stale_tokens) == (2, 8)  # 2 groups x 4 one-token completions


def test_stream_with_no_staleness_still_waits_for_the_version_that_trains_the_next_batch(harness):
    # Capacity (0 + 1) x 2: one batch. Once it is taken, the next batch needs version 1: a group sent under version 0
    # could only be dropped.
    h = harness(max_staleness=0, max_inflight=8, rollout_mode="stream")
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (2, 0, 2)
    h.release(2)
    h.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
    assert h.settled() == (0, 0, 2)
    assert h.settled(lambda: h.producer.set_policy(1, "pol-v1")) == (2, 0, 4)


def test_stream_capacity_can_be_set_and_max_inflight_requests_still_caps_what_is_in_flight(harness):
    h = harness(max_staleness=2, max_inflight=8, rollout_mode="stream", rollout_capacity=3)
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (3, 0, 3)  # default would be 3 x 2
    h2 = harness(max_staleness=2, max_inflight=4, rollout_mode="stream")
    assert h2.settled(lambda: h2.producer.set_policy(0, "pol-v0")) == (4, 0, 4)  # capacity 6, in flight at most 4


def test_a_stream_producer_resumed_at_batch_3_waits_for_the_version_that_batch_may_be_trained_with(harness):
    h = harness(max_staleness=0, max_inflight=8, start_batch=3, rollout_mode="stream")
    assert h.settled(lambda: h.producer.set_policy(2, "pol-v2")) == (0, 0, 0)
    assert h.settled(lambda: h.producer.set_policy(3, "pol-v3")) == (2, 0, 2)


def test_a_stream_capacity_below_one_step_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="rollout_capacity.*fewer than the 4 groups of one step"):
        Admission(cfg(num_generations=4, per_device_train_batch_size=16, rollout_mode="stream", rollout_capacity=3),
                  groups_per_step=4, max_inflight=8)
    with pytest.raises(ConfigError, match="rollout_mode.*use batch or stream"):
        cfg(rollout_mode="streaming")


# ---- adaptive_inflight: the cap moved after a batch (the rule itself: test_concurrency.py) ---------------------------
def test_an_adaptive_cap_grows_when_the_trainer_waited_at_it_holds_on_a_queueing_server_and_shrinks_on_memory(harness):
    from asyncgrpo.inference.server_load import ServerLoad

    h = harness(max_staleness=4, max_inflight=None, adaptive_inflight=True)  # starts at 4; ceiling (4 + 1) x 2
    assert h.settled(lambda: h.producer.set_policy(0, "pol-v0")) == (4, 0, 4)  # the staleness rule would allow 10

    def adapt(load, reason):
        h.server.load = load
        h.producer.adapt_inflight(trainer_waited=True)
        h.wait_until(lambda: h.producer.control.last_reason == reason and not h.producer._adapting.locked(),
                     f"no update for {reason}")

    adapt(ServerLoad(running=16, waiting=0, kv_cache_usage=0.3), "trainer waited at the limit")
    assert h.settled() == (5, 0, 5) and h.producer.max_inflight == 5  # exactly one more request (one server)
    h.producer.control.last_reason = ""
    adapt(ServerLoad(running=20, waiting=2, kv_cache_usage=0.3), "server saturated")
    assert h.settled() == (5, 0, 5)
    adapt(ServerLoad(running=20, waiting=0, kv_cache_usage=0.95), "server memory full")
    assert h.producer.max_inflight == 4  # 5 less a quarter (at least one)
    h.release(1)
    assert h.settled() == (4, 1, 5)  # one answered and none sent in its place (under the old cap of 5, one would be)
