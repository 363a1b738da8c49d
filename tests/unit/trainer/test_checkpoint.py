"""Checkpoints on one process: atomic save, exact round trip, refusal of incomplete or corrupt checkpoints."""

import errno
import hashlib
import json
import math
import os
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from liveness import killed_midway
import torch
from models import Tiny, tiny_lora
from accelerate.utils import DistributedType

from asyncgrpo.contracts import Group
from asyncgrpo.rollout.producer import request_seed
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.trainer import checkpoint as ckpt
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import CheckpointError, ConfigError
from asyncgrpo.trainer.schedule import build_lr_scheduler


def make_model(seed=0):
    model = tiny_lora(8, 8, r=2, seed=seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer, model.peft_config["default"]


def train_one_step(model, optimizer):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


ACC = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1, distributed_type=DistributedType.NO,
                      wait_for_everyone=lambda: None, unwrap_model=lambda m: m)


def save(model, optimizer, config, out, step=3, limit=None):
    state = ckpt.TrainerState(step=step, version=step, data_position=4 * step, run_id="abcd1234")
    return ckpt.save_checkpoint(ACC, model, optimizer, state, output_dir=out, peft_config=config,
                                base_model="tiny", total_limit=limit)


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_round_trip_restores_weights_optimizer_state_and_counters(tmp_path):
    model, optimizer, config = make_model()
    train_one_step(model, optimizer)
    path = save(model, optimizer, config, tmp_path)
    assert path == tmp_path / "checkpoint-3" and (path / "adapter_config.json").is_file()
    expected_weights, expected_exp_avg = lora_state(model), [s["exp_avg"].clone() for s in optimizer.state.values()]

    fresh, fresh_optimizer, _ = make_model()  # the same base; the LoRA moved away, the optimizer state empty
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(1.0)
    state = ckpt.load_checkpoint(ckpt.resolve_checkpoint("latest", tmp_path), ACC, fresh, fresh_optimizer)
    assert (state.step, state.version, state.data_position, state.run_id) == (3, 3, 12, "abcd1234")
    for name, tensor in lora_state(fresh).items():
        assert torch.equal(tensor, expected_weights[name]), name
    assert all(torch.equal(s["exp_avg"], e) for s, e in zip(fresh_optimizer.state.values(), expected_exp_avg))
    # The same next step from both: the optimizer continues exactly.
    torch.manual_seed(7)
    train_one_step(model, optimizer)
    torch.manual_seed(7)
    train_one_step(fresh, fresh_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(lora_state(model).values(), lora_state(fresh).values()))


