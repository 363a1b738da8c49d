"""bench/memory_ranks.py: the per-process peak it reads, its reset, and the arguments it refuses."""

import pytest

from asyncgrpo.bench import memory_ranks
from asyncgrpo.errors import ConfigError


def test_the_peak_is_reset_to_what_the_process_holds_now():
    block = bytearray(256 * 2**20)  # touched: 256 MiB resident
    block[::4096] = b"x" * len(block[::4096])
    del block  # a single mapping of this size goes back to the system at once
    before = memory_ranks._status_kib("VmHWM")
    memory_ranks._reset_peak()
    after = memory_ranks._status_kib("VmHWM")
    assert before - after > 200 * 2**10  # the freed block no longer counts
    assert after >= memory_ranks._status_kib("VmRSS") - 2**10


def test_an_unknown_field_names_the_cause():
    with pytest.raises(Exception, match="no VmNothing"):
        memory_ranks._status_kib("VmNothing")


@pytest.mark.parametrize("backends,variants,key", [(["ddp", "megatron"], ["default"], "--backend"),
                                                   (["ddp"], ["default", "no_lora"], "--variants"),
                                                   ([], ["default"], "--backend")])
def test_run_refuses_what_it_cannot_launch_before_building_anything(backends, variants, key):
    with pytest.raises(ConfigError) as err:
        memory_ranks.run("shape:qwen2.5-0.5b", backends, variants)
    assert key in str(err.value)
