"""Attacks on checkpoints and on the adapter directory's leftovers (issue #25, item 3).

A checkpoint file swapped for a pickle that would run code is refused before any of it runs, whether or not the
manifest was rewritten to match; a file the manifest does not list is never loaded; a save that fails or is killed at
any point leaves one complete checkpoint and no temporary directory; the leftover cleaner leaves another host's
writer alone until its directory is a day old. Everything is local: tiny LoRA models, one process, tmp_path.
"""

import hashlib
import json
import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from models import tiny_lora

from asyncgrpo.errors import CheckpointError
from asyncgrpo.store import OTHER_HOST_TMP_AGE_S, AdapterStore, clean_stale_temporaries, host_name
from asyncgrpo.trainer import checkpoint as ckpt

ACC = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1, distributed_type=DistributedType.NO,
                      wait_for_everyone=lambda: None, unwrap_model=lambda m: m)


class CreatesFile:
    """Unpickled by a full unpickler, this calls open(target, "w"): the file appears. Any code could run instead."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


def make_model(seed=0):
    model = tiny_lora(8, 8, r=2, seed=seed)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def save(out, step=3, seed=0):
    model, optimizer = make_model(seed)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    state = ckpt.TrainerState(step=step, version=seed, data_position=4 * step, run_id=f"run{seed}")
    return ckpt.save_checkpoint(ACC, model, optimizer, state, output_dir=out, peft_config=model.peft_config["default"],
                                base_model="tiny")


def plant(path, name, marker, *, list_it: bool, payload=CreatesFile) -> None:
    """Write the payload as `path/name`; with `list_it`, also record its size and sha256 in the manifest, as an
    attacker who can write the checkpoint directory would."""
    torch.save(payload(marker), path / name)
    if list_it:
        data = (path / name).read_bytes()
        manifest = json.loads((path / ckpt.MANIFEST).read_text())
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_the_payload_runs_code_when_fully_unpickled(tmp_path):
    """The control: the payload these tests plant does create its file when unpickled without restriction."""
    marker = tmp_path / "pwned"
    torch.save(CreatesFile(marker), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("list_it", [True, False], ids=["manifest-rewritten", "manifest-untouched"])
def test_a_pickle_payload_as_the_rng_state_is_refused_and_never_runs(tmp_path, list_it):
    path, marker = save(tmp_path / "out"), tmp_path / "pwned"
    plant(path, "rng-rank0.pt", marker, list_it=list_it)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_rng(path, rank=0)
    # rewritten: the sha256 matches and torch's tensors-only unpickler refuses it; untouched: the sha256 does not
    expected = "rng-rank0.pt holds objects a checkpoint never saves" if list_it else "rng-rank0.pt is corrupt"
    assert f"checkpoint {str(path)!r}: {expected}" in str(err.value) and "Fix:" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("list_it", [True, False], ids=["manifest-rewritten", "manifest-untouched"])
def test_a_pickle_payload_as_the_optimizer_state_is_refused_and_never_runs(tmp_path, list_it):
    path, marker = save(tmp_path / "out"), tmp_path / "pwned"
    plant(path, ckpt.OPTIMIZER, marker, list_it=list_it)
    model, optimizer = make_model(seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, model, optimizer)
    expected = "optimizer.pt holds objects a checkpoint never saves" if list_it else "optimizer.pt is corrupt"
    assert f"checkpoint {str(path)!r}: {expected}" in str(err.value)
    assert not marker.exists()
    assert not optimizer.state  # nothing half-loaded into the optimizer
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_" not in n)


def test_a_payload_is_refused_even_where_torch_is_told_to_unpickle_in_full(tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (set for some other library's old files) turns on torch's full unpickler for
    every torch.load that does not ask for the tensors-only one itself: a checkpoint's files must ask."""
    path, marker = save(tmp_path / "out"), tmp_path / "pwned"
    plant(path, "rng-rank0.pt", marker, list_it=True)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_rng(path, rank=0)
    assert f"checkpoint {str(path)!r}: rng-rank0.pt holds objects a checkpoint never saves" in str(err.value)
    assert not marker.exists()