def test_rng_states_are_restored(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    draws = (random.random(), torch.rand(3))
    random.random(), torch.rand(5)  # move on
    ckpt.restore_rng(path, rank=0)
    again = (random.random(), torch.rand(3))
    assert draws[0] == again[0] and torch.equal(draws[1], again[1])


def test_a_save_killed_midway_leaves_no_checkpoint(tmp_path, monkeypatch):
    model, optimizer, config = make_model()
    real_write = ckpt._write_file

    def dies_on_optimizer(path, write):
        if path.name == ckpt.OPTIMIZER:
            path.write_bytes(b"half")  # what a killed writer leaves
            raise KeyboardInterrupt("killed")
        real_write(path, write)

    monkeypatch.setattr(ckpt, "_write_file", dies_on_optimizer)
    with pytest.raises(KeyboardInterrupt):
        save(model, optimizer, config, tmp_path)
    assert ckpt.list_checkpoints(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # the failed save removed its temporary directory
    with pytest.raises(CheckpointError, match="holds no checkpoint-<step>"):
        ckpt.resolve_checkpoint("latest", tmp_path)
    assert ckpt.clean_partial(tmp_path) == []


def test_missing_manifest_is_an_incomplete_checkpoint(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    (path / ckpt.MANIFEST).unlink()
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, *make_model()[:2])
    assert str(path) in str(err.value) and "incomplete" in str(err.value) and "Fix:" in str(err.value)


def test_truncated_file_is_refused_by_name(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        ckpt.read_manifest(path)
    assert "optimizer.pt is corrupt" in str(err.value) and str(path) in str(err.value)


def test_unknown_format_version_is_refused(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["format_version"] = 99
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99"):
        ckpt.read_manifest(path)


def test_adapter_of_another_shape_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    other = get_peft_model(Tiny(8, 8), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    with pytest.raises(CheckpointError, match="does not fit this model"):
        ckpt.load_checkpoint(path, ACC, other, other_opt)


def test_save_total_limit_keeps_the_newest(tmp_path):
    model, optimizer, config = make_model()
    for step in (2, 4, 6):
        save(model, optimizer, config, tmp_path, step=step, limit=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert ckpt.resolve_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-6"


def test_backends_without_checkpoints_are_refused_with_the_fix():
    for backend in ("ddp", "fsdp1", "fsdp2", "zero2", "zero3"):
        ckpt.check_backend(backend)
    with pytest.raises(CheckpointError) as err:
        ckpt.check_backend("zero1")  # a ZeRO stage no launch config here uses
    assert "zero1" in str(err.value) and "save_steps: 0" in str(err.value)


def test_what_a_resuming_run_must_share_with_the_saving_one():
    assert ckpt._layout("fsdp1", 2) == ckpt._layout("fsdp2", 4)  # FSDP re-shards a whole state on any ranks
    assert ckpt._layout("ddp", 2) == ckpt._layout("ddp", 1)
    assert ckpt._layout("ddp", 2) != ckpt._layout("fsdp2", 2)
    assert ckpt._layout("zero2", 2) != ckpt._layout("zero3", 2)  # DeepSpeed's partitions: same stage...
    assert ckpt._layout("zero3", 2) != ckpt._layout("zero3", 4)  # ...and the same number of ranks


def test_resume_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        ckpt.resolve_checkpoint(str(tmp_path / "nope"), tmp_path)


def test_save_steps_must_be_a_multiple_of_weight_sync_steps():
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "lora_adapter_path": "/tmp/a", "save_steps": 3,
                                   "weight_sync_steps": 2})
    assert err.value.field == "save_steps"
    cfg = AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/a",
                                      "--resume_from_checkpoint", "latest",
                                      "--save_steps", "4", "--save_total_limit", "2"])
    assert (cfg.resume_from_checkpoint, cfg.save_steps, cfg.save_total_limit) == ("latest", 4, 2)


def test_a_batch_is_in_data_order_whatever_request_finished_first():
    """A resumed run must train the same batches: the queue orders by (version, stream position), not arrival."""
    queue = RolloutQueue(max_staleness=1)
    for index, version in [(5, 1), (2, 1), (9, 0), (4, 1)]:
        queue.put(Group(prompt="", prompt_ids=[1], completion_ids=[[2]], behaviour_logprobs=[[0.0]], rewards=[0.0],
                        reward_parts={}, advantages=[0.0], version=version, adapter="a", index=index))
    assert [g.index for g in queue.take(4, trainer_version=1, timeout_s=1)] == [9, 2, 4, 5]
    # vLLM seeds completion i of a request with seed + i: consecutive prompts' seeds never overlap.
    assert request_seed(0, 3, 8) - request_seed(0, 2, 8) == 8


def test_checkpoint_restores_the_schedule_where_it_stopped(tmp_path):
    config = AsyncGRPOConfig.from_dict({"model_name_or_path": "toy", "lora_adapter_path": "/tmp/adapters",
                                        "max_steps": 10,
                                        "lr_scheduler_type": "cosine", "warmup_steps": 2})
    model, optimizer, peft_config = make_model()
    scheduler = build_lr_scheduler(optimizer, config)
    for _ in range(3):
        train_one_step(model, optimizer)
        scheduler.step()
    at_step3 = scheduler.state_dict()
    state = ckpt.TrainerState(step=3, version=3, data_position=12, run_id="abcd1234")
    path = ckpt.save_checkpoint(ACC, model, optimizer, state, output_dir=tmp_path, peft_config=peft_config,
                                base_model="tiny", lr_scheduler=scheduler)
    assert (path / ckpt.SCHEDULER).is_file()
    fresh, fresh_optimizer, _ = make_model()
    fresh_scheduler = build_lr_scheduler(fresh_optimizer, config)  # at step 0: lr 0
    ckpt.load_checkpoint(path, ACC, fresh, fresh_optimizer, lr_scheduler=fresh_scheduler)
    step3 = 1e-2 * 0.5 * (1 + math.cos(math.pi / 8))  # cosine at step 3 of 10, 2 warm-up: progress 1/8
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(step3)
    assert fresh_scheduler.last_epoch == 3
    scheduler.step()
    fresh_scheduler.step()
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    # A checkpoint written before schedules existed resumes at its step's rate.
    (path / ckpt.SCHEDULER).unlink()
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    del manifest["files"][ckpt.SCHEDULER]
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    old, old_optimizer, _ = make_model()
    old_scheduler = build_lr_scheduler(old_optimizer, config)
    ckpt.load_checkpoint(path, ACC, old, old_optimizer, lr_scheduler=old_scheduler)
    assert old_optimizer.param_groups[0]["lr"] == pytest.approx(step3)
    # ... in the state of a schedule that ran those steps, step count included (torch reads `_step_count` to warn
    # about a scheduler.step() before any optimizer.step(), which a resumed run's first step would otherwise trip)
    restored = old_scheduler.state_dict()
    assert restored.pop("_last_lr") == pytest.approx(at_step3.pop("_last_lr"))
    assert restored == at_step3 and restored["_step_count"] == 4


# ---- corruption, RNG, a real Accelerator, a real kill --------------------------------------------------------------
@pytest.mark.parametrize("name", ["optimizer.pt", "adapter_model.safetensors", "rng-rank0.pt"])
def test_a_same_size_corruption_is_caught_by_the_sha256(tmp_path, name):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the size the manifest lists still matches
    (path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        ckpt.read_manifest(path)
    assert f"{name} is corrupt" in str(err.value)
    assert ckpt.read_manifest(path, verify_files=False)["state"]["step"] == 3  # the manifest itself is fine


def test_a_file_the_manifest_lists_but_that_is_gone_is_named(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    (path / "rng-rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="is missing rng-rank0.pt"):
        ckpt.read_manifest(path)


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST)
    assert sorted(manifest["files"]) == on_disk == ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt",
                                                    "rng-rank0.pt"]
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["format_version"] == ckpt.FORMAT_VERSION
    assert manifest["state"] == {"step": 3, "version": 3, "data_position": 12, "run_id": "abcd1234", "backend": "ddp",
                                 "world_size": 1}


def test_python_numpy_and_torch_rng_states_are_all_restored(tmp_path):
    model, optimizer, config = make_model()
    cuda = torch.cuda.is_available()  # on a GPU host the CUDA generators too

    def draw():
        return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(),
                torch.rand(3, device="cuda").tolist() if cuda else None)

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save(model, optimizer, config, tmp_path)
    draws = draw()
    random.seed(11), np.random.seed(12), torch.manual_seed(13)  # anything else
    ckpt.restore_rng(path, rank=0)
    assert draw() == draws


def test_a_rank_the_checkpoint_did_not_have_keeps_its_own_rng(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ckpt.restore_rng(path, rank=1)  # saved by one rank, resumed on two
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == (
        random.seed(5) or random.random(), np.random.seed(5) or float(np.random.rand()),
        torch.manual_seed(5) and torch.rand(1).item())


class _FakeCuda:
    """torch.cuda as a rank sees it whose current device is `device` of `count` visible ones: records the RNG calls."""

    def __init__(self, monkeypatch, device, count=8):
        self.device, self.count, self.got, self.set = device, count, [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.set.append((state, device)))
        for name in ("get_rng_state_all", "set_rng_state_all"):  # every visible device: what a resume cannot match
            monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: pytest.fail(f"torch.cuda.{name} called"))

    def get_rng_state(self, device="cuda"):
        self.got.append(device)
        return self.state_of(device)

    @staticmethod
    def state_of(device: int) -> torch.Tensor:
        return torch.full((16,), device, dtype=torch.uint8)


def test_only_the_cuda_rng_state_of_this_ranks_device_is_saved_and_restored(tmp_path, monkeypatch):
    model, optimizer, config = make_model()
    cuda = _FakeCuda(monkeypatch, device=3)  # rank 3 of a node whose 8 GPUs it sees
    path = save(model, optimizer, config, tmp_path)
    assert cuda.got == [3]
    cuda.device, cuda.count = 0, 1  # resumed with CUDA_VISIBLE_DEVICES per rank: its GPU is device 0 of 1
    ckpt.restore_rng(path, rank=0)
    [(state, device)] = cuda.set
    assert device == 0 and torch.equal(state, _FakeCuda.state_of(3))
    # The file still passes the tensors-only unpickler's rules (one tensor, no new globals).
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path / "rng-rank0.pt"))
    allowed = {name if isinstance(name, str) else f"{name.__module__}.{name.__qualname__}"
               for g in ckpt.SAFE_GLOBALS for name in ((g[1],) if isinstance(g, tuple) else (g,))}
    assert unsafe <= allowed


