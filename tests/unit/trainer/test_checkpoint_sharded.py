"""Checkpoints of FSDP1 and FSDP2 models on two real gloo ranks: the sharded LoRA weights and Adam state go into one
whole checkpoint and come back into each rank's shards exactly.

Rank 0 is the test process itself and rank 1 a child forked from it (so it runs the very code under test, mutated or
not, and starts in milliseconds), as in sync/test_gather.py: rank 0's calls are traced in-process by coverage and
mutation tools while both ranks run the real collectives (torch.distributed.checkpoint's state-dict API, the LoRA
gather, the broadcast of the temporary directory). The test sends a scenario's name and a shared directory to the
child and runs the same scenario as rank 0; the child answers `ok NAME` or its traceback.

Each scenario builds the same seeded PEFT model on both ranks, shards it with the real wrapper (FullyShardedDataParallel
or fully_shard), takes one AdamW step, saves, then loads the checkpoint into a second model sharded the same way whose
LoRA weights start elsewhere and whose optimizer has no state yet. What each rank holds afterwards (its own shard of
every LoRA parameter and of its Adam moments) must equal what the first model held when it was saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import WORLD, rank_accelerator, two_ranks
from models import tiny_lora
from peft import LoraConfig
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

from asyncgrpo.trainer import checkpoint as ckpt
from asyncgrpo.errors import CheckpointError

# Imported at the top, not in the scenarios: collection imports them once, before rank 1 is forked (and before a
# mutation tool forks its workers), instead of in every run (transformers' import alone takes seconds here).


def peft_model(seed: int):
    """LoRA r=3 on q (6 -> 11) and v (11 -> 6), random non-zero A and B, the same on every rank for one seed. Not
    test_gather's shapes: DTensor caches by shape, not by rank."""
    return tiny_lora(6, 11, lora_seed=seed)


def shard(model, kind: str):
    if kind == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
        return model
    return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))


def accelerator(rank: int, kind: str):
    return rank_accelerator(rank, "fsdp", is_fsdp2=kind == "fsdp2", wait_for_everyone=dist.barrier)


def local(tensor) -> torch.Tensor:
    """This rank's shard (FSDP2: the DTensor's local part; FSDP1: the parameter's view into the flat shard)."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def lora_shards(model) -> dict[str, torch.Tensor]:
    return {n: local(p) for n, p in model.named_parameters() if "lora_" in n}


def adam_shards(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: local(v) for k, v in s.items()} for p, s in optimizer.state.items()}


class AcceleratedLike:
    """The shape of accelerate's AcceleratedOptimizer, which a trainer passes: the torch optimizer is `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def build(kind: str, rank: int, seed: int):
    model = shard(peft_model(seed), kind)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return accelerator(rank, kind), model, optimizer


