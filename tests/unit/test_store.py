"""The adapter store: versions are complete or absent, never half-written."""

import hashlib
import json
import os
import threading

import pytest
from liveness import killed_midway
import torch
from peft import LoraConfig
import safetensors.torch
from safetensors.torch import load_file

from asyncgrpo import store as store_module
from asyncgrpo.errors import AsyncGRPOError, SyncError
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import CONFIG_NAME, WEIGHTS_NAME, AdapterStore, export_adapter, verify_adapter_files

CONFIG = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM")


def tensors(value: float) -> dict:
    return {"base_model.model.layer.q_proj.lora_A.weight": torch.full((8, 16), value),
            "base_model.model.layer.q_proj.lora_B.weight": torch.full((16, 8), value)}


def test_write_produces_a_complete_peft_adapter(tmp_path):
    store = AdapterStore(tmp_path)
    path = store.write(1, tensors(0.5), CONFIG, base_model="/models/base")
    assert path == tmp_path.resolve() / "v000001"
    loaded = load_file(path / "adapter_model.safetensors")
    assert torch.equal(loaded["base_model.model.layer.q_proj.lora_B.weight"], torch.full((16, 8), 0.5))
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == "/models/base"
    assert config["target_modules"] == ["q_proj"]
    assert store.versions() == [1]


def test_versions_are_immutable(tmp_path):
    store = AdapterStore(tmp_path)
    store.write(1, tensors(0.5), CONFIG, base_model="b")
    with pytest.raises(SyncError, match="already exists"):
        store.write(1, tensors(0.7), CONFIG, base_model="b")


def test_prune_keeps_the_newest_and_the_served_version(tmp_path):
    store = AdapterStore(tmp_path)
    for v in range(1, 6):
        store.write(v, tensors(v), CONFIG, base_model="b")
    store.prune(keep=2, in_use={store.path(2)})
    assert store.versions() == [2, 4, 5]


def _write_half_then_block(root, ready) -> None:
    """In a forked child: write version 2, but stop in the middle of the weights file and wait to be killed."""

    def half_then_block(tensors, path, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        ready.set()
        threading.Event().wait()  # until SIGKILL

    store_module.save_file = half_then_block  # the store's own name for it (a forked child: no undo needed)
    AdapterStore(root).write(2, {"a.lora_A.weight": torch.ones(64, 64)}, CONFIG, base_model="b")


def test_a_write_killed_midway_leaves_the_previous_version_and_no_loadable_partial(tmp_path):
    store = AdapterStore(tmp_path)
    store.write(1, tensors(1.0), CONFIG, base_model="b")
    # A child process (forked: the same code, started at once) writes version 2 and is SIGKILLed in the middle of
    # writing the weights file.
    killed_midway(_write_half_then_block, (str(tmp_path),), "the write")
    assert store.versions() == [1]
    assert not store.path(2).exists()
    partial = list(tmp_path.glob(".tmp-*"))
    assert len(partial) == 1 and not (partial[0] / "adapter_config.json").exists()  # not a loadable adapter
    assert torch.equal(load_file(store.path(1) / "adapter_model.safetensors")
                       ["base_model.model.layer.q_proj.lora_A.weight"], torch.full((8, 16), 1.0))
    assert store.clean_partial() == partial and not list(tmp_path.glob(".tmp-*"))
    assert store.write(2, tensors(2.0), CONFIG, base_model="b") == store.path(2)


def test_a_same_size_corruption_is_caught_before_any_server_is_asked_to_load_it(tmp_path):
    store = AdapterStore(tmp_path)
    path = store.write(1, tensors(0.5), CONFIG, base_model="b")
    weights = path / WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of a tensor flipped: same size, a valid-looking file
    weights.write_bytes(bytes(data))

    class NoServer:
        base_url = "http://never-called:8000"

        def __getattr__(self, name):
            raise AssertionError(f"the server was called ({name}) for a corrupt adapter")

    with pytest.raises(SyncError) as error:
        AdapterPublisher([NoServer()], "run").publish(1, path)
    message = str(error.value)
    assert f"adapter file {weights} has sha256 " in message and "(same size: its content changed)" in message
    assert "Fix: check the storage of lora_adapter_path" in message


def test_a_truncated_file_is_named_with_both_sizes(tmp_path):
    path = AdapterStore(tmp_path).write(1, tensors(0.5), CONFIG, base_model="b")
    weights = path / WEIGHTS_NAME
    size = weights.stat().st_size
    os.truncate(weights, size - 10)
    with pytest.raises(SyncError, match=f"adapter file {weights} has {size - 10} bytes, but {size} were written"):
        verify_adapter_files(path)


@pytest.mark.parametrize("umask, file, directory", [(0o077, "0o600", "0o700"), (0o027, "0o640", "0o750"),
                                                     (0o022, "0o644", "0o755")])
def test_adapter_files_follow_the_umask(tmp_path, umask, file, directory):
    old = os.umask(umask)
    try:
        root = tmp_path / "adapters"
        path = AdapterStore(root).write(1, tensors(0.5), CONFIG, base_model="b")
        final = export_adapter(tmp_path / "final", tensors(0.5), CONFIG, base_model="b")
    finally:
        os.umask(old)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in path.iterdir()} == {
        "adapter_model.safetensors": file, "adapter_config.json": file, "asyncgrpo_manifest.json": file}
    assert oct(path.stat().st_mode & 0o777) == oct(root.stat().st_mode & 0o777) == directory
    assert {oct((final / name).stat().st_mode & 0o777) for name in ("adapter_model.safetensors",
                                                                    "adapter_config.json")} == {file}


