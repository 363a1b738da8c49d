"""scripts/gpu_check.sh: what it counts as a failure (`backend_check.failures`), and its arguments. Its launches
run in tests/integration/test_gpu_check.py and, per backend, tests/integration/test_backend_step.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from lent_image import IMAGE_LACKS, as_on_the_image

from asyncgrpo.bench import gpu_check
from asyncgrpo.bench.backend_check import failures


def passing(**changes) -> dict:
    """A result that passes (fp32), with `changes`."""
    result = {"dtype": "float32", "micro": 2, "loss_on_policy": 0.1, "loss_a": 0.2, "loss_b": 0.2,
              "optimizer_steps_a": 1, "optimizer_steps_b": 1, "tokens_a": 40.0, "tokens_b": 40.0,
              "step_size": 1e-3, "max_abs_diff_a_b": 1e-8, "update_rel_diff_a_b": 1e-4, "chunked_vs_full_max_abs": 1e-6,
              "on_policy_max_abs_log_ratio": 0.0, "gathered_bytes": 1000, "adapter_bytes": 1000,
              "inv_freq_dtypes": ["torch.float32"]}
    return {**result, **changes}


def test_a_good_result_passes():
    assert failures(passing()) == []


@pytest.mark.parametrize("changes, says", [
    ({"loss_b": float("nan")}, "not finite"),
    ({"loss_a": float("inf")}, "not finite"),
    ({"optimizer_steps_b": 2}, "optimizer steps"),
    ({"tokens_b": 39.0}, "tokens counted"),
    ({"tokens_a": 0.0, "tokens_b": 0.0}, "tokens counted"),
    ({"step_size": 0.0}, "did not move"),
    ({"update_rel_diff_a_b": 0.011}, "micro-batches"),
    ({"chunked_vs_full_max_abs": 2e-4}, "chunked"),
    ({"on_policy_max_abs_log_ratio": 2e-4}, "on-policy"),
    ({"gathered_bytes": 1051}, "gather moved"),
    ({"inv_freq_dtypes": ["torch.bfloat16"]}, "inv_freq"),
])
def test_each_kind_of_failure_is_named(changes, says):
    found = failures(passing(**changes))
    assert len(found) == 1 and says in found[0], found


def test_bf16_bounds_are_looser():
    assert failures(passing(dtype="bfloat16", update_rel_diff_a_b=0.09, chunked_vs_full_max_abs=0.04)) == []
    assert failures(passing(dtype="bfloat16", update_rel_diff_a_b=0.11)) != []
    assert failures(passing(dtype="bfloat16", chunked_vs_full_max_abs=0.06)) != []


def test_the_gather_may_move_five_percent_more_than_the_adapter_and_no_more():
    assert failures(passing(gathered_bytes=1050)) == []
    assert failures(passing(gathered_bytes=1051)) != []


def test_defaults_are_the_real_shape_on_gpu_and_the_toy_on_cpu():
    gpu = gpu_check.parse_args([])
    assert (gpu.backends, gpu.model, gpu.dtype) == (list(gpu_check.BACKENDS), "shape:qwen2.5-1.5b", "bfloat16")
    cpu = gpu_check.parse_args(["--cpu-smoke", "--backends", "ddp,zero3"])
    assert (cpu.backends, cpu.model, cpu.dtype) == (["ddp", "zero3"], "toy", "float32")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--backends", "fsdp3"])


def test_zero_without_deepspeed_or_a_wheel_names_the_missing_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)  # as on a host without it
    reason = gpu_check.ensure_deepspeed(tmp_path)
    assert "DeepSpeed is not installed" in reason and str(tmp_path) in reason


def test_the_checks_whole_import_path_runs_without_what_the_lent_image_lacks():
    """The worker imports the trainer (recipe -> rollout factory -> ... -> rollout/link.py); link's TLS alone needs
    `cryptography`, which the lent image lacks, so it is imported where a certificate is made."""
    modules = ["asyncgrpo.bench.gpu_check", "asyncgrpo.bench.backend_check", "asyncgrpo.trainer.recipe", "asyncgrpo.cli"]
    probe = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; " \
            f"print(sorted(set({IMAGE_LACKS!r}) & {{m.partition('.')[0] for m in sys.modules}}))"
    proc = subprocess.run([sys.executable, "-c", probe], env=as_on_the_image(dict(os.environ)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_hidden_modules_are_really_hidden_from_the_child():
    proc = subprocess.run([sys.executable, "-c", "import cryptography"], env=as_on_the_image(dict(os.environ)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "No module named 'cryptography'" in proc.stderr