def _save_all_devices_rng(path, states) -> None:
    """Rewrite rank 0's RNG file as checkpoints before this fix wrote it: CUDA as a list of every device's state."""
    state = torch.load(path / "rng-rank0.pt", weights_only=False)
    torch.save({**state, "cuda": states}, path / "rng-rank0.pt")
    _list(path, "rng-rank0.pt")


# (1, 1, 0) and (2, 2, None): a device just past the list's end takes a lone entry, or warns
@pytest.mark.parametrize(("saved", "device", "expected"), [(8, 3, 3), (1, 5, 0), (2, 5, None), (1, 1, 0), (2, 2, None)])
def test_an_old_checkpoint_with_every_devices_cuda_rng_restores_this_devices_entry_or_warns(
        tmp_path, monkeypatch, caplog, saved, device, expected):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    _save_all_devices_rng(path, [_FakeCuda.state_of(d) for d in range(saved)])
    cuda = _FakeCuda(monkeypatch, device=device)
    ckpt.restore_rng(path, rank=0)
    if expected is None:  # the list does not reach this device and has several: no way to tell which was this rank's
        assert cuda.set == []
        assert f"CUDA RNG states cover {saved} devices, not this rank's device {device}" in caplog.text
    else:
        [(state, at)] = cuda.set
        assert at == device and torch.equal(state, _FakeCuda.state_of(expected))


