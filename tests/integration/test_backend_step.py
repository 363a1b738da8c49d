"""The training step and the LoRA gather on every sharding backend, as NCCL on GPUs needs them, checked on 2 CPU ranks
(gloo) with real launches and no server (tests/integration/backend_worker.py does the work, rank 0 reports):

- one optimizer step per trainer step: the same global batch as 1 or as 2 micro-batches per rank gives the same LoRA
  update (fp32, 1e-5), and every backend gives the update DDP gives (so DeepSpeed honours `max_grad_norm`);
- every tensor asyncgrpo hands to torch.distributed during a step and a sync lies on the collective device, made
  `meta` here (not the CPU, as a GPU under NCCL, which has no CPU backend);
- under accelerate's `mixed_precision: bf16` the rotary `inv_freq` buffers stay fp32 and FSDP reduces in fp32
  (DeepSpeed's bf16 mode is translated into a bf16 base under fp32 LoRA weights: test_backends.py).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference_node.vllm_server import find_free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("backend_worker.py")
BACKENDS = ["ddp", "fsdp1", "fsdp2", "zero2", "zero3"]
# Collectives each backend's step + gather must have made through asyncgrpo (dist_sum/dist_max in the step; the
# sharded gathers' own calls).
EXPECTED_OPS = {"ddp": {"all_reduce"}, "fsdp1": {"all_reduce"}, "fsdp2": {"all_reduce", "all_gather", "send", "irecv"},
                "zero2": {"all_reduce"}, "zero3": {"all_reduce", "gather"}}


def launch(backend: str, out: Path, *accelerate_args: str, worker_args=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"launch/accelerate/{backend}_cpu.yaml",
           "--main_process_port", str(find_free_port()), *accelerate_args, str(WORKER), "--out", str(out),
           *worker_args]
    return subprocess.run(cmd, cwd=REPO, env=cpu_launch_env(backend), capture_output=True, text=True, timeout=600)


# A rank of this worker aborted twice in two full-suite runs on 2026-11-30 (zero2, then fsdp2 with bf16) with
# "terminate called without an active exception" right after the checkpoint's save, before any result is written;
# the cause is not found yet (a C++ thread destroyed while joinable; real `asyncgrpo train` launches have not shown
# it). Such a launch is run once more; any other failure, or the same one twice, fails the test.
NATIVE_ABORT = "terminate called without an active exception"


def run_worker(backend: str, out: Path, *accelerate_args: str, worker_args=()) -> dict:
    proc = launch(backend, out, *accelerate_args, worker_args=worker_args)
    if proc.returncode != 0 and NATIVE_ABORT in proc.stderr and not (out / "result.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        proc = launch(backend, out, *accelerate_args, worker_args=worker_args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One launch per backend; every test below reads its report."""
    return {b: (run_worker(b, tmp_path_factory.mktemp(b)), tmp_path_factory.getbasetemp()) for b in BACKENDS}


def _result(results, backend):
    return results[backend][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_optimizer_step_per_trainer_step_whatever_the_micro_batches(results, backend):
    r = _result(results, backend)
    assert (r["backend"], r["world_size"], r["micro"]) == (backend, 2, 2)
    assert (r["optimizer_steps_a"], r["optimizer_steps_b"]) == (1, 1)
    assert r["tokens_a"] == r["tokens_b"] > 0
    assert r["loss_a"] == pytest.approx(r["loss_b"], abs=1e-5)
    assert r["max_abs_diff_a_b"] < 1e-5, r["max_abs_diff_a_b"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_checks_verdict_passes_on_every_backend_under_gloo(results, backend):
    # scripts/gpu_check.sh judges its GPU launches with this same function: here it keeps them from rotting.
    from asyncgrpo.bench.backend_check import failures

    assert failures(_result(results, backend)) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_collective_tensor_lies_on_the_collective_device(results, backend):
    audit = _result(results, backend)["audit"]
    assert {rec["op"] for rec in audit} >= EXPECTED_OPS[backend]
    off_device = [rec for rec in audit if rec["devices"] != ["meta"]]
    assert not off_device, off_device[:3]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "ddp"])
def test_every_backend_makes_the_update_ddp_makes(results, backend, tmp_path_factory):
    def update(b):
        return load_file(str(next(tmp_path_factory.getbasetemp().glob(f"{b}*")) / "update.safetensors"))

    reference, mine = update("ddp"), update(backend)
    assert set(reference) == set(mine)
    assert max(float((reference[k] - mine[k]).abs().max()) for k in reference) < 1e-5
    moved = max(float(t.abs().max()) for k, t in mine.items() if "lora_B" in k)
    assert moved > 1e-4  # the step really moved the adapter
    if backend.startswith("zero"):  # the engine clips with max_grad_norm (0.05 in the worker), not the json's value
        assert _result(results, backend)["deepspeed_gradient_clipping"] == 0.05


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_bf16_mixed_precision_keeps_rotary_buffers_and_gradient_reduction_fp32(backend, tmp_path):
    r = run_worker(backend, tmp_path, "--mixed_precision", "bf16", worker_args=["--torch_dtype", "bfloat16"])
    assert r["mixed_precision"] == "bf16"
    assert r["inv_freq_dtypes"] == ["torch.float32"]
    assert r["fsdp_reduce_dtype"] == "torch.float32"
    assert (r["optimizer_steps_a"], r["optimizer_steps_b"]) == (1, 1)
    # Gradients accumulated over 2 micro-batches (no_sync) make the update one micro-batch makes, within bf16's
    # rounding (gpu_check's bound, 0.1 of the update's norm; measured 0.044 FSDP1, 0.047 FSDP2): FSDP1 does not
    # accumulate the LoRA gradients more lossily than FSDP2.
    from asyncgrpo.bench.backend_check import failures

    assert failures(r) == []

