"""ZeRO-2 and ZeRO-3 checkpoints through a real DeepSpeed engine on one gloo rank (world size 1, in the test process,
so coverage and mutation tools trace the DeepSpeed branches of save_checkpoint and load_checkpoint).

One rank is enough for what is checked here: that the engine's own checkpoint (LoRA weights, fp32 masters, Adam state)
goes into `deepspeed/` and comes back exactly, that a checkpoint of another ZeRO stage or number of ranks is refused,
and that a checkpoint that lost a DeepSpeed file is refused. Partitions across ranks:
tests/integration/test_checkpoint.py (zero2, zero3 on two ranks). DeepSpeed JIT-builds its CPU comm extension on the
first engine of a machine (~20 s to 2 minutes, cached under TORCH_EXTENSIONS_DIR); later runs load it in a second.
"""

from __future__ import annotations

import json
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
import gloo
from models import tiny_lora
from peft import LoraConfig

from asyncgrpo.trainer import checkpoint as ckpt
from asyncgrpo.errors import CheckpointError
from asyncgrpo.trainer.gather import gather_lora_state

deepspeed = pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups it made in module globals; once the process group they belong to is
    destroyed (another module's test ran in between), they must not be reused."""
    from deepspeed.comm import comm
    from deepspeed.utils import groups

    comm.cdb = None
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP", "mpu", "mesh_device"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of one rank for this module only (DeepSpeed needs one and LOCAL_RANK). A test runner may
    run this module's tests between other modules' (mutmut orders tests by duration), so it can start more than once."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_RANK", "0")
        env.setenv("DS_ACCELERATOR", "cpu")
        with gloo.one_rank(tmp_path_factory.mktemp("zero")):
            forget_deepspeed_groups()
            try:
                yield
            finally:
                forget_deepspeed_groups()


def engine(stage: int, seed: int):
    model = tiny_lora(lora_seed=seed)  # the base: the same for every seed
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    model_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return model_engine


def accelerator(stage: int):
    return SimpleNamespace(is_main_process=True, process_index=0, num_processes=1,
                           distributed_type=DistributedType.DEEPSPEED,
                           state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)),
                           wait_for_everyone=dist.barrier, unwrap_model=lambda m: m.module)


def step(model_engine) -> None:
    torch.manual_seed(100)
    loss = model_engine(torch.randn(4, 5)).pow(2).mean()
    model_engine.backward(loss)
    model_engine.step()


def adam_state(model_engine) -> list[torch.Tensor]:
    """The torch AdamW inside DeepSpeed's optimizer: its state over the fp32 master partitions, and the masters."""
    inner = model_engine.optimizer.optimizer
    tensors = [v.clone() for s in inner.state.values() for v in s.values()]
    return tensors + [p.detach().clone() for group in inner.param_groups for p in group["params"]]


def save(acc, model_engine, out, stage: int, step_: int = 4):
    state = ckpt.TrainerState(step=step_, version=step_, data_position=16, run_id="z1", backend=f"zero{stage}",
                              world_size=1)
    return ckpt.save_checkpoint(acc, model_engine, model_engine.optimizer, state, output_dir=out,
                                peft_config=LoraConfig(r=3), base_model="tiny")


