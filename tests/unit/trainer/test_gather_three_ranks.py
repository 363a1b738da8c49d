"""The FSDP gathers on three real gloo ranks whose shards are equal in size and different in value: rank 0 must put
each rank's buffer where that rank's rows go. With two ranks only rank 1 ever sends, so a receive that takes any
sender cannot go wrong there; with three it can, and the sends here are ordered so that it would every time: rank 1
sends only once rank 2's send is done (a FileStore key), so rank 2's buffer arrives first.

Rank 0 is the test process, ranks 1 and 2 children forked from it (tests/gloo.py)."""

from __future__ import annotations

import datetime
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from gloo import COLLECTIVE_TIMEOUT_S, rank_accelerator, several_ranks
from models import tiny_lora

from asyncgrpo.trainer.gather import _fsdp1_slices_on_rank0, gather_lora_state

WORLD = 3


def peft_model():
    """LoRA r=3 on q (6 -> 9) and v (9 -> 6): every dim 0 (3, 9, 3, 6) splits evenly in three, so each rank's buffer
    has the same size (30 elements) and only its values tell the ranks apart."""
    return tiny_lora(6, 9, r=3)


@contextmanager
def rank_2_sends_first(rank: int, store_path: str):
    """While inside: rank 2's point-to-point send to rank 0 is done before rank 1 starts its own."""
    store = dist.FileStore(store_path, -1)
    real = dist.send

    def send(tensor, dst, *args, **kwargs):
        if rank == 1:
            store.wait(["rank 2 sent"], datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        real(tensor, dst, *args, **kwargs)
        if rank == 2:
            store.set("rank 2 sent", "yes")

    dist.send = send
    try:
        yield
    finally:
        dist.send = real


# ---- scenarios: each runs on the three ranks -------------------------------------------------------------------------
def fsdp2(rank, store_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    with rank_2_sends_first(rank, store_path):
        return gather_lora_state(rank_accelerator(rank, "fsdp", WORLD, is_fsdp2=True), model)


def fsdp1_slices(rank, store_path):
    """Rank r holds row r of one (3, 4) LoRA weight (elements 4r..4r+3 of it), filled with r + 1."""
    mine = [("q_proj.lora_A.weight", (3, 4), 4 * rank, torch.full((4,), rank + 1.0))]
    with rank_2_sends_first(rank, store_path):
        slices = _fsdp1_slices_on_rank0(rank_accelerator(rank, "fsdp", WORLD, is_fsdp2=False), mine)
    return None if slices is None else [(name, shape, start, piece.tolist()) for name, shape, start, piece in slices]


SCENARIOS = {f.__name__: f for f in (fsdp2, fsdp1_slices)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gather-three")
    with several_ranks(directory, SCENARIOS, WORLD) as run:
        def rank_0s(name: str):
            result, *others = run(name, str(directory / f"order-{name}"))
            assert others == [None, None], "only rank 0 gets the tensors"
            return result

        yield rank_0s


def test_fsdp2_puts_each_ranks_rows_in_place_whichever_rank_sends_first(ranks):
    from peft import get_peft_model_state_dict

    state = ranks("fsdp2")
    expected = get_peft_model_state_dict(peft_model())
    assert sorted(state) == sorted(expected) and len(state) == 4
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


def test_fsdp1_puts_each_ranks_slices_at_their_places_whichever_rank_sends_first(ranks):
    assert ranks("fsdp1_slices") == [("q_proj.lora_A.weight", (3, 4), 4 * r, [r + 1.0] * 4) for r in range(WORLD)]
