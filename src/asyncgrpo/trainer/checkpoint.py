"""Checkpoints: an atomic save every `save_steps` optimizer steps, and resuming with `resume_from_checkpoint`.

A checkpoint is `<output_dir>/checkpoint-<step>/`: the adapter's PEFT files at its top (as TRL leaves them), the
optimizer state (or DeepSpeed's own partitioned checkpoint), the schedule, every rank's RNG states, rank 0's extra
files (trainer_state.json, README.md) and, written last, a manifest of every file's size and sha256.
It is written in a temporary directory and renamed into place (a checkpoint of the same step is set aside first);
only files the manifest lists, with the size and sha256 it records, are loaded, by torch's tensors-only unpickler.
Backends: DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3. docs/trainer-internals.md: the layout and each backend's optimizer
state; docs/checkpoints.md: the user's view.
"""

from __future__ import annotations

import contextlib
import copyreg
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import safetensors.torch

from asyncgrpo.config import AsyncSettings, CheckpointSettings, OutputSettings, TrainingSettings
from asyncgrpo.distributed import broadcast_object
from asyncgrpo.errors import CheckpointError
from asyncgrpo.files import HASH_CHUNK, fsync_path, sha256_file
from asyncgrpo.store import WEIGHTS_NAME, export_adapter
from asyncgrpo.trainer.gather import backend_of, clean_fsdp_name, gather_lora_state, lora_parameters
from asyncgrpo.trainer.schedule import restore_lr_scheduler

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the adapter's files at the checkpoint's top; 1: in `adapter/` (still resumed from)
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
LEGACY_ADAPTER_DIR = "adapter"  # format 1's place for the adapter
TRAINER_STATE = "trainer_state.json"  # transformers' TrainerState as TRL's checkpoints hold it (rank 0 writes it)
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SHARDED = ("fsdp1", "fsdp2")  # optimizer state and LoRA weights go through torch's distributed state-dict API
DEEPSPEED = ("zero2", "zero3")  # the engine writes and reads its own partitioned checkpoint
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "state"
SUPPORTED_BACKENDS = ("ddp", *SHARDED, *DEEPSPEED)
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = ".tmp-checkpoint-"  # + `<step>-<pid>`: a save in progress, or one that was killed
_ASIDE_DIR = re.compile(r"^\.old-checkpoint-(\d+)-\d+$")  # a same-step checkpoint being replaced
try:  # numpy 2 moved the function its arrays are unpickled with; a checkpoint saved under numpy 1 names the old place
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct
# What torch's tensors-only unpickler must accept besides tensors and plain values: numpy's RNG state (`rng_state`)
# is a tuple holding a uint32 array. Optimizer and scheduler states need nothing more.
SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (_reconstruct, "numpy._core.multiarray._reconstruct"),
                (_reconstruct, "numpy.core.multiarray._reconstruct")]
# DeepSpeed unpickles its own files without torch's tensors-only unpickler. Before it reads them, each one's names
# are read (not run) and must be torch's safe ones or these: the loss scaler, ZeRO's stage and its fragment records.
DEEPSPEED_GLOBALS = frozenset({"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                               "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                               "deepspeed.runtime.zero.config.ZeroStageEnum",
                               "deepspeed.utils.tensor_fragment.fragment_address"})


@dataclass
class TrainerState:
    """What the trainer needs besides tensors to continue exactly where a checkpoint was taken."""

    step: int  # optimizer steps done
    version: int  # policy version the trainer's weights were published as
    data_position: int  # rank 0's PromptStream position: the next prompt a resumed producer sends
    run_id: str  # the run that wrote it (its adapters may still be loaded on the servers)
    backend: str = "ddp"
    world_size: int = 1


