"""adaptive_inflight: the rule that moves the cap on requests in flight, and the admission applying it."""

import threading

import pytest

from fakes import cfg as config

from asyncgrpo.inference.server_load import ServerLoad
from asyncgrpo.rollout.admission import Admission
from asyncgrpo.rollout.concurrency import FULL_KV, InflightControl

IDLE = ServerLoad(running=0, waiting=0, kv_cache_usage=0.1)
QUEUED = ServerLoad(running=16, waiting=3, kv_cache_usage=0.5)
FULL = ServerLoad(running=16, waiting=0, kv_cache_usage=FULL_KV)


def test_a_trainer_that_waited_at_the_limit_gets_one_more_request_per_server_up_to_the_ceiling():
    control = InflightControl(4, servers=2, ceiling=7)
    assert control.update([IDLE, IDLE], trainer_waited=True, limit_reached=True) == 6
    assert control.update([IDLE, None], trainer_waited=True, limit_reached=True) == 7  # an unread server: no veto
    assert control.update([IDLE, IDLE], trainer_waited=True, limit_reached=True) == 7
    assert control.changes == 2 and control.last_reason == "trainer waited at the limit"


@pytest.mark.parametrize("waited, reached, reason", [(False, True, "trainer fed"), (True, False, "limit not reached"),
                                                     (False, False, "trainer fed")])
def test_the_limit_holds_unless_the_trainer_waited_and_the_limit_was_what_held_requests_back(waited, reached, reason):
    control = InflightControl(4, servers=1, ceiling=10)
    assert control.update([IDLE], trainer_waited=waited, limit_reached=reached) == 4
    assert control.last_reason == reason and control.changes == 0


def test_a_server_with_requests_queued_holds_the_limit_even_when_the_trainer_waited():
    control = InflightControl(4, servers=2, ceiling=10)
    assert control.update([IDLE, QUEUED], trainer_waited=True, limit_reached=True) == 4
    assert control.last_reason == "server saturated"


def test_a_full_kv_cache_shrinks_the_limit_by_a_quarter_down_to_one_per_server():
    control = InflightControl(16, servers=2, ceiling=32)
    assert control.update([FULL, QUEUED], trainer_waited=True, limit_reached=True) == 12
    assert control.last_reason == "server memory full"
    assert control.update([ServerLoad(1, 0, 0.95), IDLE], trainer_waited=False, limit_reached=False) == 9
    for _ in range(10):
        control.update([FULL], trainer_waited=True, limit_reached=True)
    assert control.limit == 2  # never below one request per server
    just_below = ServerLoad(running=1, waiting=0, kv_cache_usage=FULL_KV - 0.01)
    assert control.update([just_below], trainer_waited=True, limit_reached=True) == 4


def test_the_start_is_kept_within_the_bounds():
    assert InflightControl(50, servers=1, ceiling=8).limit == 8
    assert InflightControl(1, servers=3, ceiling=8).limit == 3
    assert InflightControl(5, servers=4, ceiling=2).limit == 4  # a ceiling below the floor: the floor wins


def _admission(limit):
    cfg = config(max_staleness=4, max_inflight_requests=limit)
    admission = Admission(cfg, groups_per_step=8, max_inflight=limit)
    admission.set_policy(0, "a")
    return admission


def test_the_admission_reports_whether_requests_reached_the_cap_since_the_last_change():
    admission = _admission(2)
    seen = []
    admission.claim()
    assert admission.set_limit(lambda reached: seen.append(reached) or 2) == 2  # one of two in flight
    admission.claim()
    assert admission.set_limit(lambda reached: seen.append(reached) or 3) == 3  # two of two: reached
    admission.finished("a")
    admission.finished("a")
    assert admission.set_limit(lambda reached: seen.append(reached) or 3) == 3  # still 2 in flight at the change
    assert admission.set_limit(lambda reached: seen.append(reached) or 3) == 3  # none since
    assert seen == [False, True, False, False]


def test_a_producer_held_at_the_cap_sends_again_as_soon_as_it_is_raised():
    admission = _admission(1)
    assert admission.claim() == (0, "a")
    got = []
    blocked = threading.Thread(target=lambda: got.append(admission.claim()))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and not got  # at the cap of 1
    admission.set_limit(lambda reached: 2)
    blocked.join(10)
    assert got == [(0, "a")] and admission.inflight == 2


def test_the_config_starts_the_limit_at_the_sized_value_and_caps_it_by_the_staleness_bound():
    base = {"per_device_train_batch_size": 16, "num_generations": 4, "max_staleness": 2}
    fixed = config(**base)
    assert fixed.inflight_requests(4) == 8  # two steps' groups
    adaptive = config(**base, adaptive_inflight=True)
    assert adaptive.inflight_requests(4) == 8 and adaptive.inflight_ceiling(4) == 12  # (2 + 1) x 4 pending
    stream = config(**base, adaptive_inflight=True, rollout_mode="stream", rollout_capacity=20)
    assert stream.inflight_ceiling(4) == 20
    capped = config(**base, adaptive_inflight=True, max_inflight_requests=6)
    assert capped.inflight_ceiling(4) == 6 and capped.inflight_requests(4) == 6  # the cap bounds the start too
    assert config(**base, max_inflight_requests=6).inflight_requests(4) == 6
