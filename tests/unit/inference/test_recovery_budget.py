"""At start, with several ranks, `ddp_timeout` must outlast rank 0's longest wait (a batch from the queue, a sync
through a server outage, with adapter uploads under `adapter_delivery: http`, or a held-out evaluation): ranks other
than 0 wait in a collective meanwhile. A single process has no collective to time out."""

import pytest
from fakes import cfg

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.inference.recovery import (
    batch_wait_s,
    check_evaluation_fits_ddp_timeout,
    check_outage_fits_ddp_timeout,
    connect_retry_s,
    delivery_s,
    evaluation_wait_s,
    outage_s,
    sync_wait_s,
)
from asyncgrpo.rollout import delivery

HTTP = {"adapter_delivery": "http", "adapter_receiver_url": "http://10.0.0.5:8001"}


def test_connection_retries_are_the_client_defaults_six_connect_timeouts_and_five_backoffs():
    assert connect_retry_s() == 6 * 5.0 + (0.5 + 1 + 2 + 4 + 8)  # 45.5 s


def test_a_ddp_timeout_shorter_than_the_batch_wait_is_an_error_naming_the_keys_and_the_fix():
    short = cfg(ddp_timeout=60, vllm_server_timeout=200, vllm_request_timeout=120)  # the failing run
    with pytest.raises(ConfigError) as error:
        check_outage_fits_ddp_timeout(short, world_size=2)
    assert str(error.value) == (
        "config `ddp_timeout`: 60 s is not longer than the longest wait of rank 0 that the run survives, 680 s: a "
        "batch from the rollout queue waits up to 4 x vllm_request_timeout 120 s + vllm_server_timeout 200 s = 680 s; "
        "a weight sync through a server outage up to vllm_server_timeout + vllm_request_timeout + 45.5 s of connection "
        "retries = 365.5 s; ranks other than 0 would time out in a collective meanwhile. Fix: set ddp_timeout: 681 or "
        "more, or lower vllm_server_timeout or vllm_request_timeout")
    check_outage_fits_ddp_timeout(short, world_size=1)  # one process: nothing waits in a collective


def test_the_recipe_waits_for_a_batch_as_long_as_the_check_counts():
    # trainer/recipe.py passes batch_wait_s(cfg) to take(): the two cannot drift apart
    assert batch_wait_s(cfg(vllm_request_timeout=40, vllm_server_timeout=30)) == 4 * 40 + 30


@pytest.mark.parametrize("values", [
    {"vllm_server_timeout": 200, "vllm_request_timeout": 120},  # the batch wait is the longest
    {"vllm_server_timeout": 600, "vllm_request_timeout": 10},  # the sync through an outage is the longest
    {"vllm_server_timeout": 30, "vllm_request_timeout": 40, **HTTP},  # the adapter uploads dominate
    {"vllm_server_timeout": 0.5, "vllm_request_timeout": 0.25},  # fractions: the suggestion still suffices
])
def test_the_suggested_ddp_timeout_passes_and_one_second_less_fails(values):
    with pytest.raises(ConfigError) as error:
        check_outage_fits_ddp_timeout(cfg(ddp_timeout=1, **values), world_size=2)
    suggested = int(str(error.value).split("set ddp_timeout: ")[1].split()[0])
    check_outage_fits_ddp_timeout(cfg(ddp_timeout=suggested, **values), world_size=2)
    with pytest.raises(ConfigError):
        check_outage_fits_ddp_timeout(cfg(ddp_timeout=suggested - 1, **values), world_size=2)