def test_round_trip_through_a_real_single_process_accelerator(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    acc = Accelerator(cpu=True)
    try:
        model, optimizer, config = make_model()
        model, optimizer = acc.prepare(model, optimizer)
        train_one_step(model, optimizer)
        state = ckpt.TrainerState(step=4, version=2, data_position=37, run_id="r1", backend=ckpt.backend_of(acc),
                                  world_size=acc.num_processes)
        path = ckpt.save_checkpoint(acc, model, optimizer, state, output_dir=tmp_path, peft_config=config,
                                    base_model="tiny")
        expected = lora_state(acc.unwrap_model(model))

        fresh, fresh_optimizer, _ = make_model(seed=1)  # other LoRA weights, no optimizer state
        fresh, fresh_optimizer = acc.prepare(fresh, fresh_optimizer)
        loaded = ckpt.load_checkpoint(ckpt.resolve_checkpoint("latest", tmp_path), acc, fresh, fresh_optimizer)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert path == tmp_path / "checkpoint-4"
    assert (loaded.step, loaded.version, loaded.data_position, loaded.backend, loaded.world_size) == (4, 2, 37, "ddp", 1)
    got = lora_state(fresh)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert len(fresh_optimizer.state_dict()["state"]) == len(expected)  # Adam moments of every LoRA tensor


def test_a_checkpoint_of_another_layout_is_refused_with_both_named(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["state"].update(backend="fsdp2", world_size=2)  # as an FSDP2 run of two ranks writes it
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, *make_model()[:2])
    assert "fsdp2 run of 2 ranks" in str(err.value) and "ddp on 1" in str(err.value)


def _save_half_then_block(out, ready) -> None:
    """In a forked child: save checkpoint-6, but stop in the middle of the optimizer file and wait to be killed."""
    real_write = ckpt._write_file

    def half_then_block(path, write):
        if path.name == ckpt.OPTIMIZER:
            with open(path, "wb") as f:
                f.write(b"half of an optimizer")
                f.flush()
            ready.set()
            threading.Event().wait()  # until SIGKILL
        real_write(path, write)

    ckpt._write_file = half_then_block
    model, optimizer, config = make_model()
    save(model, optimizer, config, out, step=6)


def test_a_save_killed_by_sigkill_leaves_the_previous_checkpoint_as_latest(tmp_path):
    """A real kill: a child process (forked, so it runs this very code) saves checkpoint-6 and is SIGKILLed while
    writing the optimizer state."""
    model, optimizer, config = make_model()
    save(model, optimizer, config, tmp_path, step=3)
    killed_midway(_save_half_then_block, (tmp_path,), "the save")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3]
    assert ckpt.resolve_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-3"
    partial = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-checkpoint-6-")]
    assert len(partial) == 1
    assert [p.name for p in ckpt.clean_partial(tmp_path)] == partial
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    ckpt.read_manifest(tmp_path / "checkpoint-3")  # untouched by the killed save


def test_a_save_creates_output_dir_records_the_base_model_and_replaces_the_same_step(tmp_path):
    model, optimizer, config = make_model()
    out = tmp_path / "runs" / "new"  # does not exist yet
    path = save(model, optimizer, config, out, step=3)
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    (path / "stale-file").write_text("from the first save")
    train_one_step(model, optimizer)
    again = save(model, optimizer, config, out, step=3)  # a resumed run reaching step 3 again
    assert again == path and not (path / "stale-file").exists()
    ckpt.read_manifest(path)


# ---- what each refusal tells the user: the path, the cause and the fix ---------------------------------------------
def test_latest_without_a_checkpoint_names_the_output_dir_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint("latest", tmp_path / "run")
    assert str(err.value) == (f"resume_from_checkpoint is `latest` but {str(tmp_path / 'run')!r} holds no "
                              f"checkpoint-<step> directory. Fix: drop --resume_from_checkpoint to start a fresh run, "
                              f"or set output_dir to the run you want to continue")


def test_a_resume_path_that_is_not_a_directory_is_named_with_the_fix(tmp_path):
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(str(tmp_path / "nope"), tmp_path)
    assert str(err.value) == (f"resume_from_checkpoint {str(tmp_path / 'nope')!r} is not a directory. Fix: pass a "
                              f"<output_dir>/checkpoint-<step> directory, or `latest`")


def _fix(path) -> str:
    return (f"Fix: delete {str(path)!r} and resume from an earlier checkpoint-<step> directory "
            f"(`--resume_from_checkpoint PATH`), or start a fresh run")


