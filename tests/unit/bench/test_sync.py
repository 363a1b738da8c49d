"""bench/sync.py: the environment its worker launches get (each backend's switches, the allocator setting for
real shapes) and the arguments it refuses."""

import subprocess

import pytest

from asyncgrpo.bench import sync
from asyncgrpo.errors import AsyncGRPOError, ConfigError


def test_cpu_launch_env_sets_only_the_backends_switch(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # left over from a DDP launch: must not reach DeepSpeed
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    zero3 = sync.cpu_launch_env("zero3")
    assert zero3["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in zero3
    ddp = sync.cpu_launch_env("ddp")
    assert ddp["ACCELERATE_USE_CPU"] == "true" and "DS_ACCELERATOR" not in ddp
    assert ddp["OMP_NUM_THREADS"] == "1" and ddp["HF_HUB_OFFLINE"] == "1"
    assert "MALLOC_MMAP_THRESHOLD_" not in ddp
    assert sync.cpu_launch_env("ddp", large_model=True)["MALLOC_MMAP_THRESHOLD_"] == str(2**20)


@pytest.mark.parametrize("large_model", [False, True])
def test_launch_worker_passes_the_allocator_setting_for_real_shapes(monkeypatch, tmp_path, large_model):
    """A real-shape run without it kept each rank's freed load buffers (a ZeRO-3 rank grew to 8.5 GB)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    seen = {}

    def fake_run(cmd, env, **kwargs):  # the launch itself is what the integration tier runs
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 1, "", "boom")

    monkeypatch.setattr(sync, "run_group", fake_run)
    with pytest.raises(AsyncGRPOError, match="zero3 failed .exit 1.:\nboom"):
        sync.launch_worker("zero3", tmp_path / "model", "http://127.0.0.1:1", tmp_path / "out" / "r.json", [],
                           large_model=large_model)
    assert ("MALLOC_MMAP_THRESHOLD_" in seen["env"]) is large_model
    assert seen["env"]["DS_ACCELERATOR"] == "cpu"
    assert seen["cmd"][seen["cmd"].index("--config_file") + 1].endswith("launch/accelerate/zero3_cpu.yaml")


def test_run_refuses_an_unknown_backend_and_no_servers():
    with pytest.raises(ConfigError, match="zero4"):
        sync.run("zero4", None, [])
    with pytest.raises(ConfigError, match="--servers"):
        sync.run("ddp", None, [], servers=0)