def test_only_complete_version_directories_are_versions(tmp_path):
    store = AdapterStore(tmp_path)
    store.write(2, tensors(0.5), CONFIG, base_model="b")
    (tmp_path / "v000009").write_text("a file, not a version")
    (tmp_path / "v12").mkdir()  # not six digits
    (tmp_path / "v0000011").mkdir()  # seven
    (tmp_path / "xv000004").mkdir()
    (tmp_path / "v000003").mkdir()
    assert store.versions() == [2, 3]
    assert store.path(7) == tmp_path.resolve() / "v000007"


def test_a_new_store_removes_what_a_killed_writer_left(tmp_path):
    (tmp_path / ".tmp-v000003-999").mkdir()
    (tmp_path / ".tmp-v000003-999" / "adapter_model.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-note").write_text("a file is not a writer's directory")
    AdapterStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-note"]


def test_an_empty_adapter_is_refused_and_writes_nothing(tmp_path):
    store = AdapterStore(tmp_path)
    with pytest.raises(SyncError, match="no tensors"):
        store.write(1, {}, CONFIG, base_model="b")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_leaves_no_directory_behind(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "save_file", full_disk)
    store = AdapterStore(tmp_path)
    with pytest.raises(OSError, match="No space"):
        store.write(1, tensors(0.5), CONFIG, base_model="b")
    assert list(tmp_path.iterdir()) == []


def test_config_lists_target_modules_sorted(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj", "k_proj"], task_type="CAUSAL_LM")
    path = AdapterStore(tmp_path).write(1, tensors(0.5), config, base_model="/m")
    written = json.loads((path / "adapter_config.json").read_text())
    assert written["target_modules"] == ["k_proj", "q_proj", "v_proj"] and written["r"] == 4


def test_unreadable_root_is_a_user_error_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AsyncGRPOError, match="lora_adapter_path"):
        AdapterStore(tmp_path / "file" / "adapters")


def test_a_store_under_missing_directories_creates_them(tmp_path):
    root = tmp_path / "runs" / "2026" / "adapters"  # neither it nor its parents exist yet
    store = AdapterStore(root)
    assert root.is_dir() and store.root == root.resolve()
    assert store.write(1, tensors(0.5), CONFIG, base_model="b") == root.resolve() / "v000001"


def test_an_uncreatable_root_names_the_path_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "adapters"
    with pytest.raises(AsyncGRPOError) as err:
        AdapterStore(root)
    message = str(err.value)
    assert message.startswith(f"cannot create lora_adapter_path {str(root)!r} (")
    assert message.endswith("set lora_adapter_path to a writable directory the inference server can read")


def test_a_stale_temporary_of_the_same_version_is_replaced(tmp_path):
    # A temporary directory with this process's id and this version, made after the store cleaned up at start
    # (e.g. by an earlier write of this version that failed): the write starts afresh and keeps none of it.
    store = AdapterStore(tmp_path)
    stale = tmp_path / f".tmp-v000001-{store_module.host_name()}-{os.getpid()}"
    stale.mkdir()
    (stale / "leftover.bin").write_bytes(b"old")
    path = store.write(1, tensors(0.5), CONFIG, base_model="b")
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "asyncgrpo_manifest.json"]
    assert not stale.exists()