# ---- finding checkpoints -----------------------------------------------------------------------------------------
def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """`checkpoint-<step>` directories in `output_dir`, oldest step first (temporary directories are not listed)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def resolve_checkpoint(resume: str, output_dir: str | Path) -> Path:
    """`latest` -> the newest checkpoint in `output_dir`; anything else is a checkpoint directory's path.
    Like TRL, `latest` with no checkpoint is an error, not a silent fresh start. A checkpoint a replacement set aside
    and did not bring back is restored first (`restore_set_aside`)."""
    restore_set_aside(output_dir)
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"resume_from_checkpoint is `latest` but {str(output_dir)!r} holds no "
                                  f"checkpoint-<step> directory. Fix: drop --resume_from_checkpoint to start a fresh "
                                  f"run, or set output_dir to the run you want to continue")
        return found[-1][1]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint {resume!r} is not a directory. Fix: pass a "
                              f"<output_dir>/checkpoint-<step> directory, or `latest`")
    return path


def read_manifest(path: Path, verify_files: bool = True) -> dict:
    """The checkpoint's manifest, after checking that it is complete and, with `verify_files`, that every file it
    lists has the size and sha256 it had when saved. Any mismatch raises CheckpointError naming the file."""
    fix = _fix(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (a save that did not "
                              f"finish, or not an asyncgrpo checkpoint). {fix}")
    try:
        manifest = json.loads(manifest_file.read_text())
        files, fmt = manifest["files"], manifest["format_version"]
        TrainerState(**manifest["state"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {MANIFEST} ({exc}). {fix}") from exc
    if fmt not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {fmt}; this asyncgrpo reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}. Fix: resume with the asyncgrpo version that "
                              f"wrote it")
    outside = [name for name in files if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside:  # a save lists only files inside the checkpoint
        raise CheckpointError(f"checkpoint {str(path)!r} has a {MANIFEST} that lists {outside[0]!r}, a file outside "
                              f"the checkpoint. {fix}")
    for name, expected in files.items() if verify_files else ():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}. {fix}")
        size = file.stat().st_size
        if size != expected["bytes"] or sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} is corrupt ({size} bytes, the manifest says "
                                  f"{expected['bytes']}, or its sha256 differs). {fix}")
    return manifest


def _fix(path: Path) -> str:
    return (f"Fix: delete {str(path)!r} and resume from an earlier checkpoint-<step> directory "
            f"(`--resume_from_checkpoint PATH`), or start a fresh run")


def check_backend(backend: str) -> None:
    """A backend this module cannot checkpoint exactly is refused up front, not after hours of training."""
    if backend not in SUPPORTED_BACKENDS:
        raise CheckpointError(f"checkpoints (save_steps, resume_from_checkpoint) support DDP, FSDP1, FSDP2, ZeRO-2 "
                              f"and ZeRO-3, and this run uses {backend}. Fix: launch with one of the configs in "
                              f"launch/accelerate/, or set save_steps: 0 and unset resume_from_checkpoint")


# ---- saving --------------------------------------------------------------------------------------------------------
@dataclass
class CheckpointerSettings(CheckpointSettings, OutputSettings, TrainingSettings, AsyncSettings):
    """The sections the checkpointer reads: save_steps/save_total_limit, output_dir, and the two keys a checkpoint
    must fall between (num_iterations, weight_sync_steps)."""


@dataclass(frozen=True)
class Checkpointer:
    """When and where the run's checkpoints are written: every `save_steps` optimizer steps (0: never) and, as TRL
    does, at the last step, if that step published its weights and finished its batch's `num_iterations` passes (a
    checkpoint holds a published version and resumes between batches)."""

    output_dir: str
    every: int  # save_steps
    total_limit: int | None  # save_total_limit: older checkpoints are deleted after each save
    sync_every: int  # weight_sync_steps
    batch_steps: int  # num_iterations

    @classmethod
    def from_config(cls, cfg: CheckpointerSettings) -> Checkpointer:
        return cls(output_dir=cfg.output_dir, every=cfg.save_steps, total_limit=cfg.save_total_limit,
                   sync_every=cfg.weight_sync_steps, batch_steps=cfg.num_iterations)

    def should_save(self, step: int, *, last_step: bool) -> bool:
        if not self.every:
            return False
        return step % self.every == 0 or (last_step and step % self.sync_every == 0 and step % self.batch_steps == 0)

    def save(self, acc, model, optimizer, state: TrainerState, *, peft_config, base_model: str,
             lr_scheduler=None, texts=None) -> Path | None:
        """Collective: `save_checkpoint` into this run's output_dir, keeping at most `total_limit` checkpoints."""
        return save_checkpoint(acc, model, optimizer, state, output_dir=self.output_dir, peft_config=peft_config,
                               base_model=base_model, total_limit=self.total_limit, lr_scheduler=lr_scheduler,
                               texts=texts)