def test_the_sync_through_an_outage_counts_the_adapter_uploads_twice_with_http_delivery():
    shared = cfg(vllm_server_timeout=30, vllm_request_timeout=40)
    http = cfg(vllm_server_timeout=30, vllm_request_timeout=40, **HTTP)
    assert delivery_s(shared) == 0 and sync_wait_s(shared) == outage_s(shared) == 115.5
    # two files (weights, adapter_config.json) within the upload timeout, then commit and load, each with its connect
    one = 2 * (delivery.CONNECT_TIMEOUT_S + delivery.UPLOAD_TIMEOUT_S) + 2 * (delivery.CONNECT_TIMEOUT_S +
                                                                           delivery.ADMIN_TIMEOUT_S)
    assert delivery_s(http) == one == 1460
    assert sync_wait_s(http) == 115.5 + 2 * 1460 + 30  # and a receiver outage waited out (vllm_server_timeout)
    with pytest.raises(ConfigError, match=r"\+ 2 x 1460 s of adapter uploads and a receiver outage"):
        check_outage_fits_ddp_timeout(cfg(ddp_timeout=1800, **HTTP), world_size=2)


def test_the_defaults_and_the_demo_config_leave_room_for_rank_0s_longest_wait():
    check_outage_fits_ddp_timeout(cfg(), world_size=8)
    demo = AsyncGRPOConfig.load("configs/demo.yaml", [])
    assert demo.ddp_timeout > max(batch_wait_s(demo), outage_s(demo))
    check_outage_fits_ddp_timeout(demo, world_size=2)


def test_the_default_ddp_timeout_covers_every_wait_with_the_default_timeouts_http_delivery_included():
    check_outage_fits_ddp_timeout(cfg(**HTTP), world_size=16)  # a multi-node run that changes no timeout
    with pytest.raises(ConfigError):
        check_outage_fits_ddp_timeout(cfg(ddp_timeout=1800, **HTTP), world_size=16)  # the old default did not


# ---- the held-out evaluation: rank 0 evaluates while the others wait --------------------------------------------
def test_an_evaluation_waits_one_request_timeout_per_turn_and_one_outage():
    c = cfg(vllm_server_timeout=200, vllm_request_timeout=120)
    assert evaluation_wait_s(c, prompts=0, concurrency=16) == 0.0  # no eval_dataset
    assert evaluation_wait_s(c, prompts=16, concurrency=16) == outage_s(c)  # one turn: the outage is that turn
    assert evaluation_wait_s(c, prompts=17, concurrency=16) == 120 + outage_s(c)
    assert evaluation_wait_s(c, prompts=160, concurrency=16) == 9 * 120 + outage_s(c)


def test_a_ddp_timeout_shorter_than_an_evaluation_is_an_error_with_the_smallest_value_that_passes():
    c = cfg(ddp_timeout=900, vllm_server_timeout=200, vllm_request_timeout=120)
    wait = evaluation_wait_s(c, prompts=160, concurrency=16)  # 1080 + 365.5
    with pytest.raises(ConfigError) as error:
        check_evaluation_fits_ddp_timeout(c, world_size=2, wait_s=wait)
    assert "longest held-out evaluation" in str(error.value) and "1445.5 s" in str(error.value)
    assert "set ddp_timeout: 1446 or more" in str(error.value)
    check_evaluation_fits_ddp_timeout(cfg(ddp_timeout=1446, vllm_server_timeout=200, vllm_request_timeout=120),
                                      world_size=2, wait_s=wait)
    check_evaluation_fits_ddp_timeout(c, world_size=1, wait_s=wait)  # one process: nothing waits in a collective


def test_the_rollout_side_counts_its_own_held_out_prompts():
    from types import SimpleNamespace

    from asyncgrpo.rollout.side import EVAL_CONCURRENCY, RolloutSide

    c = cfg(vllm_server_timeout=200, vllm_request_timeout=120)
    side = SimpleNamespace(cfg=c, parts=SimpleNamespace(eval_rows=[object()] * (EVAL_CONCURRENCY * 3)))
    assert RolloutSide.evaluation_wait_s(side) == 2 * 120 + outage_s(c)


def test_the_default_ddp_timeout_covers_an_evaluation_of_a_few_hundred_prompts():
    c = AsyncGRPOConfig()
    assert evaluation_wait_s(c, prompts=400, concurrency=16) < c.ddp_timeout
