"""The adapter store: each policy version as a complete PEFT adapter directory, written atomically.

The rollout side writes a version here before any server loads it; checkpoints write their adapter the same way.
Files go to a hidden temporary directory, are fsynced and renamed into place, with a manifest of sizes and sha256
sums that `verify_adapter_files` checks before a server is given the directory (docs/delivery.md). A temporary
directory is named after its writer's host and pid; the leftover cleaners remove only dead writers' (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncgrpo.errors import AsyncGRPOError, SyncError
from asyncgrpo.files import dir_mode, file_mode, fsync_path, sha256_file

log = logging.getLogger(__name__)

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
CARD_NAME = "README.md"  # the model card, as `save_pretrained` and the hub name it
MANIFEST_NAME = "asyncgrpo_manifest.json"  # size and sha256 of each file, recorded at write, checked before a load
_VERSION_DIR = re.compile(r"^v(\d{6})$")
# `.tmp-v000001-<host>-<pid>`; the old `.tmp-v000001-<pid>` (no host) was always written by a writer on this host.
# The host is everything between the version and the last `-`: host names may hold `-`, pids never do.
_TMP_DIR = re.compile(r"^\.tmp-v\d{6}-(?:(.+)-)?(\d+)$")
# A temporary directory of a writer on another host is removed only when this old: its pid means nothing here, and
# no version takes a day to write, so one this old was left by a dead writer (whatever the clocks' skew).
OTHER_HOST_TMP_AGE_S = 24 * 3600


class AdapterStore:
    """Version directories `root/v000001`, ... each a complete PEFT adapter (save_pretrained format)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir()
                os.chmod(self.root, dir_mode())  # the user's umask decides who else reads it (docs/security.md)
        except OSError as exc:
            raise AsyncGRPOError(f"cannot create lora_adapter_path {str(self.root)!r} ({exc}); set lora_adapter_path "
                                 f"to a writable directory the inference server can read") from exc
        self.clean_partial()  # what a writer killed midway left behind

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def versions(self) -> list[int]:
        """Complete versions on disk, oldest first (temporary directories are not versions)."""
        found = [int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def clean_partial(self) -> list[Path]:
        """Remove temporary directories left by a writer that died (`writer_is_gone`); returns what was removed."""
        removed = [p for p in sorted(self.root.glob(".tmp-v*")) if writer_is_gone(p)]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def write(self, version: int, tensors: dict[str, torch.Tensor], peft_config, base_model: str) -> Path:
        """Atomically write version `version`; returns its directory. Refuses to overwrite an existing version."""
        final = self.path(version)
        if final.exists():
            raise SyncError(f"adapter version directory {final} already exists; versions are immutable. "
                            f"Use a fresh lora_adapter_path or remove it")
        if not tensors:
            raise SyncError("the gathered adapter has no tensors; refusing to publish an empty adapter")
        tmp = self.root / f".tmp-v{version:06d}-{host_name()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            weights = {k: v.detach().contiguous() for k, v in tensors.items()}
            save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            fsync_path(tmp / WEIGHTS_NAME)
            self._write_config(tmp, peft_config, base_model)  # last loadable file: a partial directory has no config
            write_manifest(tmp, [WEIGHTS_NAME, CONFIG_NAME])
            # The user's umask decides who else reads a version (a server run by another user needs 022 or a shared
            # group): whatever mode the libraries created each file with, e.g. 0600 for a temporary file.
            for p in tmp.iterdir():
                os.chmod(p, file_mode())
            os.chmod(tmp, dir_mode())
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    @staticmethod
    def _write_config(directory: Path, peft_config, base_model: str) -> None:
        config = peft_config.to_dict()
        config["base_model_name_or_path"] = base_model
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        path = directory / CONFIG_NAME
        with open(path, "w") as f:
            json.dump(config, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())

    def prune(self, keep: int, in_use: set[Path]) -> None:
        """Delete all but the newest `keep` versions, never one the server may still be serving."""
        for v in self.versions()[:-keep]:
            p = self.path(v)
            if p not in in_use:
                shutil.rmtree(p, ignore_errors=True)


def export_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], peft_config, base_model: str,
                   card: str | None = None) -> Path:
    """The adapter in PEFT's `save_pretrained` layout straight into `directory` (a run's output_dir, as TRL's
    `save_model` writes it), beside whatever else is there, with `card` as its model card (README.md) when given.
    Every file is written and fsynced in a temporary directory first, then renamed over the old one, the config
    last: a reader never sees a half-written file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-final-{host_name()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        fsync_path(tmp / WEIGHTS_NAME)
        names = [WEIGHTS_NAME, CONFIG_NAME]
        if card is not None:
            (tmp / CARD_NAME).write_text(card)
            fsync_path(tmp / CARD_NAME)
            names.insert(0, CARD_NAME)
        AdapterStore._write_config(tmp, peft_config, base_model)
        for name in names:
            os.chmod(tmp / name, file_mode())
            os.replace(tmp / name, directory / name)
        fsync_path(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def write_manifest(directory: Path, names: list[str]) -> None:
    """Record each file's size and sha256 as written (read back from disk, so it is what the server will read)."""
    manifest = {name: {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
                for name in names}
    with open(directory / MANIFEST_NAME, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def verify_adapter_files(directory: Path) -> None:
    """Before a server is asked to load `directory`: each file still has the size and sha256 recorded when it was
    written; a SyncError names the bad file and the fix. A directory without a manifest (not written by
    AdapterStore) is not checked."""
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.exists():
        return
    fix = ("the adapter directory was changed after asyncgrpo wrote it (disk full, a storage fault, or another "
           "process writing there). Fix: check the storage of lora_adapter_path and that nothing else writes under "
           "it, then restart the run from its last checkpoint (resume_from_checkpoint: latest)")
    for name, want in json.loads(manifest_path.read_text()).items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise SyncError(f"adapter file {path} cannot be read before loading it ({exc}); {fix}") from exc
        if size != want["size"]:
            raise SyncError(f"adapter file {path} has {size} bytes, but {want['size']} were written; {fix}")
        digest = sha256_file(path)
        if digest != want["sha256"]:
            raise SyncError(f"adapter file {path} has sha256 {digest[:16]}..., but {want['sha256'][:16]}... was "
                            f"written (same size: its content changed); {fix}")


def host_name() -> str:
    """This host's name as temporary directories carry it: characters other than letters, digits, `.` and `-`
    become `_`, so that the name stays one path component."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "_"


def writer_is_gone(tmp: Path) -> bool:
    """Whether `tmp` is a temporary version directory whose writer is gone: one of this host whose pid no longer
    runs, or one of another host (`lora_adapter_path` on shared storage) older than OTHER_HOST_TMP_AGE_S. Anything
    else (a file, another name, a live or recent writer) is not ours to remove."""
    m = _TMP_DIR.match(tmp.name)
    if not m or not tmp.is_dir():
        return False
    host, pid = m.group(1), int(m.group(2))
    if host is None or host == host_name():
        return not _alive(pid)
    try:
        age = time.time() - tmp.stat().st_mtime
    except OSError:  # removed meanwhile by its writer or another cleaner
        return False
    return age > OTHER_HOST_TMP_AGE_S


def clean_stale_temporaries(adapter_root: str | Path) -> list[Path]:
    """At start: remove the temporary version directories that writers killed midway left in any run's directory
    under `adapter_root` (`lora_adapter_path`); returns them. Only those whose writer is gone (`writer_is_gone`) are
    removed: another run's writer, on this host or another, may be writing right now."""
    removed = [tmp for tmp in sorted(Path(adapter_root).glob("*/.tmp-v*")) if writer_is_gone(tmp)]
    for tmp in removed:
        shutil.rmtree(tmp, ignore_errors=True)
    if removed:
        log.warning("removed %d temporary adapter director%s left by killed runs under %s", len(removed),
                    "y" if len(removed) == 1 else "ies", adapter_root)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