def save_checkpoint(acc, model, optimizer, state: TrainerState, *, output_dir: str | Path, peft_config,
                    base_model: str, total_limit: int | None = None, lr_scheduler=None,
                    texts=None) -> Path | None:
    """Collective: every rank joins the LoRA gather and writes its own RNG state; rank 0 writes the adapter's PEFT
    files at the top, the optimizer, the text files `texts(final_path)` returns (rank 0 only: file name -> content,
    e.g. trainer_state.json and the model card) and, last, the manifest, then renames the directory into place.
    Returns the path on rank 0."""
    tensors = gather_lora_state(acc, model)
    optim_state = _optimizer_state(acc, model, optimizer, state.backend)  # collective on FSDP
    final = checkpoint_path(output_dir, state.step)
    tmp = None
    if acc.is_main_process:
        tmp = Path(output_dir) / f"{_TMP_PREFIX}{state.step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    tmp = Path(broadcast_object(str(tmp) if tmp else None))  # output_dir must be shared by every node
    try:
        _write_file(tmp / f"rng-rank{acc.process_index}.pt", lambda f: torch.save(rng_state(), f))
        if state.backend in DEEPSPEED:  # collective: each rank writes its partitions
            with deepspeed_enums_by_value():
                model.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, exclude_frozen_parameters=True)
        if acc.is_main_process:
            export_adapter(tmp, tensors, peft_config, base_model)  # PeftModel.from_pretrained(base, checkpoint-N)
            for name, text in (texts(final) if texts is not None else {}).items():
                _write_file(tmp / name, lambda f, text=text: f.write(text.encode()))
            if optim_state is not None:
                _write_file(tmp / OPTIMIZER, lambda f: torch.save(optim_state, f))
            if lr_scheduler is not None:
                _write_file(tmp / SCHEDULER, lambda f: torch.save(lr_scheduler.state_dict(), f))
        acc.wait_for_everyone()  # every rank's file is written and fsynced
        if acc.is_main_process:
            _commit(tmp, final, state)
    except BaseException:
        if acc.is_main_process:  # rank 0 made it; a full disk must not also fill up with half-written saves
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if acc.is_main_process:
        prune_checkpoints(output_dir, total_limit)
        log.info("saved checkpoint %s (step %d, policy version %d)", final, state.step, state.version)
    acc.wait_for_everyone()
    return final if acc.is_main_process else None