def edit_manifest(path, edit) -> None:
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    edit(manifest)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_restores_lora_weights_fp32_masters_and_adam_state(one_rank, tmp_path, stage):
    acc = accelerator(stage)
    first = engine(stage, seed=1)
    step(first)
    path = save(acc, first, tmp_path, stage)
    assert path == tmp_path / "checkpoint-4"
    weights, moments = gather_lora_state(acc, first), adam_state(first)
    assert len(moments) >= 3  # step, exp_avg, exp_avg_sq of the fp32 partition (ZeRO-2: and the partition itself)

    # DeepSpeed's own checkpoint lies in deepspeed/state, listed in the manifest, and holds no base weight.
    manifest = ckpt.read_manifest(path)
    ds_files = sorted(n for n in manifest["files"] if n.startswith("deepspeed/"))
    tagged = [n for n in ds_files if n.startswith("deepspeed/state/")]
    assert any(n.endswith("optim_states.pt") for n in tagged) and (path / "deepspeed/latest").read_text() == "state"
    assert ckpt.OPTIMIZER not in manifest["files"]  # the engine keeps the Adam state in its own files
    # Beside it, the layout of every backend: the adapter's PEFT files at the top (PeftModel.from_pretrained).
    assert sorted(n for n in manifest["files"] if "/" not in n) == ["adapter_config.json",
                                                                     "adapter_model.safetensors", "rng-rank0.pt"]
    model_states = next(n for n in tagged if n.endswith("model_states.pt"))
    saved_module = torch.load(path / model_states, map_location="cpu", weights_only=False)["module"]
    assert saved_module and all("lora_" in k for k in saved_module), sorted(saved_module)[:4]

    second = engine(stage, seed=2)  # other LoRA weights, no Adam state
    assert any(not torch.equal(gather_lora_state(acc, second)[k], w) for k, w in weights.items())
    loaded = ckpt.load_checkpoint(path, acc, second, second.optimizer)
    assert (loaded.step, loaded.backend, loaded.world_size) == (4, f"zero{stage}", 1)
    got = gather_lora_state(acc, second)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    got_moments = adam_state(second)
    assert len(got_moments) == len(moments) and all(torch.equal(a, b) for a, b in zip(got_moments, moments))
    step(first)
    step(second)  # the same next step from both
    after, second_after = gather_lora_state(acc, first), gather_lora_state(acc, second)
    assert all(torch.equal(after[k], second_after[k]) for k in after)


def test_zero_checkpoint_of_another_stage_or_number_of_ranks_is_refused(one_rank, tmp_path):
    first = engine(2, seed=1)
    step(first)
    path = save(accelerator(2), first, tmp_path, 2)
    with pytest.raises(CheckpointError) as err:  # ZeRO-3 partitions differ from ZeRO-2's
        ckpt.load_checkpoint(path, accelerator(3), engine(3, seed=2), None)
    assert f"{str(path)!r} was saved by a zero2 run of 1 ranks and this run uses zero3 on 1" in str(err.value)
    edit_manifest(path, lambda m: m["state"].update(world_size=2))  # as two ranks would have written it
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, accelerator(2), engine(2, seed=2), None)
    message = str(err.value)
    assert "zero2 run of 2 ranks and this run uses zero2 on 1" in message
    assert "ZeRO needs the same stage and number of ranks" in message


def test_a_checkpoint_whose_deepspeed_partition_is_gone_is_refused_before_deepspeed_reads_it(one_rank, tmp_path):
    """The manifest lists DeepSpeed's files too: a lost partition is named, instead of DeepSpeed's bare assert on a
    tag directory without files."""
    first = engine(2, seed=1)
    path = save(accelerator(2), first, tmp_path, 2)
    name = "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    (path / name).unlink()
    second = engine(2, seed=2)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, accelerator(2), second, second.optimizer)
    assert f"checkpoint {str(path)!r} is missing {name}. Fix: delete {str(path)!r}" in str(err.value)


class _RunsCode:
    def __reduce__(self):
        return open, ("never-created", "w")


def test_deepspeed_files_that_are_unlisted_or_name_other_objects_are_refused_before_deepspeed_reads_them(
        one_rank, tmp_path, monkeypatch):
    """DeepSpeed unpickles its files with the full unpickler: each must be listed, and a payload listed with its
    sha256 (the manifest rewritten) is refused by the names it holds, read without running them."""
    import hashlib

    monkeypatch.chdir(tmp_path)  # where the payload would create its file
    first = engine(2, seed=1)
    path = save(accelerator(2), first, tmp_path / "out", 2)
    extra = "deepspeed/state/extra_optim_states.pt"
    torch.save({"x": torch.ones(1)}, path / extra)
    second = engine(2, seed=2)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, accelerator(2), second, second.optimizer)
    assert str(err.value).startswith(f"checkpoint {str(path)!r}: {extra} is not listed in its manifest.json")
    (path / extra).unlink()
    name = "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(_RunsCode(), path / name)
    data = (path / name).read_bytes()
    edit_manifest(path, lambda m: m["files"].update({name: {"bytes": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}}))
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, accelerator(2), second, second.optimizer)
    assert str(err.value).startswith(f"checkpoint {str(path)!r}: {name} holds objects a DeepSpeed checkpoint never "
                                     f"saves (io.open), so it is not loaded. Fix: resume only from")
    assert not (tmp_path / "never-created").exists()
    (path / name).write_bytes(b"not a torch file")
    edit_manifest(path, lambda m: m["files"].update({name: {"bytes": 16, "sha256": hashlib.sha256(
        b"not a torch file").hexdigest()}}))
    with pytest.raises(CheckpointError, match="holds objects a DeepSpeed checkpoint never saves \\(an unreadable file"):
        ckpt.load_checkpoint(path, accelerator(2), second, second.optimizer)