def test_every_manifest_refusal_names_the_checkpoint_and_the_fix(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest_text = (path / ckpt.MANIFEST).read_text()

    def refusal() -> str:
        with pytest.raises(CheckpointError) as err:
            ckpt.read_manifest(path)
        return str(err.value)

    (path / ckpt.MANIFEST).write_text(manifest_text[:-10])  # cut short: not JSON any more
    message = refusal()
    assert message.startswith(f"checkpoint {str(path)!r} has an unreadable manifest.json (") and message.endswith(
        f"). {_fix(path)}")
    (path / ckpt.MANIFEST).write_text(json.dumps({"format_version": 1, "files": {}}))  # no state
    assert refusal() == f"checkpoint {str(path)!r} has an unreadable manifest.json ('state'). {_fix(path)}"
    manifest = json.loads(manifest_text)
    (path / ckpt.MANIFEST).write_text(json.dumps({**manifest, "format_version": 3}))
    assert refusal() == (f"checkpoint {str(path)!r} has format version 3; this asyncgrpo reads versions 1, 2. Fix: "
                         f"resume with the asyncgrpo version that wrote it")
    (path / ckpt.MANIFEST).write_text(manifest_text)
    size = manifest["files"]["rng-rank0.pt"]["bytes"]
    (path / "rng-rank0.pt").write_bytes(b"x" * (size + 1))
    assert refusal() == (f"checkpoint {str(path)!r}: rng-rank0.pt is corrupt ({size + 1} bytes, the manifest says "
                         f"{size}, or its sha256 differs). {_fix(path)}")
    (path / "rng-rank0.pt").unlink()
    assert refusal() == f"checkpoint {str(path)!r} is missing rng-rank0.pt. {_fix(path)}"
    (path / ckpt.MANIFEST).unlink()
    assert refusal() == (f"checkpoint {str(path)!r} is incomplete: it has no manifest.json (a save that did not "
                         f"finish, or not an asyncgrpo checkpoint). {_fix(path)}")


def test_an_adapter_that_does_not_fit_names_the_checkpoint_and_its_config(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    other = get_peft_model(Tiny(8, 8), LoraConfig(r=2, target_modules=["q_proj"]))  # v_proj has no LoRA here
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]))
    assert str(err.value) == (f"the adapter in {str(path)!r} does not fit this model (different lora_r, "
                              f"lora_target_modules or base model). Fix: resume with the config the checkpoint was "
                              f"saved with ({str(tmp_path / 'config.yaml')!r})")


def test_another_layout_names_the_checkpoint_both_runs_and_the_fix(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["state"].update(backend="zero3", world_size=4)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, *make_model()[:2])
    assert str(err.value) == (f"{str(path)!r} was saved by a zero3 run of 4 ranks and this run uses ddp on 1. Fix: "
                              f"resume with the launch config the checkpoint was saved with (DDP, FSDP and ZeRO "
                              f"checkpoints do not mix; FSDP1 and FSDP2 do, on any number of ranks; ZeRO needs the "
                              f"same stage and number of ranks)")


def test_an_unsupported_backend_names_the_supported_ones_and_the_fix():
    with pytest.raises(CheckpointError) as err:
        ckpt.check_backend("megatron")
    assert str(err.value) == ("checkpoints (save_steps, resume_from_checkpoint) support DDP, FSDP1, FSDP2, ZeRO-2 and "
                              "ZeRO-3, and this run uses megatron. Fix: launch with one of the configs in "
                              "launch/accelerate/, or set save_steps: 0 and unset resume_from_checkpoint")


def test_a_stale_temporary_directory_of_the_same_name_is_replaced_not_merged(tmp_path):
    """A killed save of this step by a process with this pid (pids are reused) left its temporary directory."""
    stale = tmp_path / f".tmp-checkpoint-3-{os.getpid()}"
    stale.mkdir()
    (stale / "optimizer.pt").write_bytes(b"half")
    (stale / "leftover").write_bytes(b"from the killed save")
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    assert not stale.exists() and not (path / "leftover").exists()
    ckpt.read_manifest(path)


# ---- only listed, unmodified files are loaded; a same-step save sets the old one aside -----------------------------
class _RunsCode:
    def __reduce__(self):
        return print, ("never printed",)