def _state_dict_options(backend: str, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # heavy: torch's DCP, FSDP only

    # No CPU offload on FSDP1: a full gather with offload_to_cpu segfaults rank 0 on CPU hosts
    # (docs/cpu-hosts.md#fsdp1-no-cpu-offload-on-a-full-gather).
    return StateDictOptions(full_state_dict=True, cpu_offload=backend != "fsdp1", **kw)


def _optimizer_state(acc, model, optimizer, backend: str) -> dict | None:
    """Collective on FSDP: the whole optimizer state (rank 0), keyed by parameter names; DDP: rank 0's replica;
    ZeRO: None (DeepSpeed writes it)."""
    if backend in DEEPSPEED:
        return None
    if backend not in SHARDED:
        return optimizer.state_dict() if acc.is_main_process else None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # heavy: torch's DCP, FSDP only

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
    full = get_optimizer_state_dict(model, inner, options=_state_dict_options(backend))
    return full if acc.is_main_process else None


def _write_file(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, final: Path, state: TrainerState) -> None:
    """Rank 0: the manifest (last), fsync, rename into place. An existing directory of the same step (a run that
    resumed from an earlier checkpoint and got here again) is renamed aside first and deleted once the new one is in:
    whenever the save stops, one complete checkpoint of the step is there or set aside (`restore_set_aside`)."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:  # ours are fsynced as written; DeepSpeed's are not
        fsync_path(p)
    manifest = {"format_version": FORMAT_VERSION, "state": asdict(state),
                "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}}
    _write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    fsync_path(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)  # a killed replacement's, of this pid (pids are reused)
        os.rename(final, aside)
        fsync_path(final.parent)  # on disk before the new one takes the name
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)  # the old one back: the step keeps its complete checkpoint
        raise
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def prune_checkpoints(output_dir: str | Path, total_limit: int | None) -> list[Path]:
    """Keep the newest `total_limit` checkpoints (None: keep all); returns the removed ones."""
    if not total_limit:
        return []
    removed = [p for _, p in list_checkpoints(output_dir)[:-total_limit]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def clean_partial(output_dir: str | Path) -> list[Path]:
    """Rank 0 at start: remove temporary directories left by a save that was killed, after restoring a checkpoint a
    killed replacement set aside (`restore_set_aside`); returns what was removed."""
    root = Path(output_dir)
    removed = restore_set_aside(root)
    temporaries = sorted(p for p in root.glob(f"{_TMP_PREFIX}*") if p.is_dir()) if root.is_dir() else []
    for p in temporaries:
        shutil.rmtree(p, ignore_errors=True)
    return removed + temporaries


def restore_set_aside(output_dir: str | Path) -> list[Path]:
    """A `.old-checkpoint-<step>-<pid>` directory is a complete checkpoint that a same-step save renamed aside and was
    killed before deleting: renamed back if no checkpoint-<step> replaced it, else removed (returned). Every rank
    resolving `latest` runs this at once on shared storage: a rename another rank made first is not an error."""
    root = Path(output_dir)
    removed = []
    for aside in sorted(root.iterdir()) if root.is_dir() else ():
        m = _ASIDE_DIR.match(aside.name)
        if not m or not aside.is_dir():
            continue
        final = checkpoint_path(root, int(m.group(1)))
        if not final.exists():
            try:
                os.rename(aside, final)
                log.warning("restored %s, set aside by a save of the same step that did not finish", final)
                continue
            except OSError:
                if not final.exists():
                    raise
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(aside)
    return removed


# ---- loading -------------------------------------------------------------------------------------------------------
def load_checkpoint(path: Path, acc, model, optimizer, lr_scheduler=None) -> TrainerState:
    """Every rank: check the checkpoint, copy its adapter into the model's LoRA parameters and its state into the
    optimizer and the learning-rate schedule. RNG states are restored separately (`restore_rng`), last, once setup
    no longer draws numbers."""
    manifest = read_manifest(path)
    state = _load_weights_and_optimizer(path, manifest, acc, model, optimizer)
    if lr_scheduler is not None:
        # A checkpoint from before schedules existed has none; the schedule is a function of the step alone. One there
        # but not listed is loaded (and refused) like any other.
        saved = _load_listed(path, manifest, SCHEDULER) if SCHEDULER in manifest["files"] or \
            (path / SCHEDULER).exists() else \
            {**lr_scheduler.state_dict(), "last_epoch": state.step, "_step_count": state.step + 1}
        restore_lr_scheduler(lr_scheduler, saved)
    return state


def _load_weights_and_optimizer(path: Path, manifest: dict, acc, model, optimizer) -> TrainerState:
    state = TrainerState(**manifest["state"])
    peft_model = acc.unwrap_model(model)
    marker = f".{peft_model.active_adapter}."
    params = {clean_fsdp_name(name).replace(marker, ".", 1): p for name, p in lora_parameters(peft_model)}
    current = backend_of(acc)
    # Full shapes (FSDP2's DTensors report them, ZeRO-3 keeps them in ds_shape); an FSDP1 parameter is a flat view of
    # this rank's slice: names only.
    shapes = {k: None if current == "fsdp1" else getattr(p, "ds_shape", p.shape) for k, p in params.items()}
    adapter = adapter_file(manifest)
    # Checked, then read by name: safetensors holds tensors only, and its own reader's tensors are what FSDP2's
    # scatter expects (tensors made by safetensors.torch.load from the checked bytes broke its collectives).
    _open_listed(path, manifest, adapter).close()
    tensors = safetensors.torch.load_file(str(path / adapter))
    if set(tensors) != set(params) or any(shape is not None and tensors[k].shape != shape for k, shape in shapes.items()):
        raise CheckpointError(f"the adapter in {str(path)!r} does not fit this model (different lora_r, "
                              f"lora_target_modules or base model). Fix: resume with the config the checkpoint was "
                              f"saved with ({str(path.parent / 'config.yaml')!r})")
    if _layout(current, acc.num_processes) != _layout(state.backend, state.world_size):  # optimizer files differ
        raise CheckpointError(f"{str(path)!r} was saved by a {state.backend} run of {state.world_size} ranks and this "
                              f"run uses {current} on {acc.num_processes}. Fix: resume with the launch config the "
                              f"checkpoint was saved with (DDP, FSDP and ZeRO checkpoints do not mix; FSDP1 and FSDP2 "
                              f"do, on any number of ranks; ZeRO needs the same stage and number of ranks)")
    if state.backend in DEEPSPEED:  # the engine restores the LoRA weights, their fp32 masters and Adam state
        with private_deepspeed_copy(path, manifest) as copy:  # DeepSpeed unpickles in full what it is pointed at
            loaded, _ = model.load_checkpoint(str(copy), tag=DEEPSPEED_TAG, load_module_strict=False,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {str(path / DEEPSPEED_DIR)!r}. Fix: resume from "
                                  f"another checkpoint-<step> (this one is incomplete)")
        return state
    optim_state = _load_listed(path, manifest, OPTIMIZER)
    if state.backend in SHARDED:  # every rank reads the whole (adapter-sized) state and keeps its own shard
        _load_sharded(acc, model, optimizer, current, tensors, marker, optim_state)
        return state
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(tensors[key])
    optimizer.load_state_dict(optim_state)
    return state


def adapter_file(manifest: dict) -> str:
    """Where the checkpoint's LoRA weights are: at its top, or in `adapter/` in a format-1 checkpoint."""
    return WEIGHTS_NAME if manifest["format_version"] >= 2 else f"{LEGACY_ADAPTER_DIR}/{WEIGHTS_NAME}"


def read_trainer_state(path: Path) -> dict | None:
    """Rank 0 on resume: the checkpoint's trainer_state.json (checked against the manifest), None in a checkpoint
    that has none (written before it existed)."""
    manifest = read_manifest(path, verify_files=False)  # the file itself is checked as it is read
    if TRAINER_STATE not in manifest["files"] and not (path / TRAINER_STATE).exists():
        return None
    with _open_listed(path, manifest, TRAINER_STATE) as f:
        try:
            return json.loads(f.read())
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE} is not JSON ({exc}). "
                                  f"{_fix(path)}") from None