def test_the_weights_file_says_it_holds_pytorch_tensors_as_peft_writes_it(tmp_path):
    # PEFT's save_pretrained and transformers write {"format": "pt"}; readers that check it accept nothing else
    from safetensors import safe_open

    path = AdapterStore(tmp_path).write(1, tensors(0.5), CONFIG, base_model="b")
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_base_model_given_as_a_path_is_written_as_its_string(tmp_path):
    from pathlib import Path

    path = AdapterStore(tmp_path).write(1, tensors(0.5), CONFIG, base_model=Path("/models/base"))
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == "/models/base"


def test_an_empty_adapter_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SyncError) as err:
        AdapterStore(tmp_path).write(1, {}, CONFIG, base_model="b")
    assert str(err.value) == "the gathered adapter has no tensors; refusing to publish an empty adapter"


FIX = ("the adapter directory was changed after asyncgrpo wrote it (disk full, a storage fault, or another process "
       "writing there). Fix: check the storage of lora_adapter_path and that nothing else writes under it, then "
       "restart the run from its last checkpoint (resume_from_checkpoint: latest)")


def test_a_changed_adapter_file_is_named_with_both_digests_and_the_fix(tmp_path):
    path = AdapterStore(tmp_path).write(1, tensors(0.5), CONFIG, base_model="b")
    weights = path / WEIGHTS_NAME
    written = hashlib.sha256(weights.read_bytes()).hexdigest()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    now = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(SyncError) as err:
        verify_adapter_files(path)
    assert str(err.value) == (f"adapter file {weights} has sha256 {now[:16]}..., but {written[:16]}... was written "
                              f"(same size: its content changed); {FIX}")


def test_a_deleted_adapter_file_is_named_with_the_reason_and_the_fix(tmp_path):
    path = AdapterStore(tmp_path).write(1, tensors(0.5), CONFIG, base_model="b")
    (path / CONFIG_NAME).unlink()
    with pytest.raises(SyncError) as err:
        verify_adapter_files(path)
    assert str(err.value) == (f"adapter file {path / CONFIG_NAME} cannot be read before loading it ([Errno 2] No such "
                              f"file or directory: {str(path / CONFIG_NAME)!r}); {FIX}")


def test_the_final_adapter_is_exported_into_output_dir_beside_what_is_there(tmp_path):
    (tmp_path / "run_summary.json").write_text("{}")
    (tmp_path / CONFIG_NAME).write_text("{\"stale\": true}")  # a previous run's: replaced whole
    tensors = {"base_model.model.layer.lora_A.weight": torch.ones(2, 3)}
    assert store_module.export_adapter(tmp_path, tensors, LoraConfig(r=2, target_modules=["q_proj"]),
                                       base_model="Qwen/Qwen2.5-0.5B") == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, "run_summary.json"]
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B"
    assert torch.equal(load_file(str(tmp_path / WEIGHTS_NAME))["base_model.model.layer.lora_A.weight"],
                       torch.ones(2, 3))


def test_a_hub_id_stays_an_id_and_a_local_base_becomes_absolute(tmp_path, monkeypatch):
    from asyncgrpo.data import base_model_reference

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert base_model_reference("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # no such directory: a hub id
    assert base_model_reference("models/mine") == str(tmp_path / "models" / "mine")


def test_the_final_adapter_goes_into_a_new_nested_output_dir_past_a_stale_temporary_and_loads_as_pytorch(tmp_path):
    out = tmp_path / "final"
    out.mkdir(parents=True)
    stale = out / f".tmp-final-{store_module.host_name()}-{os.getpid()}"  # a killed export's, of this host and pid
    stale.mkdir()
    (stale / WEIGHTS_NAME).write_bytes(b"half")
    tensors = {"base_model.model.layer.lora_A.weight": torch.ones(2, 3)}
    store_module.export_adapter(out, tensors, LoraConfig(r=2, target_modules=["q_proj"]), base_model="b")
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]  # the stale temporary is gone
    with safetensors.safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers and PEFT require of a PyTorch safetensors file
    nested = tmp_path / "new" / "nested" / "final"
    store_module.export_adapter(nested, tensors, LoraConfig(r=2, target_modules=["q_proj"]), base_model="b")
    assert sorted(p.name for p in nested.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