def step(model, optimizer, rank: int) -> None:
    torch.manual_seed(100 + rank)  # each rank its own micro-batch, as in training
    model(torch.randn(4, 6)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _round_trip(kind: str, rank: int, out: Path):
    """Save after one step, load into a fresh sharded model; returns what rank 0 saw (None on rank 1)."""
    acc, model, optimizer = build(kind, rank, seed=1)
    step(model, optimizer, rank)
    state = ckpt.TrainerState(step=5, version=5, data_position=40, run_id="r2", backend=kind,
                              world_size=WORLD)
    config = LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"])
    path = ckpt.save_checkpoint(acc, model, AcceleratedLike(optimizer), state, output_dir=out, peft_config=config,
                                base_model="tiny")
    weights, moments = lora_shards(model), adam_shards(model, optimizer)

    acc, fresh, fresh_optimizer = build(kind, rank, seed=2)  # the LoRA weights elsewhere, no Adam state
    assert not fresh_optimizer.state
    moved = lora_shards(fresh)
    assert any(not torch.equal(moved[n], w) for n, w in weights.items() if w.numel())
    loaded = ckpt.load_checkpoint(ckpt.checkpoint_path(out, 5), acc, fresh, AcceleratedLike(fresh_optimizer))
    got_weights, got_moments = lora_shards(fresh), adam_shards(fresh, fresh_optimizer)
    assert got_weights.keys() == weights.keys() and len(weights) == 4
    for name, tensor in weights.items():
        assert torch.equal(got_weights[name], tensor), (rank, name)
    # FSDP1: a rank holds Adam state only for the parameters its slice of the flat buffer touches
    assert got_moments.keys() == moments.keys() and moments
    assert len(moments) == 4 or kind == "fsdp1"
    for name, entries in moments.items():
        assert got_moments[name].keys() == entries.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, tensor in entries.items():
            assert torch.equal(got_moments[name][key], tensor), (rank, name, key)
    # The same next step from both: the optimizer continues exactly.
    step(model, optimizer, rank)
    step(fresh, fresh_optimizer, rank)
    after, fresh_after = lora_shards(model), lora_shards(fresh)
    assert all(torch.equal(after[n], fresh_after[n]) for n in after)
    if rank != 0:
        assert path is None, "only rank 0 is told the path"
        return None
    return path, loaded


def fsdp1(rank: int, out: Path):
    return _round_trip("fsdp1", rank, out)


def fsdp2(rank: int, out: Path):
    return _round_trip("fsdp2", rank, out)


def fsdp1_into_fsdp2(rank: int, out: Path):
    """Saved by FSDP1, resumed on FSDP2: the checkpoint holds whole tensors, so any FSDP layout reads it."""
    acc, model, optimizer = build("fsdp1", rank, seed=1)
    step(model, optimizer, rank)
    state = ckpt.TrainerState(step=2, version=2, data_position=8, run_id="r3", backend="fsdp1", world_size=WORLD)
    ckpt.save_checkpoint(acc, model, optimizer, state, output_dir=out, peft_config=LoraConfig(r=3), base_model="tiny")
    full = {n: p.detach().clone() for n, p in _full_lora(acc, model).items()}
    acc, fresh, fresh_optimizer = build("fsdp2", rank, seed=2)
    ckpt.load_checkpoint(ckpt.checkpoint_path(out, 2), acc, fresh, fresh_optimizer)
    got = {ckpt.clean_fsdp_name(n): p.full_tensor() for n, p in fresh.named_parameters() if "lora_" in n}
    assert got.keys() == full.keys()
    assert all(torch.equal(got[n], full[n]) for n in full)
    assert len(fresh_optimizer.state) == 4
    return None


def _full_lora(acc, model) -> dict[str, torch.Tensor]:
    """FSDP1's whole LoRA tensors on every rank (summon_full_params), by their unwrapped names."""
    with FSDP.summon_full_params(model):
        return {ckpt.clean_fsdp_name(n): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def corrupt_shard_refused(rank: int, out: Path):
    """Every rank checks the manifest before it touches the model: a flipped byte in the optimizer state (the
    FSDP state saved whole) is refused on both ranks, with the same message, and no collective is entered."""
    path = out / "checkpoint-5"
    acc, fresh, fresh_optimizer = build("fsdp2", rank, seed=2)
    before = lora_shards(fresh)
    try:
        ckpt.load_checkpoint(path, acc, fresh, fresh_optimizer)
    except CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("a corrupt checkpoint was loaded")
    assert f"checkpoint {str(path)!r}: optimizer.pt is corrupt" in message, message
    assert f"Fix: delete {str(path)!r}" in message, message
    after = lora_shards(fresh)
    assert all(torch.equal(after[n], before[n]) for n in before) and not fresh_optimizer.state
    return message if rank == 0 else None


SHAPES = {"q_proj.lora_A": (3, 6), "q_proj.lora_B": (11, 3), "v_proj.lora_A": (3, 11), "v_proj.lora_B": (6, 3)}
SCENARIOS = {f.__name__: f for f in (fsdp1, fsdp2, fsdp1_into_fsdp2, corrupt_shard_refused)}


# ---- the tests (rank 0) ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with two_ranks(tmp_path_factory.mktemp("checkpoint-ranks"), SCENARIOS) as run:
        def rank_0s(name: str, out: Path):
            result, rank1 = run(name, out)
            assert rank1 is None, "only rank 0 returns anything"
            return result

        yield rank_0s


def read_optimizer_file(path: Path) -> dict:
    return torch.load(path / ckpt.OPTIMIZER, map_location="cpu", weights_only=False)


def check_whole_checkpoint(path: Path, loaded, kind: str) -> None:
    assert path.name == "checkpoint-5"
    assert (loaded.step, loaded.version, loaded.data_position, loaded.backend, loaded.world_size) == (5, 5, 40, kind, 2)
    manifest = ckpt.read_manifest(path)
    # One whole checkpoint for both ranks: both RNG states, rank 0's adapter and optimizer, no per-rank shards.
    assert sorted(manifest["files"]) == ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt",
                                         "rng-rank0.pt", "rng-rank1.pt"], kind
    # The optimizer state is saved whole and keyed by parameter names (FSDP re-shards it on any number of ranks).
    optim = read_optimizer_file(path)
    assert len(optim["state"]) == 4, kind
    for name, entry in optim["state"].items():
        assert "lora_" in name and ".default." in name and "_fsdp_wrapped_module" not in name, name
        expected = next(s for k, s in SHAPES.items() if k in name)
        assert tuple(entry["exp_avg"].shape) == tuple(entry["exp_avg_sq"].shape) == expected, name
        assert type(entry["exp_avg"]) is torch.Tensor and entry["exp_avg"].device.type == "cpu"  # not a DTensor
    adapter = load_file(str(path / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in adapter.items()} == {
        f"base_model.model.{k}.weight": s for k, s in SHAPES.items()}


# One test for every scenario: the two ranks start once per process. A test runner that orders tests by duration
# (mutmut) would otherwise start this module's ranks again after other modules' tests, and a rank forked from a process
# that has already run DTensor code inherits its caches and lock state (rank 1 then hung or got rank 0's shapes).
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's deprecation notes on FSDP1 / the state-dict API
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp_checkpoints_restore_each_ranks_shards_resume_across_fsdp_versions_and_refuse_corruption(ranks,
                                                                                                       tmp_path):
    for kind in ("fsdp1", "fsdp2"):  # each rank's shard of the weights and Adam moments back exactly
        path, loaded = ranks(kind, tmp_path / kind)
        check_whole_checkpoint(path, loaded, kind)
    assert ranks("fsdp1_into_fsdp2", tmp_path / "across") is None  # an FSDP1 checkpoint resumes on FSDP2
    # A flipped byte in the optimizer state (same size: only the sha256 tells) is refused on both ranks.
    file = tmp_path / "fsdp2" / "checkpoint-5" / ckpt.OPTIMIZER
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    message = ranks("corrupt_shard_refused", tmp_path / "fsdp2")
    assert "or start a fresh run" in message


def test_the_state_dict_options_gather_whole_offload_except_on_fsdp1_and_keep_what_the_caller_adds():
    """No ranks needed: what every FSDP gather and load asks of torch's state-dict API. The loads' strict=False (the
    adapter holds the LoRA weights only) must reach torch, whichever backend asks."""
    fsdp1, fsdp2 = ckpt._state_dict_options("fsdp1", strict=False), ckpt._state_dict_options("fsdp2", strict=False)
    assert (fsdp1.full_state_dict, fsdp1.cpu_offload, fsdp1.strict) == (True, False, False)  # FSDP1: no offload
    assert (fsdp2.full_state_dict, fsdp2.cpu_offload, fsdp2.strict) == (True, True, False)
    assert ckpt._state_dict_options("fsdp2").strict is True  # torch's default when nothing is added