def _open_listed(path: Path, manifest: dict, name: str):
    """`path / name`, opened once and checked against the size and sha256 the manifest lists for it; the open file is
    what is then loaded (a file swapped in after the check is not read). An unlisted file is refused, not loaded."""
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint {str(path)!r}: {name} is not listed in its {MANIFEST} (added after the "
                              f"save, or the manifest was edited), so it is not loaded. {_fix(path)}")
    try:
        f = open(path / name, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}. {_fix(path)}") from None
    try:
        digest, size = hashlib.sha256(), 0
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if size != expected["bytes"] or digest.hexdigest() != expected["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} is corrupt ({size} bytes, the manifest says "
                                  f"{expected['bytes']}, or its sha256 differs). {_fix(path)}")
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def _load_listed(path: Path, manifest: dict, name: str, map_location="cpu"):
    """A torch file of the checkpoint, checked (`_open_listed`) and unpickled by torch's tensors-only unpickler: a
    file that would construct anything else (run code) is refused before any of it runs."""
    with _open_listed(path, manifest, name) as f, torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's line naming the refused global (a global it could allow, or one of a module it blocks),
            # without its advice to allow it or to load with weights_only=False
            lines = str(exc).strip().splitlines()
            reason = next((line for line in lines if "GLOBAL" in line), "an object torch's safe unpickler refuses")
            reason = reason.split("WeightsUnpickler error: ")[-1].split(". Please")[0].strip().rstrip(".")
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} holds objects a checkpoint never saves, so it is "
                                  f"not loaded ({reason}). Fix: resume only from checkpoints written by asyncgrpo on "
                                  f"storage no one else can write; delete {str(path)!r} and resume from an earlier "
                                  f"checkpoint-<step> directory, or start a fresh run") from None


