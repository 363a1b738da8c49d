"""scripts/gpu_check.sh: its CPU smoke mode end to end (the wrapper, PYTHONPATH=src, no install), and the device check
it rests on. The real run needs a GPU (see docs/gpus.md); these pin the code path it takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncgrpo.bench import gpu_check
from asyncgrpo.distributed import dist_sum

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_smoke_prints_one_json_line_with_every_device_check_passed():
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the wrapper alone must find the sources
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # library banners go to stderr
    result = json.loads(lines[0])
    checks = {c["name"]: c for c in result["device_checks"]}
    assert set(checks) == {"dist_sum", "dist_max", "gather_fsdp2", "train_steps", "gather_fsdp2_after_training"}
    assert result["device_checks_passed"] is True
    assert all(c["ok"] and c["collectives"] >= 1 and c["expected_device"] == "cpu" for c in checks.values())
    assert checks["gather_fsdp2"]["seen"] == ["asyncgrpo.trainer.gather.all_gather:cpu",
                                              "asyncgrpo.trainer.gather.gather:cpu"]
    assert checks["train_steps"]["collectives"] == 3  # the token count, once per step
    assert result["backend"] == "gloo" and result["peak_memory_gib"] is None
    # LoRA r16 on all seven projections of 2 layers (hidden 64, KV 2 x 16, intermediate 128): 16,384 per layer.
    assert result["model"]["lora_params"] == 2 * 16 * (64 + 64 + 2 * (64 + 32) + 64 + 64 + 3 * (64 + 128))
    assert len(result["step_times_s"]) == 3 and result["step_time_s"] > 0
    assert result["on_policy_max_abs_log_ratio"] == 0.0  # step 1 is on-policy: the same model, the same tokens
    assert result["chunked_vs_naive_max_abs_logprob_diff"] < 1e-4  # the trainer's chunked scoring path, checked
    assert result["losses"][1] != result["losses"][0]  # the first step changed the adapter


@pytest.fixture
def one_rank_gloo():
    gpu_check.init_one_rank_group(torch.device("cpu"))
    yield
    dist.destroy_process_group()


def test_a_collective_given_a_tensor_off_the_group_device_fails_the_check(one_rank_gloo):
    def body():
        with gpu_check.collective_path_forced():
            dist_sum(1.0)

    on_cpu = gpu_check.device_check("dist_sum", "cpu", body)
    assert on_cpu["ok"] and on_cpu["seen"] == ["asyncgrpo.distributed.all_reduce:cpu"]
    as_if_nccl = gpu_check.device_check("dist_sum", "cuda:0", body)  # what today's dist_sum hands NCCL
    assert not as_if_nccl["ok"]
    assert "asyncgrpo.distributed.all_reduce got ['cpu']" in as_if_nccl["error"]


def test_a_check_that_saw_no_collective_does_not_pass(one_rank_gloo):
    result = gpu_check.device_check("dist_sum", "cpu", lambda: dist_sum(1.0))  # one rank: no collective is made
    assert not result["ok"] and "nothing was checked" in result["error"]


def test_collectives_of_other_modules_are_not_recorded(one_rank_gloo):
    records: list[dict] = []
    before = dist.all_reduce
    with gpu_check.record_collectives(records):
        dist.all_reduce(torch.ones(1))  # called from this test module, not from asyncgrpo
    assert records == []
    assert dist.all_reduce is before  # restored


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_without_cuda_it_stops_with_exit_2_and_names_the_cpu_smoke_flag(capsys):
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not usable here" in err and "--cpu-smoke" in err
