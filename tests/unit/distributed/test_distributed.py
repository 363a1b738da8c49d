"""The rules the training processes follow on any launcher: which device they run on, how a failure on rank 0 reaches
the other ranks, where checkpoints may live, and where a batch's tensors go. Two-rank cases run on two real gloo
ranks (tests/gloo.py): each scenario runs on both and returns what happened there."""

from pathlib import Path

import pytest
import torch
from gloo import two_ranks

from asyncgrpo.distributed import on_main, require_shared_dir, require_usable_device, scatter_object
from asyncgrpo.errors import AsyncGRPOError


def _outcome(rank: int, work) -> dict:
    """What `work(ran)` did on this rank: {"ran": ranks that ran rank-0 work, "ok": its result} or the error."""
    ran: list[int] = []
    try:
        return {"ran": ran, "ok": work(ran)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ran": ran, "error": type(exc).__name__, "message": str(exc)}


def main_fails(rank: int, out: Path) -> dict:
    def fail(ran):
        ran.append(rank)
        raise ValueError("the dataset file train.jsonl does not exist")

    return _outcome(rank, lambda ran: on_main(lambda: fail(ran), "start-up"))


def main_succeeds(rank: int, out: Path) -> dict:
    return _outcome(rank, lambda ran: on_main(lambda: ran.append(rank) or "rank-0 result", "start-up"))


def shared_dir(rank: int, out: Path) -> dict:
    return _outcome(rank, lambda ran: require_shared_dir(out / "shared", "output_dir"))


def private_dir(rank: int, out: Path) -> dict:  # as two nodes with node-local disks
    return _outcome(rank, lambda ran: require_shared_dir(out / f"private-{rank}", "output_dir"))


def scatter_shares(rank: int, out: Path):
    """Rank 0 holds a batch's shares (rank 1's holds a marker it must not receive); rank 1 passes a decoy list."""
    parts = [["group-a", "group-c"], {"groups": ["group-b"], "tokens": 7}] if rank == 0 else ["decoy-0", "decoy-1"]
    return scatter_object(parts)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    scenarios = {f.__name__: f for f in (main_fails, main_succeeds, shared_dir, private_dir, scatter_shares)}
    with two_ranks(tmp_path_factory.mktemp("distributed"), scenarios) as run:
        yield lambda name, out: list(run(name, out))


def test_a_launch_of_several_ranks_without_cuda_stops_unless_cpu_was_asked_for(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    for var in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(AsyncGRPOError, match="started 16 ranks but CUDA is not usable") as err:
        require_usable_device()
    assert "ACCELERATE_USE_CPU=true" in str(err.value) and "DS_ACCELERATOR=cpu" in str(err.value)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert require_usable_device() is True
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert require_usable_device() is True
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one plain process (no launcher): a CPU run is fine
    assert require_usable_device() is True


def test_a_failure_on_rank_0_stops_every_rank_with_its_message(ranks, tmp_path):
    rank0, rank1 = ranks("main_fails", tmp_path)
    assert rank0 == {"ran": [0], "error": "ValueError", "message": "the dataset file train.jsonl does not exist"}
    assert rank1["ran"] == []  # only rank 0 runs the work
    assert rank1["error"] == "PeerFailed"
    assert rank1["message"] == "rank 0 failed during start-up: ValueError: the dataset file train.jsonl does not exist"


def test_rank_0_work_returns_its_result_on_rank_0_only(ranks, tmp_path):
    rank0, rank1 = ranks("main_succeeds", tmp_path)
    assert rank0 == {"ran": [0], "ok": "rank-0 result"} and rank1 == {"ran": [], "ok": None}


def test_checkpoints_need_an_output_dir_every_rank_sees(ranks, tmp_path):
    shared = ranks("shared_dir", tmp_path)
    assert shared == [{"ran": [], "ok": None}] * 2
    assert list((tmp_path / "shared").iterdir()) == []  # the probe file is cleaned up
    private = ranks("private_dir", tmp_path)
    for report in private:  # every rank stops, naming the rank that could not see rank 0's file
        assert report["error"] == "AsyncGRPOError"
        assert "is not shared: rank 1 on" in report["message"] and "rank 0 on" not in report["message"]
        assert "Fix: set output_dir to a directory on storage every trainer node mounts" in report["message"]


def test_each_rank_receives_only_its_own_share_of_the_batch(ranks, tmp_path):
    rank0, rank1 = ranks("scatter_shares", tmp_path)
    assert rank0 == ["group-a", "group-c"]  # rank 0 keeps its own part
    assert rank1 == {"groups": ["group-b"], "tokens": 7}  # exactly rank 0's part for rank 1, not its own list


def test_scatter_on_one_process_returns_the_only_part(monkeypatch):
    import asyncgrpo.distributed as distributed

    # This module's two gloo ranks may be up: make this process one that has no process group (or a world of one).
    monkeypatch.setattr(distributed, "is_distributed", lambda: False)
    monkeypatch.setattr(distributed.dist, "scatter_object_list", lambda *a, **k: pytest.fail("a collective ran"))
    assert scatter_object([["all", "groups"]]) == ["all", "groups"]