@contextlib.contextmanager
def deepspeed_enums_by_value():
    """While DeepSpeed saves: its optimizer state holds a `ZeroStageEnum`, which some Pythons (Debian's 3.11.2, for
    one) pickle by name, as `builtins.getattr(ZeroStageEnum, "gradients")`, and others by value. A `getattr` in a
    pickle can reach any attribute of anything, so `_check_deepspeed_files` refuses it: the member is saved by value,
    `ZeroStageEnum(2)`, on every Python (copyreg's table is consulted before the class's own `__reduce_ex__`)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum  # heavy: DeepSpeed, only when it saves

    previous = copyreg.dispatch_table.get(ZeroStageEnum)
    copyreg.dispatch_table[ZeroStageEnum] = lambda member: (ZeroStageEnum, (member.value,))
    try:
        yield
    finally:
        if previous is None:
            del copyreg.dispatch_table[ZeroStageEnum]
        else:
            copyreg.dispatch_table[ZeroStageEnum] = previous


@contextlib.contextmanager
def private_deepspeed_copy(path: Path, manifest: dict):
    """DeepSpeed reads its checkpoint by path, with the full unpickler, so it is pointed at a private copy instead of
    `path/deepspeed`: every file there the manifest lists, copied into a directory only this process's user can
    enter (mkdtemp: 0700) and hashed as it is copied, so the copy holds exactly the bytes that were checked; then
    `_check_deepspeed_files` on the copy. A file swapped in `output_dir` after the check is never read. Yields the
    copy's `deepspeed/` directory, removed afterwards. The copy is adapter-sized (saved without frozen weights)."""
    root = Path(tempfile.mkdtemp(prefix="asyncgrpo-deepspeed-"))
    try:
        for name in sorted(n for n in manifest["files"] if Path(n).parts[0] == DEEPSPEED_DIR):
            copy = root / name
            copy.parent.mkdir(parents=True, exist_ok=True)
            with _open_listed(path, manifest, name) as source, open(copy, "xb") as target:
                digest = hashlib.sha256()
                while chunk := source.read(HASH_CHUNK):
                    digest.update(chunk)
                    target.write(chunk)
            if digest.hexdigest() != manifest["files"][name]["sha256"]:  # changed in place since _open_listed's hash
                raise CheckpointError(f"checkpoint {str(path)!r}: {name} changed while it was read. {_fix(path)}")
        _check_deepspeed_files(path, manifest, files=root)
        yield root / DEEPSPEED_DIR
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_deepspeed_files(path: Path, manifest: dict, files: Path | None = None) -> None:
    """DeepSpeed reads what it finds in `deepspeed/` with the full unpickler: every file there must be listed in the
    manifest (read_manifest checked those), and every torch file may name only torch's safe globals and
    DEEPSPEED_GLOBALS. `files`: where the files are read (a private copy of `path`'s), `path` itself by default; the
    errors name `path`."""
    unlisted = [str(f.relative_to(path)) for f in sorted((path / DEEPSPEED_DIR).rglob("*")) if f.is_file()
                and str(f.relative_to(path)) not in manifest["files"]]
    if unlisted:
        raise CheckpointError(f"checkpoint {str(path)!r}: {unlisted[0]} is not listed in its {MANIFEST} (added after "
                              f"the save, or the manifest was edited), so it is not loaded. {_fix(path)}")
    for file in sorted(((files or path) / DEEPSPEED_DIR).rglob("*")):
        name = str(file.relative_to(files or path))
        if not file.is_file() or file.suffix != ".pt":  # `latest`: text DeepSpeed does not unpickle
            continue
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - DEEPSPEED_GLOBALS
        except (ValueError, RuntimeError, pickle.UnpicklingError) as exc:  # not torch.save's zip format, or a
            # pickle protocol its name reader does not know (torch.save(..., pickle_protocol=4)): names unreadable
            unsafe = {f"an unreadable file ({type(exc).__name__}: {exc})"}
        if unsafe:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} holds objects a DeepSpeed checkpoint never saves "
                                  f"({', '.join(sorted(unsafe))}), so it is not loaded. Fix: resume only from "
                                  f"checkpoints written by asyncgrpo on storage no one else can write; delete "
                                  f"{str(path)!r} and resume from an earlier checkpoint-<step> directory, or start a "
                                  f"fresh run")