class MakesDirectory:
    """A payload calling into `os` (posix), a module torch's tensors-only unpickler blocks outright: torch's message
    then has no `WeightsUnpickler error:` line to quote."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return os.mkdir, (self.target,)


def test_a_payload_calling_a_blocked_module_is_refused_with_a_reason(tmp_path):
    path, marker = save(tmp_path / "out"), tmp_path / "pwned"
    plant(path, "rng-rank0.pt", marker, list_it=True, payload=MakesDirectory)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_rng(path, rank=0)
    message = str(err.value)
    head = f"checkpoint {str(path)!r}: rng-rank0.pt holds objects a checkpoint never saves, so it is not loaded ("
    assert message.startswith(head) and "). Fix: resume only from checkpoints written by asyncgrpo" in message
    reason = message[len(head):message.index("). Fix: ")]
    # torch's line naming the global, not its first line (the advice to load with weights_only=False)
    assert reason == "Trying to load unsupported GLOBAL posix.mkdir whose module posix is blocked", reason
    assert not marker.exists()


def test_unlisted_files_are_never_loaded(tmp_path):
    path, marker = save(tmp_path / "out"), tmp_path / "pwned"
    # A scheduler state and a second rank's RNG state the save never wrote, and a file nothing reads by name.
    for name in (ckpt.SCHEDULER, "rng-rank1.pt", "extra.pt"):
        plant(path, name, marker, list_it=False)
    model, optimizer = make_model(seed=1)
    ckpt.load_checkpoint(path, ACC, model, optimizer)  # no scheduler asked for: extra.pt and scheduler.pt unread
    assert not marker.exists()
    model, optimizer = make_model(seed=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, ACC, model, optimizer, lr_scheduler=scheduler)
    assert f"checkpoint {str(path)!r}: scheduler.pt is not listed in its manifest.json" in str(err.value)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_rng(path, rank=1)
    assert f"checkpoint {str(path)!r}: rng-rank1.pt is not listed in its manifest.json" in str(err.value)
    assert not marker.exists()


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = save(tmp_path / "out")
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"lists '\.\./\.\./etc/passwd', a file outside the checkpoint"):
        ckpt.load_checkpoint(path, ACC, *make_model())


@pytest.mark.parametrize("fails_at", [ckpt.OPTIMIZER, ckpt.MANIFEST])
def test_a_save_that_fails_midway_leaves_no_temporary_directory(tmp_path, monkeypatch, fails_at):
    out = tmp_path / "out"
    real_write = ckpt._write_file

    def disk_full(path, write):
        if path.name == fails_at:
            path.write_bytes(b"half")
            raise OSError(28, "No space left on device")
        real_write(path, write)

    monkeypatch.setattr(ckpt, "_write_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save(out)
    assert list(out.iterdir()) == []


def _adapter_weights(path) -> bytes:
    return (path / "adapter_model.safetensors").read_bytes()


def test_a_same_step_resave_whose_rename_fails_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "out"
    old = save(out, seed=0)
    old_weights = _adapter_weights(old)
    real_rename = os.rename

    def fails_on_the_new_one(src, dst):
        if str(dst) == str(old) and ".tmp-checkpoint-" in str(src):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", fails_on_the_new_one)
    with pytest.raises(OSError, match="Input/output"):
        save(out, seed=1)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]  # no temporary, nothing set aside
    assert ckpt.resolve_checkpoint("latest", out) == old
    assert ckpt.read_manifest(old)["state"]["run_id"] == "run0" and _adapter_weights(old) == old_weights


def _crash_in_commit(out, point, ready) -> None:
    """In a forked child: re-save checkpoint-3 and SIGKILL this process at `point` of the replacement."""
    real_rename, real_rmtree = os.rename, ckpt.shutil.rmtree
    final = ckpt.checkpoint_path(out, 3)

    def die():
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)

    def rename(src, dst):
        if point == "before-aside" and str(src) == str(final) or point == "between" and str(dst) == str(final):
            die()
        real_rename(src, dst)

    def rmtree(path, *args, **kwargs):
        if point == "before-delete" and os.path.basename(path).startswith(".old-") and os.path.exists(path):
            die()
        real_rmtree(path, *args, **kwargs)

    os.rename, ckpt.shutil.rmtree = rename, rmtree  # a forked child: no undo needed
    save(out, seed=1)


@pytest.mark.parametrize("point,survivor", [("before-aside", "run0"), ("between", "run0"),
                                            ("before-delete", "run1")])
def test_a_same_step_resave_killed_at_any_point_leaves_one_complete_checkpoint(tmp_path, point, survivor):
    out = tmp_path / "out"
    save(out, seed=0)
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=_crash_in_commit, args=(out, point, ready), daemon=True)
    child.start()
    child.join(60)
    assert ready.is_set() and child.exitcode == -signal.SIGKILL
    if point == "between":  # the old one is set aside and the new one not yet in: no checkpoint-3 for a moment
        assert ckpt.list_checkpoints(out) == [] and any(p.name.startswith(".old-checkpoint-3-") for p in out.iterdir())
    path = ckpt.resolve_checkpoint("latest", out)  # what every rank of the resuming run does first
    assert path == out / "checkpoint-3"
    assert ckpt.read_manifest(path)["state"]["run_id"] == survivor  # complete: every file matches the manifest
    ckpt.clean_partial(out)  # rank 0 at start
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]


def _age(path, seconds) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_cleaner_leaves_another_hosts_fresh_writer_alone_and_removes_an_old_one(tmp_path):
    other = "other-node-7" if host_name() != "other-node-7" else "other-node-8"
    fresh = tmp_path / "run-a" / f".tmp-v000002-{other}-{os.getpid()}"  # its pid means nothing on this host
    old = tmp_path / "run-b" / f".tmp-v000005-{other}-{os.getpid()}"
    almost = tmp_path / "run-b" / f".tmp-v000006-{other}-1"
    for d in (fresh, old, almost):
        d.mkdir(parents=True)
    _age(fresh, 60)  # a writer on the other host, a minute into a slow write
    _age(old, OTHER_HOST_TMP_AGE_S + 60)
    _age(almost, OTHER_HOST_TMP_AGE_S - 60)
    assert clean_stale_temporaries(tmp_path) == [old]
    assert fresh.exists() and almost.exists() and not old.exists()
    # A store opened on the other host's run directory leaves its fresh writer alone too.
    AdapterStore(tmp_path / "run-a")
    assert fresh.exists()