def test_the_zero_stage_enum_is_saved_by_value_even_where_python_pickles_enums_by_name(tmp_path, monkeypatch):
    # Debian's Python 3.11.2 pickles an enum member as getattr(cls, name) (3.11.7 by value): the load guard refuses
    # a `builtins.getattr`, so every ZeRO checkpoint saved there was refused on resume (seen in a fresh 3.11.2 venv).
    from deepspeed.runtime.zero.config import ZeroStageEnum

    monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
    state = {"zero_stage": ZeroStageEnum.gradients}
    torch.save(state, tmp_path / "by_name.pt")
    assert "builtins.getattr" in torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "by_name.pt")
    with ckpt.deepspeed_enums_by_value():
        torch.save(state, tmp_path / "by_value.pt")
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "by_value.pt")) <= \
        ckpt.DEEPSPEED_GLOBALS
    assert torch.load(tmp_path / "by_value.pt", weights_only=False)["zero_stage"] is ZeroStageEnum.gradients
    import copyreg

    assert ZeroStageEnum not in copyreg.dispatch_table  # left as it was found


def test_a_deepspeed_file_swapped_after_the_check_is_never_read(one_rank, tmp_path, monkeypatch):
    """The attack: whoever can write output_dir swaps a file of `deepspeed/` for a payload after asyncgrpo checked
    it and before DeepSpeed reads it (by path, with the full unpickler). DeepSpeed is given a private copy of the bytes
    that were checked: the payload never runs, and the checkpoint's own state comes back."""
    monkeypatch.chdir(tmp_path)  # where the payload would create its file
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the private copy is made
    (tmp_path / "tmp").mkdir()
    acc = accelerator(2)
    first = engine(2, seed=1)
    step(first)
    path = save(acc, first, tmp_path / "out", 2)
    weights, moments = gather_lora_state(acc, first), adam_state(first)
    name = "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    second = engine(2, seed=2)
    load = second.load_checkpoint

    def swapped_then_loaded(*args, **kwargs):  # the attacker's swap lands in the window, just before DeepSpeed reads
        torch.save(_RunsCode(), path / name)
        return load(*args, **kwargs)

    monkeypatch.setattr(second, "load_checkpoint", swapped_then_loaded)
    ckpt.load_checkpoint(path, acc, second, second.optimizer)
    assert not (tmp_path / "never-created").exists()
    got = gather_lora_state(acc, second)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert all(torch.equal(a, b) for a, b in zip(adam_state(second), moments))
    assert not list((tmp_path / "tmp").iterdir())  # the private copy is gone


def test_a_deepspeed_file_in_a_pickle_protocol_the_check_cannot_read_is_refused_as_a_checkpoint_error(
        one_rank, tmp_path):
    """torch.save(..., pickle_protocol=4) writes opcodes torch's name reader does not know: a CheckpointError naming
    the file, not a bare UnpicklingError."""
    import hashlib

    first = engine(2, seed=1)
    path = save(accelerator(2), first, tmp_path, 2)
    name = "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(torch.load(path / name, weights_only=False), path / name, pickle_protocol=4)
    data = (path / name).read_bytes()
    edit_manifest(path, lambda m: m["files"].update({name: {"bytes": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}}))
    second = engine(2, seed=2)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, accelerator(2), second, second.optimizer)
    assert f"{name} holds objects a DeepSpeed checkpoint never saves (an unreadable file (UnpicklingError" in \
        str(err.value)