def _layout(backend: str, world_size: int) -> tuple:
    """What must match between the run that saved a checkpoint and the one resuming from it."""
    if backend in DEEPSPEED:
        return backend, world_size
    return ("sharded",) if backend in SHARDED else ("replicated",)


def _load_sharded(acc, model, optimizer, backend: str, tensors, marker: str, optim_state: dict) -> None:
    """Collective: load LoRA weights and optimizer state saved whole into an FSDP-sharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (  # heavy: torch's DCP, FSDP only
        set_model_state_dict, set_optimizer_state_dict)

    weights = {}
    for key, tensor in tensors.items():  # PEFT's saved keys -> the model's parameter names (adapter name back in)
        module, _, leaf = key.rpartition(".lora_")
        weights[f"{module}.lora_{leaf.split('.', 1)[0]}{marker}{leaf.split('.', 1)[1]}"] = tensor
    set_model_state_dict(model, weights, options=_state_dict_options(backend, strict=False))
    inner = getattr(optimizer, "optimizer", optimizer)
    set_optimizer_state_dict(model, inner, optim_state, options=_state_dict_options(backend))


def rng_state() -> dict:
    """This rank's RNG states. CUDA: only the generator of the device this rank uses (`current_device()`, which the
    launcher sets per rank), as one tensor; a job resumed with another number of visible GPUs (a
    `CUDA_VISIBLE_DEVICES` per rank, another node shape) restores it all the same."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng(path: Path, rank: int) -> None:
    """This rank's RNG states as saved; a rank the checkpoint did not have (more ranks now) keeps its own."""
    name = f"rng-rank{rank}.pt"
    manifest = read_manifest(path, verify_files=False)  # the file itself is checked as it is read
    if name not in manifest["files"] and not (path / name).exists():
        log.warning("%s has no RNG state for rank %d (saved with fewer ranks); keeping this rank's own", path, rank)
        return
    state = _load_listed(path, manifest, name, map_location=None)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        _restore_cuda_rng(state["cuda"], path, rank)


def _restore_cuda_rng(saved, path: Path, rank: int) -> None:
    """The CUDA generator of the device this rank uses. `saved` is that device's state, or, in a checkpoint written
    before that, a list of every visible device's state (`get_rng_state_all`): this device's entry is taken if the
    list has one (the only entry when the saving rank saw one device), else CUDA's RNG is left as it is."""
    device = torch.cuda.current_device()
    if isinstance(saved, (list, tuple)):
        if device < len(saved):
            saved = saved[device]
        elif len(saved) == 1:
            saved = saved[0]
        else:
            log.warning("%s: rank %d's CUDA RNG states cover %d devices, not this rank's device %d (another GPU "
                        "layout); keeping this device's own", path, rank, len(saved), device)
            return
    torch.cuda.set_rng_state(saved, device)


