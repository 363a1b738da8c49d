"""At start, with several ranks, `ddp_timeout` must outlast one inference-server outage (ranks other than 0 wait
in a collective meanwhile); a single process has no collective to time out."""

import pytest
from fakes import cfg

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.inference.recovery import check_outage_fits_ddp_timeout, connect_retry_s, outage_s


def test_connection_retries_are_the_client_defaults_six_connect_timeouts_and_five_backoffs():
    assert connect_retry_s() == 6 * 5.0 + (0.5 + 1 + 2 + 4 + 8)  # 45.5 s


def test_a_ddp_timeout_shorter_than_an_outage_is_an_error_naming_both_keys_and_the_fix():
    short = cfg(ddp_timeout=60, vllm_server_timeout=200, vllm_request_timeout=120)  # the failing run
    with pytest.raises(ConfigError) as error:
        check_outage_fits_ddp_timeout(short, world_size=2)
    assert str(error.value) == (
        "config `ddp_timeout`: 60 s is not longer than an inference-server outage this run waits out: "
        "vllm_server_timeout 200 s + vllm_request_timeout 120 s + 45.5 s of connection retries = 365.5 s; ranks other "
        "than 0 would time out in a collective while rank 0 waits for the server. Fix: set ddp_timeout above 365.5 "
        "(e.g. 425), or lower vllm_server_timeout or vllm_request_timeout")
    check_outage_fits_ddp_timeout(short, world_size=1)  # one process: nothing waits in a collective


def test_the_defaults_and_the_demo_config_leave_room_for_an_outage():
    check_outage_fits_ddp_timeout(cfg(), world_size=8)
    demo = AsyncGRPOConfig.load("configs/demo.yaml", [])
    assert demo.ddp_timeout > outage_s(demo)
    check_outage_fits_ddp_timeout(demo, world_size=2)