def _list(path, name) -> None:
    data = (path / name).read_bytes()
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_a_listed_file_holding_other_objects_is_refused_with_the_file_and_the_fix(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    torch.save(_RunsCode(), path / "rng-rank0.pt")
    _list(path, "rng-rank0.pt")
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_rng(path, rank=0)
    message = str(err.value)
    assert message == (f"checkpoint {str(path)!r}: rng-rank0.pt holds objects a checkpoint never saves, so it is not "
                       f"loaded (Unsupported global: GLOBAL print was not an allowed global by default). Fix: resume only from checkpoints written by asyncgrpo on storage no one else can "
                       f"write; delete {str(path)!r} and resume from an earlier checkpoint-<step> directory, or "
                       f"start a fresh run")


class _RunsOtherCode:
    def __reduce__(self):
        return len, ("never counted",)


def test_deepspeed_refusals_name_the_checkpoint_in_the_fix_and_every_object_apart(tmp_path):
    """What DeepSpeed would unpickle in full is checked first (read, not run): no engine is needed to be refused."""
    path = tmp_path / "checkpoint-2"
    name = "deepspeed/state/mp_rank_00_model_states.pt"
    (path / name).parent.mkdir(parents=True)
    torch.save({"module": _RunsCode(), "optimizer": _RunsOtherCode()}, path / name)
    with pytest.raises(CheckpointError) as err:
        ckpt._check_deepspeed_files(path, {"files": {}})
    assert str(err.value) == (f"checkpoint {str(path)!r}: {name} is not listed in its manifest.json (added after the "
                              f"save, or the manifest was edited), so it is not loaded. {_fix(path)}")
    with pytest.raises(CheckpointError) as err:
        ckpt._check_deepspeed_files(path, {"files": {name: {}}})  # listed: its names are read next
    assert str(err.value) == (f"checkpoint {str(path)!r}: {name} holds objects a DeepSpeed checkpoint never saves "
                              f"(builtins.len, builtins.print), so it is not loaded. Fix: resume only from "
                              f"checkpoints written by asyncgrpo on storage no one else can write; delete "
                              f"{str(path)!r} and resume from an earlier checkpoint-<step> directory, or start a "
                              f"fresh run")


def test_an_unlisted_file_is_refused_by_name_and_a_listed_one_must_match(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    manifest = ckpt.read_manifest(path)
    with pytest.raises(CheckpointError) as err:
        ckpt._open_listed(path, manifest, "scheduler.pt")
    assert str(err.value) == (f"checkpoint {str(path)!r}: scheduler.pt is not listed in its manifest.json (added after "
                              f"the save, or the manifest was edited), so it is not loaded. {_fix(path)}")
    size = manifest["files"]["optimizer.pt"]["bytes"]
    (path / "optimizer.pt").write_bytes(b"y" * size)  # same size, other bytes: only the sha256 tells
    with pytest.raises(CheckpointError) as err:
        ckpt._open_listed(path, manifest, "optimizer.pt")
    assert str(err.value) == (f"checkpoint {str(path)!r}: optimizer.pt is corrupt ({size} bytes, the manifest says "
                              f"{size}, or its sha256 differs). {_fix(path)}")
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError) as err:
        ckpt._open_listed(path, manifest, "optimizer.pt")
    assert str(err.value) == f"checkpoint {str(path)!r} is missing optimizer.pt. {_fix(path)}"
    with ckpt._open_listed(path, manifest, "rng-rank0.pt") as f:  # a good one: opened at its start
        assert f.tell() == 0 and f.read() == (path / "rng-rank0.pt").read_bytes()


def test_a_listed_file_larger_than_one_hash_chunk_is_checked_whole(tmp_path):
    # A real model's optimizer state is many MiB: the size and digest add up over every chunk, not the last one.
    from asyncgrpo.files import HASH_CHUNK

    data = os.urandom(2 * HASH_CHUNK + 7)
    (tmp_path / "optimizer.pt").write_bytes(data)
    manifest = {"files": {"optimizer.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    with ckpt._open_listed(tmp_path, manifest, "optimizer.pt") as f:
        assert f.read() == data
    manifest["files"]["optimizer.pt"]["bytes"] = 7  # what counting only the last chunk would give
    with pytest.raises(CheckpointError, match=f"corrupt .{len(data)} bytes, the manifest says 7"):
        ckpt._open_listed(tmp_path, manifest, "optimizer.pt")


def test_a_manifest_listing_a_path_outside_the_checkpoint_is_refused(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    for outside in ("../config.yaml", "/etc/hostname"):
        manifest = json.loads((path / ckpt.MANIFEST).read_text())
        manifest["files"] = {outside: {"bytes": 1, "sha256": "0" * 64}, **manifest["files"]}
        (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError) as err:
            ckpt.read_manifest(path, verify_files=False)
        assert str(err.value) == (f"checkpoint {str(path)!r} has a manifest.json that lists {outside!r}, a file "
                                  f"outside the checkpoint. {_fix(path)}")
        del manifest["files"][outside]
        (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.read_manifest(path)["state"]["step"] == 3


def test_the_rng_state_needs_only_the_numpy_types_allowed(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path / "rng-rank0.pt"))
    allowed = {name if isinstance(name, str) else f"{name.__module__}.{name.__qualname__}"
               for g in ckpt.SAFE_GLOBALS for name in ((g[1],) if isinstance(g, tuple) else (g,))}
    assert unsafe and unsafe <= allowed
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path / "optimizer.pt") == []


def test_a_same_step_save_sets_the_old_one_aside_and_deletes_it_once_the_new_one_is_in(tmp_path, monkeypatch):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(ckpt.os, "rename", lambda src, dst: renames.append((src.name, dst.name)) or
                        real_rename(src, dst))
    save(model, optimizer, config, tmp_path)
    aside = f".old-checkpoint-3-{os.getpid()}"
    assert renames[-2:] == [("checkpoint-3", aside), (f".tmp-checkpoint-3-{os.getpid()}", "checkpoint-3")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"] and path.is_dir()


def test_a_failed_rename_brings_the_set_aside_checkpoint_back(tmp_path, monkeypatch):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    (path / "marker").write_text("the first save")
    real_rename = os.rename

    def fails_into_place(src, dst):
        if dst == path and src.name.startswith(".tmp-"):  # the new one; the old one's way back works
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", fails_into_place)
    with pytest.raises(KeyboardInterrupt):
        save(model, optimizer, config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    assert (path / "marker").read_text() == "the first save"


def test_a_first_saves_failed_rename_raises_its_own_error_and_leaves_nothing(tmp_path, monkeypatch):
    """No older checkpoint of the step was set aside: nothing is renamed back, and the rename's error is the one seen."""
    model, optimizer, config = make_model()
    real_rename = os.rename

    def fails_into_place(src, dst):
        if dst == tmp_path / "checkpoint-3" and src.name.startswith(".tmp-checkpoint-"):
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", fails_into_place)
    with pytest.raises(OSError) as err:
        save(model, optimizer, config, tmp_path)
    assert err.value.errno == errno.EIO and err.value.__context__ is None
    assert list(tmp_path.iterdir()) == []


def test_an_error_after_the_rename_into_place_is_raised_as_itself(tmp_path, monkeypatch):
    """The directory's fsync fails once the new checkpoint has its name (a stub: a failing disk is not at hand): the
    temporary directory is gone by then, and the cleanup must not replace the fsync's error with its own."""
    model, optimizer, config = make_model()
    real_fsync, final = ckpt.fsync_path, tmp_path / "checkpoint-3"

    def fails_once_in_place(path):
        if path == tmp_path and final.exists():
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(path)

    monkeypatch.setattr(ckpt, "fsync_path", fails_once_in_place)
    with pytest.raises(OSError) as err:
        save(model, optimizer, config, tmp_path)
    assert err.value.errno == errno.EIO and err.value.__context__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    assert ckpt.read_manifest(final)["state"]["step"] == 3  # renamed in whole before the error


def test_a_set_aside_checkpoint_that_cannot_be_deleted_does_not_fail_the_save(tmp_path, monkeypatch):
    """The new checkpoint is in place: the old one left behind is removed at the next start (`clean_partial`). The
    deletion fails as the OS refuses one file (a read-only directory would, except for root, whom tests may run as)."""
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path)
    (path / "stuck").write_text("the first save")
    real_unlink = os.unlink

    def refuses_stuck(name, *args, **kwargs):
        if os.path.basename(name) == "stuck":
            raise PermissionError(errno.EACCES, "Permission denied", name)
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuses_stuck)
    assert save(model, optimizer, config, tmp_path) == path
    aside = tmp_path / f".old-checkpoint-3-{os.getpid()}"
    assert (aside / "stuck").is_file() and not (path / "stuck").exists()
    ckpt.read_manifest(path)
    monkeypatch.undo()
    assert ckpt.clean_partial(tmp_path) == [aside]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_set_aside_checkpoints_are_restored_when_missing_and_removed_when_replaced(tmp_path):
    for name in (".old-checkpoint-3-11", ".old-checkpoint-5-12", "checkpoint-5", ".old-checkpoint-x-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "from").write_text(name)
    (tmp_path / ".old-checkpoint-7-13").write_text("a file, not a checkpoint")
    (tmp_path / ".cache").mkdir()  # anything else there, sorting before the set-aside ones, is passed over
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5]  # an aside is not a checkpoint
    assert ckpt.restore_set_aside(tmp_path) == [tmp_path / ".old-checkpoint-5-12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache", ".old-checkpoint-7-13", ".old-checkpoint-x-1",
                                                          "checkpoint-3", "checkpoint-5"]
    assert (tmp_path / "checkpoint-3" / "from").read_text() == ".old-checkpoint-3-11"
    assert (tmp_path / "checkpoint-5" / "from").read_text() == "checkpoint-5"  # the newer one kept
    assert ckpt.restore_set_aside(tmp_path / "missing") == []


def test_resolving_restores_a_set_aside_checkpoint_first(tmp_path):
    model, optimizer, config = make_model()
    path = save(model, optimizer, config, tmp_path, step=4)
    os.rename(path, tmp_path / ".old-checkpoint-4-99")  # killed between the two renames
    assert ckpt.resolve_checkpoint("latest", tmp_path) == path
    assert ckpt.read_manifest(path)["state"]["step"] == 4


def test_another_rank_restoring_first_is_not_an_error(tmp_path, monkeypatch):
    (tmp_path / ".old-checkpoint-2-5").mkdir()
    real_rename = os.rename

    def another_rank_was_first(src, dst):
        real_rename(src, dst)  # done by the other rank...
        raise FileNotFoundError(2, "No such file or directory")  # ...so this one finds no source

    monkeypatch.setattr(ckpt.os, "rename", another_rank_was_first)
    ckpt.restore_set_aside(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    (tmp_path / "checkpoint-2").rmdir()
    (tmp_path / ".old-checkpoint-2-5").mkdir()
    monkeypatch.setattr(ckpt.os, "rename", lambda src, dst: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(PermissionError):  # nothing restored it: the error is the user's to see
        ckpt.restore_set_aside(tmp_path)


def test_clean_partial_returns_removed_asides_then_temporaries(tmp_path):
    for name in ("checkpoint-2", ".old-checkpoint-2-1", ".old-checkpoint-4-1", ".tmp-checkpoint-6-1"):
        (tmp_path / name).mkdir()
    (tmp_path / ".tmp-checkpoint-8-1").write_text("a file")
    assert [p.name for p in ckpt.clean_partial(tmp_path)] == [".old-checkpoint-2-1", ".tmp-checkpoint-6-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-checkpoint-8-1", "checkpoint-2", "checkpoint-4"]
    assert ckpt.clean_partial(tmp_path / "missing") == []


# ---- the layout TRL's users expect, and the one before it ----------------------------------------------------------
def test_a_checkpoint_loads_with_peft_directly_as_a_trl_checkpoint_does(tmp_path):
    from peft import PeftModel

    model, optimizer, config = make_model()
    train_one_step(model, optimizer)
    path = save(model, optimizer, config, tmp_path)
    torch.manual_seed(0)  # tiny_lora's base for seed 0, without any adapter
    loaded = PeftModel.from_pretrained(Tiny(8, 8), str(path))
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), model(x))  # the trained adapter, not an untrained or default one
    with loaded.disable_adapter():
        assert not torch.allclose(loaded(x), model(x), atol=1e-3)  # ... whose effect is not nil


def as_format_1(path):
    """Rewrite a checkpoint as asyncgrpo wrote it before format 2: the adapter in `adapter/` (the store's writer,
    with its own manifest), and the checkpoint's manifest listing it there."""
    from asyncgrpo.store import CONFIG_NAME, WEIGHTS_NAME, write_manifest

    (path / "adapter").mkdir()
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        os.rename(path / name, path / "adapter" / name)
    write_manifest(path / "adapter", [WEIGHTS_NAME, CONFIG_NAME])
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST)
    manifest.update(format_version=1, files={str(p.relative_to(path)): {
        "bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files})
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_format_before_still_resumes_exactly(tmp_path):
    model, optimizer, config = make_model()
    train_one_step(model, optimizer)
    path = save(model, optimizer, config, tmp_path)
    as_format_1(path)
    fresh, fresh_optimizer, _ = make_model()
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(1.0)  # the LoRA moved away from the checkpoint's
    state = ckpt.load_checkpoint(path, ACC, fresh, fresh_optimizer)
    assert state.step == 3 and all(torch.equal(a, b) for a, b in zip(lora_state(model).values(),
                                                                     lora_state(fresh).values()))
    (path / "adapter" / "adapter_model.safetensors").write_bytes(b"x" * 10)  # still checked where it is
    with pytest.raises(CheckpointError, match="adapter/adapter_model.safetensors is corrupt"):
        ckpt.load_checkpoint(path, ACC, fresh, fresh_optimizer)


def test_rank_0_s_texts_go_into_the_checkpoint_listed_and_trainer_state_reads_back_checked(tmp_path):
    model, optimizer, config = make_model()
    state = ckpt.TrainerState(step=3, version=3, data_position=12, run_id="abcd1234")

    def texts(final):  # the final path, not the temporary one: the card names where the adapter will be
        return {ckpt.TRAINER_STATE: json.dumps({"global_step": 3, "log_history": [{"loss": 0.5, "step": 3}]}),
                "README.md": f"card of {final}"}

    path = ckpt.save_checkpoint(ACC, model, optimizer, state, output_dir=tmp_path, peft_config=config,
                                base_model="tiny", texts=texts)
    assert {ckpt.TRAINER_STATE, "README.md"} <= set(ckpt.read_manifest(path)["files"])
    assert (path / "README.md").read_text() == f"card of {tmp_path / 'checkpoint-3'}"
    assert ckpt.read_trainer_state(path) == {"global_step": 3, "log_history": [{"loss": 0.5, "step": 3}]}
    (path / ckpt.TRAINER_STATE).write_text(json.dumps({"global_step": 9, "log_history": []}))
    with pytest.raises(CheckpointError, match="trainer_state.json is corrupt"):
        ckpt.read_trainer_state(path)
    assert ckpt.read_trainer_state(save(model, optimizer, config, tmp_path / "plain")) is None  # none written
